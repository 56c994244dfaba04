"""What the kvhandoff connector refuses at start-up, by name, before any memory is registered.

Called by the connector's constructor (`connector.py`) in both halves, with vLLM's config and
KV cache config; nothing here imports vLLM (its config objects are read by attribute)."""

from __future__ import annotations

from typing import Any

from service.integrations.vllm.layouts import (
    STATE_SPECS,
    Unsupported,
    check_groups,
    transfer_groups,
)

#: vLLM kv_role -> the role of the worker's kvhandoff service.
ROLES = {"kv_producer": "prefill", "kv_consumer": "decode"}


def service_role(kv_role: str | None) -> str:
    """The kvhandoff role of an engine of `kv_role`; a role this connector cannot serve is
    refused by name."""
    role = ROLES.get(str(kv_role))
    if role is None:
        raise Unsupported(
            f"kv_role {kv_role!r} is not supported by the kvhandoff connector: a kvhandoff "
            "service serves one role; start the prefill with kv_producer and the decode with "
            "kv_consumer"
        )
    return role


def refuse_unsupported(vllm_config: Any, kv_cache_config: Any, *, role: str) -> int:
    """Raise Unsupported naming the first feature of this engine the connector cannot move;
    return the page size (tokens per block)."""
    parallel = vllm_config.parallel_config
    if role == "decode" and int(parallel.pipeline_parallel_size) > 1:
        raise Unsupported(
            "pipeline parallelism on the decode is not supported by the kvhandoff connector "
            "(a decode's layout holds every layer; the prefill may run PP)"
        )
    for name in ("prefill_context_parallel_size", "decode_context_parallel_size"):
        if int(getattr(parallel, name, 1) or 1) > 1:
            raise Unsupported(f"{name} > 1 is not supported by the kvhandoff connector")
    if getattr(vllm_config, "speculative_config", None) is not None:
        raise Unsupported(
            "speculative decoding is not supported by the kvhandoff connector yet (its draft "
            "layers and lookahead tokens are not carried)"
        )
    page_size = check_groups(kv_cache_config)
    state = [
        type(g.kv_cache_spec).__name__
        for g in transfer_groups(kv_cache_config)
        if type(g.kv_cache_spec).__name__ in STATE_SPECS
    ]
    if state:
        raise Unsupported(
            f"KV cache groups of {sorted(set(state))} (a hybrid model) are not supported by "
            "the kvhandoff vLLM connector yet: their state moves at the prompt's next-to-last "
            "token, which it does not arrange"
        )
    return page_size
