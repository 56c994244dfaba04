"""vLLM's own NixlConnector PD pair on CPU equals the single engine: the baseline a kvhandoff
connector is compared with (same models, same proxy requests, same reference tokens)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.vllm.conftest import MAX_TOKENS, prompts, started
from tests.vllm.servers import Server, generate_pd, nixl_server

pytestmark = pytest.mark.engine


def test_nixl_pair_equals_single_engine(
    llama: Path,
    logs: Path,
    llama_reference: dict[tuple[int, ...], list[int]],
    servers: list[Server],
) -> None:
    servers.append(started(nixl_server("llama-nixl-prefill", llama, logs)))
    servers.append(started(nixl_server("llama-nixl-decode", llama, logs)))
    prefill, decode = servers
    for prompt in prompts():
        expected = llama_reference[tuple(prompt)]
        assert len(expected) == MAX_TOKENS
        got = generate_pd(prefill, decode, prompt, MAX_TOKENS)
        assert got == expected, f"prompt of {len(prompt)} tokens"
