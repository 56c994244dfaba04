"""What the kvhandoff connector refuses at start-up, by name, before any memory is registered.

Called by the connector's constructor (`connector.py`) in both halves, with vLLM's config and
KV cache config; nothing here imports vLLM (its config objects are read by attribute)."""

from __future__ import annotations

from typing import Any

from kvhandoff.service.integrations.vllm.layouts import (
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
    for group in transfer_groups(kv_cache_config):
        spec = group.kv_cache_spec
        if type(spec).__name__ in STATE_SPECS and int(getattr(spec, "num_speculative_blocks", 0)):
            raise Unsupported(
                f"Mamba group of layers {list(group.layer_names)[:3]}... keeps "
                f"{spec.num_speculative_blocks} speculative state blocks per request, which "
                "the kvhandoff connector does not carry"
            )
    return page_size
