"""The connector's scheduler half: which requests move, and what each worker is told.

Called by vLLM's scheduler (one per engine, in the engine-core process): on the prefill,
`request_finished` keeps a finished request's blocks (vLLM frees them only once every worker
reported the request in `finished_sending`) and answers the params the proxy carries to the
decode; on the decode, `get_num_new_matched_tokens` asks for the prompt's KV when the params
carry a kvhandoff handoff, and `update_state_after_alloc` hands the allocated blocks to the
workers, which create the handoff. `build_connector_meta` passes both to the workers once
per step. The decode never frees a loading request's blocks here: vLLM holds them while the
request waits for remote KV, which the workers end only once kvhandoff released the pages
(`worker.py`).

A hybrid model's Mamba state moves at vLLM's convention (its NixlConnector's): the prefill
computes the prompt but its last token (`on_new_request` drops it), so the decode, loading
the state after N - 1 tokens and their KV, computes token N itself. A request's attention
pages are its blocks of the one attention group; each Mamba group's slot is the request's
running-state block in that group (its last).
"""

from __future__ import annotations

import logging
import re
from typing import Any

import msgspec

from kvhandoff.service.integrations.vllm.layouts import (
    attention_group,
    state_component,
    state_groups,
)
from kvhandoff.service.integrations.vllm.metadata import (
    PARAMS_KEY,
    PARAMS_VERSION,
    HandoffParams,
    Recv,
    Send,
    ServiceHandshake,
    StepMeta,
    params_of,
)

log = logging.getLogger("kvhandoff.vllm")

#: Set in a hybrid prefill request's params once its last prompt token was dropped.
TRUNCATED = "_kvhandoff_truncated"
#: Request statuses after which the prefill's KV is whole (vLLM's `RequestStatus` names).
SENDABLE = frozenset({"FINISHED_LENGTH_CAPPED", "FINISHED_STOPPED"})
_NOT_ID = re.compile(r"[^A-Za-z0-9._:@-]")


def handoff_base(engine_id: str, req_id: str) -> str:
    """A handoff id for vLLM request `req_id`: its characters an id may hold, the engine's id
    first (request ids are unique per engine only)."""
    return _NOT_ID.sub("_", f"vllm-{engine_id}-{req_id}")[:240]


