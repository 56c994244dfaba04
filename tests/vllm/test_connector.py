"""The connector's scheduler half inside vLLM's own scheduler (`vllm.v1.core.sched.Scheduler`,
its KV cache manager and block pool, the connector loaded by module path as a server loads
it): what vLLM does with the blocks at each answer the connector gives — the prefill keeps a
finished request's blocks until its workers report it sent, the decode holds a loading
request's blocks until its workers report it received (failed or not, aborted or not), and
recomputes or fails a failed load as its policy says. The start-up refusals by name."""

from __future__ import annotations

import enum
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from vllm.config import (
    CacheConfig,
    DeviceConfig,
    KVTransferConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    VllmConfig,
)
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    MambaSpec,
)
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request, RequestStatus
from vllm.v1.structured_output import StructuredOutputManager

from kvhandoff.service.integrations.vllm.connector import KVHandoffConnector
from kvhandoff.service.integrations.vllm.layouts import Unsupported, state_component
from kvhandoff.service.integrations.vllm.metadata import PARAMS_KEY, ServiceHandshake, StepMeta
from kvhandoff.service.integrations.vllm.settings import ConnectorSettings
from kvhandoff.service.integrations.vllm.worker import WorkerHalf
from tests.vllm import models

BLOCKS = 64
NAMES = [f"model.layers.{i}.self_attn.attn" for i in range(models.LLAMA_LAYERS)]
PREFILL_URL = "http://127.0.0.1:7001"
SPEC = FullAttentionSpec(
    block_size=models.BLOCK, num_kv_heads=2, head_size=32, dtype=torch.bfloat16
)


def kv_cache_config(groups: list[KVCacheGroupSpec] | None = None) -> KVCacheConfig:
    return KVCacheConfig(
        num_blocks=BLOCKS,
        kv_cache_tensors=[],
        kv_cache_groups=groups or [KVCacheGroupSpec(NAMES, SPEC)],
    )


def vllm_config(llama: Path, kv_role: str, *, policy: str = "fail", pp: int = 1) -> VllmConfig:
    cache = CacheConfig(block_size=models.BLOCK, cache_dtype="auto", enable_prefix_caching=True)
    cache.num_gpu_blocks = BLOCKS
    return VllmConfig(
        model_config=ModelConfig(model=str(llama), dtype="bfloat16", seed=0, max_model_len=512),
        scheduler_config=SchedulerConfig(
            max_num_seqs=16,
            max_num_batched_tokens=512,
            max_model_len=512,
            is_encoder_decoder=False,
        ),
        cache_config=cache,
        parallel_config=ParallelConfig(pipeline_parallel_size=pp),
        kv_transfer_config=KVTransferConfig(
            kv_connector="KVHandoffConnector",
            kv_connector_module_path="kvhandoff.service.integrations.vllm.connector",
            kv_role=kv_role,
            kv_load_failure_policy=policy,
        ),
        device_config=DeviceConfig("cpu"),
    )


def scheduler(llama: Path, kv_role: str, **kw: Any) -> Scheduler:
    config = vllm_config(llama, kv_role, **kw)
    sched = Scheduler(
        config, kv_cache_config(), StructuredOutputManager(config), block_size=models.BLOCK
    )
    assert isinstance(sched.connector, KVHandoffConnector)
    # What the engine core does at start-up with the workers' handshake metadata.
    sched.connector.set_xfer_handshake_metadata_pp_aware({(0, 0): ServiceHandshake(PREFILL_URL)})
    return sched


_HASHER: list[Callable[[Request], Any]] = []


def request(req_id: str, prompt: list[int], max_tokens: int, params: dict[str, Any]) -> Request:
    if not _HASHER:
        init_none_hash(sha256)
        _HASHER.append(get_request_block_hasher(models.BLOCK, sha256))
    sampling = SamplingParams(
        max_tokens=max_tokens, temperature=0.0, extra_args={"kv_transfer_params": params}
    )
    return Request(req_id, list(prompt), sampling, None, block_hasher=_HASHER[0])


