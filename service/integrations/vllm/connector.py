"""`KVHandoffConnector`: kvhandoff as a vLLM KV connector (V1 API, vLLM 0.32 and 0.34).

Loaded by vLLM from `--kv-transfer-config '{"kv_connector": "KVHandoffConnector",
"kv_connector_module_path": "kvhandoff.service.integrations.vllm.connector", "kv_role":
"kv_producer" | "kv_consumer", "kv_connector_extra_config": {"config": "kvhandoff.toml"}}'`
(settings: `settings.py`). vLLM constructs it once per role: in the scheduler (`SchedulerHalf`,
`scheduler.py`) and in every worker (`WorkerHalf`, `worker.py`, which runs the worker's
kvhandoff service); this class only routes vLLM's hooks to the half of its role. What it does
not support is refused here, at construction, by name (`support.py`).

vLLM's PD flow over it: the proxy sends the request to the prefill with
`kv_transfer_params.do_remote_decode`; the prefill's scheduler keeps the finished request's
blocks and answers params naming its workers' services and the handoff (`metadata.py`); the
prefill's workers signal the blocks ready; the proxy passes the params to the decode, whose
scheduler asks for the prompt's KV and allocates blocks, and whose workers create the handoff
into them; the prefill's services push the bytes (landed and verified by default). Each side
reports the request done only once kvhandoff is done with its blocks.

vLLM 0.34 asks more of a connector, answered here (0.32 never calls these):
`kv_cache_access` (landed mode never registers vLLM's KV cache: `IN_PROCESS`; direct mode
registers it with Mooncake: `REGISTERS`), `may_load_async` (only a decode request carrying
kvhandoff params loads asynchronously), sleep mode (refused: `supports_sleep_mode`), and the
release of an emptied KV cache's memory (`unregister_kv_caches`: refused in direct mode).
"""

from __future__ import annotations

import logging
import os
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)

from kvhandoff.service.integrations.vllm.layouts import Unsupported
from kvhandoff.service.integrations.vllm.metadata import StepMeta
from kvhandoff.service.integrations.vllm.scheduler import SchedulerHalf
from kvhandoff.service.integrations.vllm.settings import connector_settings, transfer_mode
from kvhandoff.service.integrations.vllm.support import refuse_unsupported, service_role
from kvhandoff.service.integrations.vllm.worker import WorkerHalf

try:  # vLLM 0.34: how a connector's workers reach the KV cache
    from vllm.config.kv_transfer import KVCacheAccess
except ImportError:  # vLLM 0.32 does not ask
    KVCacheAccess = None

log = logging.getLogger("kvhandoff.vllm")