def pages_for(tokens: int, block_size: int) -> int:
    return -(-int(tokens) // int(block_size))


class SchedulerHalf:
    def __init__(
        self,
        *,
        engine_id: str,
        block_size: int,
        producer: bool,
        consumer: bool,
        kv_cache_config: Any,
    ) -> None:
        self.engine_id = engine_id
        self.block_size = block_size
        self.producer, self.consumer = producer, consumer
        self.kv_cache_config = kv_cache_config
        self.attention = attention_group(kv_cache_config)
        self.mamba = state_groups(kv_cache_config)
        # Prompt tokens the decode computes itself: the last one, for Mamba state.
        self.backoff = 1 if self.mamba else 0
        self._services: list[list[str]] = []  # [tp][pp] -> URL, from the workers' handshake
        self._sends: list[Send] = []
        self._recvs: list[Recv] = []
        self._held: set[str] = set()  # prefill requests whose blocks wait for their decode

    def set_services(self, metadata: dict[tuple[int, int], Any]) -> None:
        """The workers' service URLs by (pp_rank, tp_rank), once at start-up."""
        pp = 1 + max((p for p, _ in metadata), default=-1)
        tp = 1 + max((t for _, t in metadata), default=-1)
        services = [["" for _ in range(pp)] for _ in range(tp)]
        for (p, t), meta in metadata.items():
            if not isinstance(meta, ServiceHandshake):
                raise TypeError(f"worker ({p}, {t}) sent {type(meta).__name__}")
            services[t][p] = meta.url
        missing = [(p, t) for t in range(tp) for p in range(pp) if not services[t][p]]
        if missing:
            raise RuntimeError(f"no kvhandoff service URL from workers (pp, tp) {missing}")
        self._services = services

    # ------------------------------------------------------------------ decode

    def matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        """Tokens the prefill holds beyond the decode's own prefix, loaded asynchronously: the
        whole prompt (vLLM recomputes its last token), or all but its last (a hybrid model's
        decode computes that one on the loaded state)."""
        params = self._remote_prefill(request)
        if params is None:
            return 0, False
        count = int(params.tokens) - int(num_computed_tokens)
        return (count, True) if count > 0 else (0, False)

    def may_load(self, request: Any) -> bool:
        """Cheap and quiet (vLLM 0.34 asks at every queueing): a decode request whose params
        name a kvhandoff handoff, which `matched_tokens` may load asynchronously."""
        raw = request.kv_transfer_params
        return bool(self.consumer and raw and raw.get("do_remote_prefill") and PARAMS_KEY in raw)

    def after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        params = self._remote_prefill(request)
        if params is None:
            return
        request.kv_transfer_params["do_remote_prefill"] = False  # one load per request
        if num_external_tokens <= 0:
            return  # the decode holds the whole prompt: nothing to load
        groups = self._transfer(blocks.blocks)
        group = list(groups[self.attention])  # the prompt's pages
        prefix = 0
        while prefix < len(group) and group[prefix].block_hash is not None:
            prefix += 1  # leading blocks of the decode's own prefix cache
        end = pages_for(prefix * self.block_size + num_external_tokens, self.block_size)
        pages = [int(b.block_id) for b in group[prefix:end]]
        slots = self._slots([[b.block_id for b in g if not b.is_null] for g in groups])
        self._recvs.append(Recv(request.request_id, params, pages, prefix, slots))

    def _transfer(self, per_group: Any) -> tuple[Any, ...]:
        """The transfer groups' entries of a per-group tuple (vLLM's group order)."""
        return tuple(self.kv_cache_config.select_transfer_block_ids(list(per_group)))

    def _slots(self, block_ids: Any) -> dict[str, int]:
        """Each Mamba group's slot: the request's running-state block (its last)."""
        return {state_component(g): int(block_ids[g][-1]) for g in self.mamba if block_ids[g]}

    def _remote_prefill(self, request: Any) -> HandoffParams | None:
        raw = request.kv_transfer_params
        if not self.consumer or not raw or not raw.get("do_remote_prefill"):
            return None
        try:
            params = params_of(raw)
        except ValueError as exc:
            log.warning("request %s: %s; computing it here", request.request_id, exc)
            return None
        prompt = len(request.prompt_token_ids or ())
        if params is not None and params.tokens != prompt - self.backoff:
            log.warning(
                "request %s: the prefill holds %d prompt tokens, this decode takes %d of its "
                "%d; computing it here",
                request.request_id,
                params.tokens,
                prompt - self.backoff,
                prompt,
            )
            return None
        return params

    # ------------------------------------------------------------------ prefill

    def new_request(self, request: Any) -> None:
        """A hybrid model's prefill computes its prompt but the last token (the decode
        computes that one on the loaded state), and generates nothing of its own."""
        raw = request.kv_transfer_params
        if not (self.producer and self.backoff and raw and raw.get("do_remote_decode")):
            return
        if raw.get(TRUNCATED) or request.num_prompt_tokens <= self.backoff:
            return  # once per request (vLLM may reschedule it)
        if request.prompt_token_ids is None:
            return  # prompt embeddings: not carried (the decode computes the request)
        del request.prompt_token_ids[-self.backoff :]
        del request._all_token_ids[-self.backoff :]
        request.num_prompt_tokens -= self.backoff
        request.max_tokens = 1
        raw[TRUNCATED] = True

    def finished(self, request: Any, block_ids: tuple[list[int], ...]) -> tuple[bool, Any]:
        """Keep a prefilled request's blocks for its decode and answer its params."""
        raw = request.kv_transfer_params
        if not self.producer or not raw or not raw.get("do_remote_decode"):
            return False, None
        if request.status.name not in SENDABLE:
            return False, None  # aborted or failed: no decode will ask for it
        tokens = int(request.num_prompt_tokens)
        if self.backoff and not raw.get(TRUNCATED):
            return False, None  # a prompt too short to hand off: the decode computes it
        groups = self._transfer(block_ids)
        pages = [int(b) for b in groups[self.attention][: pages_for(tokens, self.block_size)]]
        if not pages:
            return False, None
        base = handoff_base(self.engine_id, request.request_id)
        slots = self._slots([[b for b in g if b] for g in groups])  # block 0 is vLLM's null
        self._sends.append(Send(request.request_id, base, pages, slots))
        self._held.add(request.request_id)
        params = HandoffParams(
            version=PARAMS_VERSION, id=base, services=self._services, tokens=tokens
        )
        answer = {"do_remote_prefill": True, "do_remote_decode": False}
        return True, {**answer, PARAMS_KEY: msgspec.to_builtins(params)}

    def sent(self, finished_sending: set[str] | None) -> None:
        """Every worker reported these requests' handoffs ended: vLLM frees their blocks."""
        self._held.difference_update(finished_sending or ())

    def holding(self) -> bool:
        """Blocks wait for a decode: vLLM keeps stepping, so the workers' reports come."""
        return bool(self._held)

    # ------------------------------------------------------------------ both

    def build_meta(self) -> StepMeta:
        meta = StepMeta(sends=self._sends, recvs=self._recvs)
        self._sends, self._recvs = [], []
        return meta