def run(sched: Scheduler, connector: KVConnectorOutput | None = None) -> tuple[Any, Any]:
    """One engine step: schedule, then a model output sampling token 7 for everything run."""
    out = sched.schedule()
    ids = list(out.num_scheduled_tokens)
    result = ModelRunnerOutput(
        req_ids=ids,
        req_id_to_index={r: i for i, r in enumerate(ids)},
        sampled_token_ids=[[7] for _ in ids],
        kv_connector_output=connector,
    )
    return out, sched.update_from_output(out, result)


def free(sched: Scheduler) -> int:
    return int(sched.kv_cache_manager.block_pool.get_num_free_blocks())


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return models.write_llama(tmp_path_factory.mktemp("unit-models") / "llama")


PROMPT = list(range(3, 40))  # 37 tokens: two 32-token blocks
REMOTE_DECODE = {"do_remote_decode": True}


def prefilled(sched: Scheduler, req_id: str = "p-1") -> dict[str, Any]:
    sched.add_request(request(req_id, PROMPT, 1, dict(REMOTE_DECODE)))
    _, outputs = run(sched)
    [out] = outputs[0].outputs
    assert out.finish_reason is not None
    return dict(out.kv_transfer_params)


def test_prefill_keeps_the_blocks_until_its_workers_report_the_send(llama: Path) -> None:
    sched = scheduler(llama, "kv_producer")
    before = free(sched)
    params = prefilled(sched)
    mine = params[PARAMS_KEY]
    assert params["do_remote_prefill"] is True and params["do_remote_decode"] is False
    assert mine["services"] == [[PREFILL_URL]] and mine["tokens"] == len(PROMPT)
    assert free(sched) == before - 2  # held for the decode
    assert sched.has_requests()  # vLLM keeps stepping so the workers' reports come
    out, _ = run(sched)
    meta = out.kv_connector_metadata
    assert isinstance(meta, StepMeta) and [s.req_id for s in meta.sends] == ["p-1"]
    [send] = meta.sends
    assert send.handoff == mine["id"] and len(send.pages) == 2
    assert "p-1" in out.finished_req_ids  # what the workers gate their report on
    run(sched)
    assert free(sched) == before - 2  # no report: still held
    run(sched, KVConnectorOutput(finished_sending={"p-1"}))
    assert free(sched) == before and not sched.has_requests()


def test_an_aborted_prefill_moves_nothing_and_frees_at_once(llama: Path) -> None:
    sched = scheduler(llama, "kv_producer")
    before = free(sched)
    sched.add_request(request("p-2", PROMPT, 4, dict(REMOTE_DECODE)))
    run(sched)
    sched.finish_requests("p-2", RequestStatus.FINISHED_ABORTED)
    assert free(sched) == before
    out, _ = run(sched)
    assert out.kv_connector_metadata.sends == []


def remote_params(llama: Path, tokens: int = len(PROMPT)) -> dict[str, Any]:
    params = prefilled(scheduler(llama, "kv_producer"))
    params[PARAMS_KEY]["tokens"] = tokens
    return params


def loading(sched: Scheduler, params: dict[str, Any], req_id: str = "d-1") -> Any:
    """A decode request whose load was handed to the workers: (its Recv, the request)."""
    req = request(req_id, PROMPT, 3, params)
    sched.add_request(req)
    out, _ = run(sched)
    assert req.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    [recv] = out.kv_connector_metadata.recvs
    return recv, req


