"""vLLM's own NixlConnector PD pair on CPU equals the single engine: the baseline a kvhandoff
connector is compared with (same models, same proxy requests, same reference tokens)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.vllm.conftest import MAX_TOKENS, prompts, started
from tests.vllm.servers import Server, engine_env, free_port, generate_pd, start_server

pytestmark = pytest.mark.engine


def nixl_server(name: str, model: Path, logs: Path) -> Server:
    """A NixlConnector engine over host memory, its side channel on a free port of its own."""
    config = {"kv_connector": "NixlConnector", "kv_role": "kv_both", "kv_buffer_device": "cpu"}
    env = engine_env(
        VLLM_NIXL_SIDE_CHANNEL_HOST="127.0.0.1", VLLM_NIXL_SIDE_CHANNEL_PORT=str(free_port())
    )
    return start_server(
        name, model, logs, extra_args=["--kv-transfer-config", json.dumps(config)], env=env
    )


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
