"""Real SGLang servers: kvhandoff against SGLang's own `mooncake` transfer backend.

`make bench-engines` (in the SGLang environment; not part of `make test` or `make bench`): the
engine tests' harness (`tests/engines`: the tiny seeded Llama, SGLang 0.5.23 on CPU, a PD pair
driven as SGLang's router drives it) with two PD pairs up at once on one machine — prefill and
decode over kvhandoff, and prefill and decode over SGLang's `mooncake` backend (Mooncake TCP on
loopback, `MC_FORCE_TCP=1`; `bench/native_hook` turns off the pinned-memory page indices a CPU
torch refuses). Both pairs first answer the same prompts with the same tokens. Then, in rounds
that alternate which backend goes first, each pair serves `REQUESTS` at concurrency
1 and 16 (a closed loop: each worker sends its next request when the last one ends), streamed
from the decode: a request's latency is send -> last token, its TTFT send -> first token out of
the decode. Writes bench/engines.json and regenerates BENCHMARKS.md, whose section it feeds.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp

from bench.report import regenerate
from bench.suite import machine
from tests.engines.client import NEW_TOKENS, Pair, body, bootstrap, connector, pd, prompts
from tests.engines.model import write_model
from tests.engines.servers import DECODE, EARLY_SEND_OFF, PEER_SECRET, Server, kvhandoff_env

ROOT = Path(__file__).resolve().parents[1]
HOOK = Path(__file__).resolve().parent / "native_hook"
BACKENDS = ("kvhandoff", "mooncake")
#: Requests per backend and round at each concurrency: two full waves at 16.
REQUESTS = {1: 16, 16: 32}
CONCURRENCY = tuple(REQUESTS)
PROMPT_TOKENS = 64
POOL = ["--max-total-tokens", "4096"]


def pd_args(backend: str, mode: str) -> list[str]:
    role = ["--disaggregation-mode", "prefill"] if mode == "prefill" else DECODE
    return ["--disaggregation-transfer-backend", backend, *role, *POOL]


def write_config(work: Path) -> Path:
    """kvhandoff's settings for the bench: its defaults (landed mode, 30 s deadline, 128 MiB
    landing arena, 16 MiB windows) but for the state directory, the peer secret and 15 s
    of peer silence, in heartbeats and in each peer call alike (a scheduler starved on a shared
    2-core machine can go silent for seconds; see docs/guides/vllm.md, "When a worker is not
    run")."""
    path = work / "kvhandoff.toml"
    path.write_text(
        f'[server]\nstate_dir = "{work / "state"}"\n[auth]\npeer = "{PEER_SECRET}"\n'
        "[handoff]\npeer_timeout_s = 15.0\n[peers]\nrequest_timeout_s = 15.0\n"
    )
    return path


def env_of(backend: str, mode: str, config: Path) -> dict[str, str]:
    # Else SGLang's early send of a prefix its radix cache holds ends the prefill's scheduler at
    # the first prompt sharing a prefix with an earlier one (a CUDA event on CPU).
    env = dict(EARLY_SEND_OFF) if mode == "prefill" else {}
    if backend == "kvhandoff":
        return {**env, **kvhandoff_env(config)}
    return {**env, "MOONCAKE_PROTOCOL": "tcp", "MC_FORCE_TCP": "1"}


class RequestFailed(RuntimeError):
    """A request its pair answered without its tokens: counted by `closed_loop`, not fatal.
    `cause` is a short label to count by (a kvhandoff handoff's error code where the decode's
    record gives one), the message the detail."""

    def __init__(self, detail: str, *, cause: str) -> None:
        super().__init__(detail)
        self.cause = cause


async def streamed(r: aiohttp.ClientResponse) -> AsyncIterator[dict[str, Any]]:
    """A streamed answer's JSON chunks (its server-sent `data:` lines but `[DONE]`);
    RequestFailed on an error status."""
    if r.status != 200:
        text = (await r.text())[:500]
        raise RequestFailed(f"{r.url} answered {r.status}: {text}", cause=f"http_{r.status}")
    async for line in r.content:
        if line.startswith(b"data:") and line.strip() != b"data: [DONE]":
            yield json.loads(line[5:])


async def timed(
    session: aiohttp.ClientSession, pair: Pair, input_ids: list[int]
) -> tuple[float, float]:
    """One PD request streamed from the decode: (TTFT, latency) in seconds from the send."""
    payload = body(input_ids, stream=True, **bootstrap(pair))
    timeout = aiohttp.ClientTimeout(total=300)

    async def to_prefill() -> None:
        async with session.post(f"{pair.prefill}/generate", json=payload, timeout=timeout) as r:
            await r.read()

    t0 = time.perf_counter()
    first = None
    prefill = asyncio.create_task(to_prefill())
    try:
        async with session.post(f"{pair.decode}/generate", json=payload, timeout=timeout) as r:
            async for chunk in streamed(r):
                finish = chunk.get("meta_info", {}).get("finish_reason") or {}
                if finish.get("type") == "abort":
                    raise RequestFailed(f"aborted: {finish}", cause="aborted")
                if first is None and chunk.get("output_ids"):
                    first = time.perf_counter()
        end = time.perf_counter()
    finally:
        await prefill
    if first is None:
        raise RequestFailed("the decode streamed no token", cause="no_tokens")
    return first - t0, end - t0


#: One timed PD request: (TTFT, latency) in seconds, given a session, a pair and a prompt.
Send = Callable[[aiohttp.ClientSession, Any, list[int]], Awaitable[tuple[float, float]]]


async def closed_loop(
    pair: Any, batch: list[list[int]], concurrency: int, send: Send = timed
) -> dict[str, Any]:
    """`batch` through the pair by `send`, `concurrency` requests in flight at a time. A
    request that fails (RequestFailed, a broken connection, a timeout) is recorded in
    `failures` ({"cause", "detail"}) and its worker goes on with the next."""
    queue = list(reversed(batch))
    ttft: list[float] = []
    latency: list[float] = []
    failures: list[dict[str, str]] = []
    async with aiohttp.ClientSession(connector=connector()) as session:

        async def worker() -> None:
            while queue:
                try:
                    t, lat = await send(session, pair, queue.pop())
                except RequestFailed as exc:
                    failures.append({"cause": exc.cause, "detail": str(exc)})
                    continue
                except (aiohttp.ClientError, TimeoutError) as exc:
                    detail = f"{type(exc).__name__}: {exc}"
                    failures.append({"cause": "connection", "detail": detail})
                    continue
                ttft.append(t)
                latency.append(lat)

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        wall = time.perf_counter() - t0
    return {"ttft_s": ttft, "latency_s": latency, "failures": failures, "wall_s": wall}


def quantile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, round(q * (len(xs) - 1))))]


def summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Closed loops' figures: percentiles over the completed requests (None without any),
    requests/s of completed requests, and the failed ones counted by cause beside them."""
    ttft = [x for r in runs for x in r["ttft_s"]]
    lat = [x for r in runs for x in r["latency_s"]]
    causes = Counter(f["cause"] for r in runs for f in r.get("failures", ()))
    return {
        "requests": len(lat),
        "failed": sum(causes.values()),
        "failed_by_cause": dict(sorted(causes.items())),
        "p50_ms": 1e3 * statistics.median(lat) if lat else None,
        "p99_ms": 1e3 * quantile(lat, 0.99) if lat else None,
        "ttft_p50_ms": 1e3 * statistics.median(ttft) if ttft else None,
        "ttft_p99_ms": 1e3 * quantile(ttft, 0.99) if ttft else None,
        "req_per_s": len(lat) / sum(r["wall_s"] for r in runs),
    }


async def same_tokens(pairs: dict[str, Pair], batch: list[list[int]]) -> bool:
    async with aiohttp.ClientSession(connector=connector()) as session:
        outs = [await asyncio.gather(*(pd(session, pairs[b], p) for p in batch)) for b in BACKENDS]
    return all(o == outs[0] for o in outs)


def start_pairs(work: Path, servers: list[Server]) -> dict[str, Pair]:
    """Both backends' decode and prefill, one server at a time (appended to `servers`)."""
    model = write_model(work / "model")
    config = write_config(work)
    pairs = {}
    for backend in BACKENDS:
        ends = {}
        for mode in ("decode", "prefill"):
            s = Server(
                f"{backend}-{mode}",
                model,
                work,
                pd_args(backend, mode),
                env=env_of(backend, mode, config),
                extra_path=[HOOK] if backend == "mooncake" else [],
            )
            servers.append(s)
            s.start()
            s.wait_healthy()
            print(f"{s.name} healthy after {s.start_s[-1]:.0f} s", flush=True)
            ends[mode] = s
        prefill = ends["prefill"]
        pairs[backend] = Pair(prefill.url, prefill.bootstrap_port, ends["decode"].url)
    return pairs