def test_decode_loads_the_prompt_into_its_blocks_then_recomputes_the_last_token(
    llama: Path,
) -> None:
    sched = scheduler(llama, "kv_consumer")
    params = remote_params(llama)
    recv, req = loading(sched, params)
    assert recv.req_id == "d-1" and recv.prefix_pages == 0
    assert recv.pages == sched.kv_cache_manager.get_block_ids("d-1")[0][:2]
    assert recv.params.id == params[PARAMS_KEY]["id"]
    out, _ = run(sched)  # not reported yet: nothing runs
    assert "d-1" not in out.num_scheduled_tokens
    out, _ = run(sched, KVConnectorOutput(finished_recving={"d-1"}))
    out, _ = run(sched)
    assert out.num_scheduled_tokens["d-1"] == 1  # the prompt's last token, on loaded KV
    assert req.num_computed_tokens == len(PROMPT)


def test_decode_takes_only_what_its_prefix_cache_lacks(llama: Path) -> None:
    sched = scheduler(llama, "kv_consumer")
    sched.add_request(request("local", [*PROMPT[:32], 9, 9], 1, {}))  # caches block 0
    run(sched)
    run(sched)
    recv, _ = loading(sched, remote_params(llama))
    assert recv.prefix_pages == 1
    assert recv.pages == sched.kv_cache_manager.get_block_ids("d-1")[0][1:2]


@pytest.mark.parametrize("policy", ["fail", "recompute"])
def test_a_failed_load_holds_the_blocks_until_reported_then_follows_the_policy(
    llama: Path, policy: str
) -> None:
    sched = scheduler(llama, "kv_consumer", policy=policy)
    before = free(sched)
    _, req = loading(sched, remote_params(llama))
    for _ in range(3):
        run(sched)
    assert free(sched) < before  # the load may still write: vLLM holds the blocks
    run(sched, KVConnectorOutput(finished_recving={"d-1"}, failed_recving={"d-1"}))
    if policy == "fail":
        assert req.status == RequestStatus.FINISHED_ERROR
        assert free(sched) == before
    else:
        out, _ = run(sched)
        assert out.num_scheduled_tokens["d-1"] == len(PROMPT)  # computed here, from scratch


def test_a_request_aborted_while_loading_keeps_its_blocks_until_the_load_ends(
    llama: Path,
) -> None:
    sched = scheduler(llama, "kv_consumer")
    before = free(sched)
    loading(sched, remote_params(llama))
    sched.finish_requests("d-1", RequestStatus.FINISHED_ABORTED)
    out, _ = run(sched)
    assert "d-1" in out.finished_req_ids  # the workers abort its handoff on this
    assert free(sched) < before
    run(sched, KVConnectorOutput(finished_recving={"d-1"}, failed_recving={"d-1"}))
    assert free(sched) == before


def test_params_for_another_prompt_are_computed_here(llama: Path) -> None:
    sched = scheduler(llama, "kv_consumer")
    req = request("d-1", PROMPT, 1, remote_params(llama, tokens=len(PROMPT) + 1))
    sched.add_request(req)
    out, _ = run(sched)
    assert out.num_scheduled_tokens["d-1"] == len(PROMPT)
    assert out.kv_connector_metadata.recvs == []


def construct(config: VllmConfig, kv: KVCacheConfig | None = None) -> KVHandoffConnector:
    return KVHandoffConnector(config, KVConnectorRole.SCHEDULER, kv or kv_cache_config())


def test_kv_both_is_refused_by_name(llama: Path) -> None:
    with pytest.raises(Unsupported, match="kv_role 'kv_both'"):
        construct(vllm_config(llama, "kv_both"))


def test_a_pp_decode_is_refused(llama: Path) -> None:
    with pytest.raises(Unsupported, match="pipeline parallelism on the decode"):
        construct(vllm_config(llama, "kv_consumer", pp=2))


HYBRID_ATTN = ["model.layers.1.self_attn.attn"]
HYBRID_MAMBA = ["model.layers.0.mixer"]