class KVHandoffConnector(KVConnectorBase_V1, SupportsHMA):
    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        transfer = vllm_config.kv_transfer_config
        self.service_role = service_role(transfer.kv_role)
        block_size = refuse_unsupported(vllm_config, kv_cache_config, role=self.service_role)
        settings = connector_settings(transfer.kv_connector_extra_config)
        self.scheduler: SchedulerHalf | None = None
        self.worker: WorkerHalf | None = None
        if role == KVConnectorRole.SCHEDULER:
            self.scheduler = SchedulerHalf(
                engine_id=str(transfer.engine_id),
                block_size=block_size,
                producer=self.service_role == "prefill",
                consumer=self.service_role == "decode",
                kv_cache_config=kv_cache_config,
            )
        else:
            from vllm.distributed.parallel_state import get_pp_group, get_tp_group

            parallel = vllm_config.parallel_config
            self.worker = WorkerHalf(
                settings,
                kv_cache_config,
                role=self.service_role,
                tp_rank=int(get_tp_group().rank_in_group),
                tp_size=int(parallel.tensor_parallel_size),
                pp_rank=int(get_pp_group().rank_in_group),
                pp_size=int(parallel.pipeline_parallel_size),
                env=os.environ,  # read once, here: the service's `KVHANDOFF_*` overrides
            )

    @classmethod
    def kv_cache_access(cls, kv_transfer_config: Any) -> Any:
        """vLLM 0.34: how the workers reach vLLM's KV cache. In landed mode (the default)
        only kvhandoff's own landing arena or staging buffer is registered with Mooncake;
        vLLM's blocks are read and written by copies inside the worker process
        (`IN_PROCESS`). In direct mode the KV cache itself is registered with Mooncake
        (`REGISTERS`: RDMA needs each segment backed by one physical allocation)."""
        settings = connector_settings(kv_transfer_config.kv_connector_extra_config)
        direct = transfer_mode(settings, os.environ) == "direct"
        return KVCacheAccess.REGISTERS if direct else KVCacheAccess.IN_PROCESS

    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config: Any) -> bool:
        """vLLM 0.34: no. Sleep releases and remaps the KV cache, which the worker's service
        holds views of (and, in direct mode, a Mooncake registration of); it neither gives
        them up nor takes them again. vLLM refuses `--enable-sleep-mode` on this answer."""
        return False

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: Any) -> str | None:
        """A layer-compact layout: each layer's blocks one contiguous pool (`layouts.py`)."""
        model = vllm_config.model_config
        return None if model is None or model.use_mla else "LBHNC"

    # ------------------------------------------------------------------ scheduler side

    def _sched(self) -> SchedulerHalf:
        assert self.scheduler is not None, "a scheduler-side hook called on a worker"
        return self.scheduler

    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        return self._sched().matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        self._sched().after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> StepMeta:
        return self._sched().build_meta()

    def update_connector_output(self, connector_output: Any) -> None:
        self._sched().sent(connector_output.finished_sending)

    def on_new_request(self, request: Any) -> None:
        self._sched().new_request(request)

    def may_load_async(self, request: Any) -> bool:
        """vLLM 0.34, at every queueing of a request: whether `get_num_new_matched_tokens`
        may load it asynchronously."""
        return self._sched().may_load(request)

    def request_finished(
        self, request: Any, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        return self._sched().finished(request, (block_ids,))

    def request_finished_all_groups(
        self, request: Any, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        """vLLM's hybrid allocator: the request's blocks of every KV cache group."""
        return self._sched().finished(request, block_ids)

    def get_loaded_kv_cache_group_ids(self, request: Any) -> tuple[int, ...]:
        """A load restores every transfer group (attention pages and Mamba state)."""
        return tuple(self._kv_cache_config.transfer_group_ids)

    def has_pending_push_work(self) -> bool:
        return self.scheduler is not None and self.scheduler.holding()

    def set_xfer_handshake_metadata_pp_aware(self, metadata: dict[tuple[int, int], Any]) -> None:
        self._sched().set_services(metadata)

    def set_xfer_handshake_metadata(self, metadata: dict[int, Any]) -> None:
        self._sched().set_services({(0, t): m for t, m in metadata.items()})

    # ------------------------------------------------------------------ worker side

    def _work(self) -> WorkerHalf:
        assert self.worker is not None, "a worker-side hook called in the scheduler"
        return self.worker

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        self._work().register(kv_caches)

    def get_handshake_metadata(self) -> Any:
        return self._work().handshake()

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        if isinstance(meta, StepMeta):
            self._work().step(meta)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # loads complete between steps (vLLM waits on `finished_recving`)

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kw: Any) -> None:
        return  # a request's blocks are signalled whole once it finished (`request_finished`)

    def wait_for_save(self) -> None:
        return

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        sending, received, failed = self._work().results(finished_req_ids)
        return KVConnectorTransferResults(
            finished_sending=sending, finished_recving=received, failed_recving=failed
        )

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        sending, received, _ = self._work().results(finished_req_ids)
        return sending, received

    def unregister_kv_caches(self) -> None:
        """vLLM 0.34, before it releases an emptied KV cache's memory (a weight update; sleep
        is refused). Landed mode registered none of it, and vLLM keeps its virtual range, so
        the service's views stay valid; a direct-mode registration would point at released
        memory, so that update is refused by name."""
        if self.worker is not None and self.worker.direct:
            raise Unsupported(
                "releasing the KV cache's memory (a weight update) under the kvhandoff "
                "connector in direct mode: Mooncake holds a registration of it"
            )

    def restore_kv_caches(self) -> None:
        """vLLM 0.34, after the memory `unregister_kv_caches` let go is back: nothing to
        redo (landed mode registered none of it)."""
        return

    def shutdown(self) -> None:
        if self.worker is not None:
            self.worker.stop()