def prompts_of(n: int, seed: int) -> list[list[int]]:
    """`n` prompts of `PROMPT_TOKENS` tokens for the SGLang pairs."""
    return prompts(n, seed=seed, min_len=PROMPT_TOKENS, max_len=PROMPT_TOKENS)


def measure(
    pairs: dict[str, Any],
    rounds: int,
    *,
    send: Send = timed,
    batch_of: Callable[[int, int], list[list[int]]] = prompts_of,
    after_each: Callable[[], None] = lambda: None,
) -> list[dict[str, Any]]:
    """Every backend of `pairs` (in its order) at every concurrency, `rounds` times,
    alternating which goes first; the same prompts (`batch_of(n, seed)`) for every backend in
    a round, fresh ones each round; `after_each` runs after each closed loop. A row per
    backend and concurrency: `summary` over its rounds, `by_round` (completed and failed per
    round) and `failures` (each failed request's round, cause and detail)."""
    backends = tuple(pairs)
    runs: dict[tuple[str, int], list[dict[str, Any]]] = {}
    seed = 1000
    for rnd in range(rounds):
        order = backends if rnd % 2 == 0 else tuple(reversed(backends))
        for c in CONCURRENCY:
            seed += 1
            batch = batch_of(REQUESTS[c], seed)
            for backend in order:
                r = asyncio.run(closed_loop(pairs[backend], batch, c, send))
                runs.setdefault((backend, c), []).append(r)
                after_each()
                print(f"round {rnd} {backend} c={c}: {summary([r])}", flush=True)
                for f in r["failures"]:
                    print(f"  failed ({f['cause']}): {f['detail']}", flush=True)
    return [
        {
            "backend": b,
            "concurrency": c,
            **summary(runs[(b, c)]),
            "by_round": [
                {"round": i, "requests": len(r["latency_s"]), "failed": len(r["failures"])}
                for i, r in enumerate(runs[(b, c)])
            ],
            "failures": [
                {"round": i, **f} for i, r in enumerate(runs[(b, c)]) for f in r["failures"]
            ],
        }
        for c in CONCURRENCY
        for b in backends
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", default=str(ROOT / "bench" / "engines.json"))
    parser.add_argument("--markdown", default=str(ROOT / "BENCHMARKS.md"))
    args = parser.parse_args(argv)
    os.environ["HF_HUB_OFFLINE"] = "1"
    t_start = time.perf_counter()
    info = machine()
    work = Path(tempfile.mkdtemp(prefix="bench-engines-"))
    print(f"the servers' logs: {work} (removed after a run that completes)", flush=True)
    servers: list[Server] = []
    try:
        pairs = start_pairs(work, servers)
        check = prompts(8, seed=40, min_len=8, max_len=PROMPT_TOKENS)
        equal = asyncio.run(same_tokens(pairs, check))
        print(f"same tokens from both backends: {equal}", flush=True)
        rows = measure(pairs, args.rounds)
    finally:
        for s in reversed(servers):
            s.stop()
    doc = {
        "machine": info,
        "model": "the engine tests' seeded tiny Llama (tests/engines/model.py), float32",
        **run_fields(args.rounds, NEW_TOKENS, equal),
        "start_s": {s.name: s.start_s[-1] for s in servers},
        "rows": rows,
        "wall_s": time.perf_counter() - t_start,
    }
    shutil.rmtree(work)
    write_run(doc, Path(args.out), Path(args.markdown))
    return 0 if equal else 1


def run_fields(rounds: int, new_tokens: int, same_tokens: bool) -> dict[str, Any]:
    """What a real-server comparison's results say of its requests (the report reads them)."""
    return {
        "prompt_tokens": PROMPT_TOKENS,
        "new_tokens": new_tokens,
        "requests": {str(c): n for c, n in REQUESTS.items()},
        "rounds": rounds,
        "same_tokens": same_tokens,
    }


def write_run(doc: dict[str, Any], out: Path, markdown: Path) -> None:
    """A comparison's results to `out`, beside the suite's results.json, and the report
    (`markdown`) regenerated from all of them."""
    out.write_text(json.dumps(doc, indent=2) + "\n")
    markdown.write_text(regenerate(out.parent / "results.json", markdown.parent))
    print(f"wrote {out} and {markdown}")


if __name__ == "__main__":
    sys.exit(main())