def hybrid_scheduler(llama: Path, kv_role: str) -> Scheduler:
    """vLLM's scheduler over a hybrid allocator's groups: one attention layer, one Mamba
    layer, each group its own blocks per request."""
    mamba = MambaSpec(
        block_size=models.BLOCK, shapes=((3, 96),), dtypes=(torch.bfloat16,),
        page_size_padded=SPEC.page_size_bytes,
    )  # fmt: skip
    kv = kv_cache_config(
        [KVCacheGroupSpec(HYBRID_ATTN, SPEC), KVCacheGroupSpec(HYBRID_MAMBA, mamba)]
    )
    config = vllm_config(llama, kv_role)
    config.scheduler_config.disable_hybrid_kv_cache_manager = False
    sched = Scheduler(config, kv, StructuredOutputManager(config), block_size=models.BLOCK)
    sched.connector.set_xfer_handshake_metadata_pp_aware({(0, 0): ServiceHandshake(PREFILL_URL)})
    return sched


def test_a_hybrid_prefill_stops_a_token_short_and_sends_the_mamba_state(llama: Path) -> None:
    sched = hybrid_scheduler(llama, "kv_producer")
    req = request("p-h", PROMPT, 4, dict(REMOTE_DECODE))
    sched.add_request(req)
    out, _ = run(sched)
    assert out.num_scheduled_tokens["p-h"] == len(PROMPT) - 1  # the decode computes token N
    attn, state = sched.kv_cache_manager.get_block_ids("p-h")
    out, _ = run(sched)
    [send] = out.kv_connector_metadata.sends
    assert send.pages == attn[:2]
    assert send.slots == {state_component(1): [b for b in state if b][-1]}


def test_a_hybrid_decode_loads_all_but_the_last_token_into_both_groups(llama: Path) -> None:
    params = prefilled(hybrid_scheduler(llama, "kv_producer"), "p-h")
    assert params[PARAMS_KEY]["tokens"] == len(PROMPT) - 1
    sched = hybrid_scheduler(llama, "kv_consumer")
    recv, req = loading(sched, params)
    attn, state = sched.kv_cache_manager.get_block_ids("d-1")
    assert recv.pages == attn[:2] and recv.prefix_pages == 0
    assert recv.slots == {state_component(1): [b for b in state if b][-1]}
    run(sched, KVConnectorOutput(finished_recving={"d-1"}))
    out, _ = run(sched)
    assert out.num_scheduled_tokens["d-1"] == 1  # token N, on the loaded state
    assert req.num_computed_tokens == len(PROMPT)


def test_two_attention_groups_are_refused_by_name(llama: Path) -> None:
    groups = [KVCacheGroupSpec(NAMES[:2], SPEC), KVCacheGroupSpec(NAMES[2:], SPEC)]
    with pytest.raises(Unsupported, match=r"groups \[0, 1\] all hold attention"):
        construct(vllm_config(llama, "kv_producer"), kv_cache_config(groups))


def test_the_entry_point_names_the_connector_for_vllm() -> None:
    """vLLM's own plugin loader finds the entry point (the vLLM environment installs this
    package editable), and its factory then builds the connector by name alone."""
    from importlib.metadata import entry_points

    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.plugins import load_general_plugins

    [entry] = [e for e in entry_points(group="vllm.general_plugins") if e.name == "kvhandoff"]
    assert entry.value == "kvhandoff.service.integrations.vllm.plugin:register"
    load_general_plugins()
    load_general_plugins()  # every vLLM process may call it again: no error
    assert KVConnectorFactory._registry["KVHandoffConnector"]() is KVHandoffConnector


def test_params_name_every_prefill_worker_by_tp_rank_then_pp_stage(llama: Path) -> None:
    """What vLLM's engine core gathers from a TP 2 x PP 2 prefill's workers, keyed (pp, tp):
    the decode's TP rank r takes `services[r]`, every PP stage of it."""
    sched = scheduler(llama, "kv_producer")
    urls = {(p, t): f"http://w{p}{t}:1" for p in (0, 1) for t in (0, 1)}
    sched.connector.set_xfer_handshake_metadata_pp_aware(
        {key: ServiceHandshake(url) for key, url in urls.items()}
    )
    params = prefilled(sched)
    assert params[PARAMS_KEY]["services"] == [
        ["http://w00:1", "http://w10:1"],
        ["http://w01:1", "http://w11:1"],
    ]
    with pytest.raises(RuntimeError, match=r"\(pp, tp\) \[\(1, 0\)\]"):
        sched.connector.set_xfer_handshake_metadata_pp_aware(
            {key: ServiceHandshake(u) for key, u in urls.items() if key != (1, 0)}
        )


# -- vLLM 0.34's additions, against 0.32's classes (0.32 never calls them) ------------------------


def test_may_load_async_only_for_a_decode_request_with_kvhandoff_params(llama: Path) -> None:
    """What 0.34 asks at every queueing agrees with what `get_num_new_matched_tokens` then
    does with the request (a load in the background, or none)."""
    decode = scheduler(llama, "kv_consumer")
    params = remote_params(llama)
    nixl = {"do_remote_prefill": True, "remote_block_ids": [1, 2], "remote_engine_id": "e"}
    cases = {"kvhandoff": (params, True), "nixl": (nixl, False), "plain": ({}, False)}
    for name, (raw, expected) in cases.items():
        req = request(f"d-{name}", PROMPT, 3, dict(raw))
        assert decode.connector.may_load_async(req) is expected, name
        _, load_async = decode.connector.get_num_new_matched_tokens(req, 0)
        assert load_async is expected, name
    prefill = scheduler(llama, "kv_producer")
    assert not prefill.connector.may_load_async(request("p-x", PROMPT, 3, dict(params)))


def transfer_config(tmp_path: Path, **settings: Any) -> KVTransferConfig:
    toml = tmp_path / "kvhandoff.toml"
    toml.write_text(f'[server]\nstate_dir = "{tmp_path}"\n[auth]\npeer = "{"s" * 32}"\n')
    return KVTransferConfig(
        kv_connector="KVHandoffConnector",
        kv_connector_module_path="kvhandoff.service.integrations.vllm.connector",
        kv_role="kv_consumer",
        kv_connector_extra_config={"config": str(toml), "settings": settings},
    )


def test_kv_cache_access_says_whether_vllms_kv_cache_is_registered(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """0.34's `KVCacheAccess` flags (absent from 0.32: its members by name here): landed mode
    registers only kvhandoff's own buffers, direct mode registers vLLM's KV cache."""
    from kvhandoff.service.integrations.vllm import connector

    flags = enum.IntFlag("KVCacheAccess", ["REGISTERS", "EXPORTS_FD"])
    monkeypatch.setattr(connector, "KVCacheAccess", flags)
    monkeypatch.setattr(flags, "IN_PROCESS", flags(0), raising=False)
    landed = KVHandoffConnector.kv_cache_access(transfer_config(tmp_path))
    direct = KVHandoffConnector.kv_cache_access(
        transfer_config(tmp_path, **{"transfer.mode": "direct"})
    )
    assert landed == flags(0) and direct == flags.REGISTERS
    assert KVHandoffConnector.supports_sleep_mode(transfer_config(tmp_path)) is False


def test_releasing_the_kv_cache_is_refused_by_name_only_where_mooncake_registered_it(
    llama: Path,
) -> None:
    conn = construct(vllm_config(llama, "kv_consumer"))
    conn.unregister_kv_caches()  # the scheduler's half holds no memory
    conn.worker = WorkerHalf(
        ConnectorSettings(), None, role="decode", tp_rank=0, tp_size=1, pp_rank=0, pp_size=1,
        env={},
    )  # fmt: skip
    conn.unregister_kv_caches()  # landed: nothing of vLLM's is registered
    conn.restore_kv_caches()
    conn.worker.direct = True
    with pytest.raises(Unsupported, match="direct mode"):
        conn.unregister_kv_caches()
