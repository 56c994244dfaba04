"""`kvhandoff load`: many handoffs in flight through a multi-process `LocalDeployment` for a
while, and proof that nothing grows or goes missing (issue #20, item 3; `make soak` runs it for
ten minutes).

`--inflight` lanes (disjoint one-page destinations of a small dense model) each run handoffs
back to back over HTTP — create on the decode, ready on every stage, long-poll to the end — for
`--duration-s`; then the lanes finish what they started. Meanwhile every process's resident
memory (the decode, each prefill, this driver) is sampled each `--sample-s` from
/proc/<pid>/status (VmRSS, and RssAnon: the private heap, which history, queues and caches
would grow; VmRSS also counts shared pool pages as they are first touched).

Checks (exit status 1 if any fails, with the reasons):

- every handoff started reached `completed` (0 lost: failed, aborted, refused or unanswered);
- no peer was declared lost (`kvhandoff_peer_lost` on the decode and every prefill stays 0);
- memory is flat: for every process, the mean RSS of the last quarter of the run (after
  `--warmup-s`) is at most `--max-rss-growth` times that of the first quarter (`rss_check`).
  The decode holds its last `DecodeSettings.history` (10,000) finished handoffs in memory by
  design, so its memory grows until that many completed; without `--warmup-s`, the warm-up
  lasts until then when the run gets there (at 250/s, about 40 s), so that a bounded history
  filling is not read as growth (it was: 1.24x and 1.27x in two 60 s runs).

Reported: handoffs/s, p50/p99 latency (create → completed), and per process the RSS series,
first/last-quarter means and their ratio, and the peak.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import sys
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvhandoff.pipelines.settings import DecodeSettings

if TYPE_CHECKING:
    from kvhandoff.service.testing.deployment import LocalDeployment

MIB = 1 << 20
TERMINAL = frozenset({"completed", "failed", "aborted"})
#: What the decode's handoff limit leaves beyond `--inflight`: a lane's next create can reach
#: the decode before the previous handoff's release is counted.
LIVE_MARGIN = 64


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--inflight", type=int, default=1000, help="handoffs kept in flight")
    parser.add_argument(
        "--duration-s", type=float, default=60.0, help="how long lanes start new ones"
    )
    parser.add_argument("--pp", type=int, default=2, help="PP stages (one prefill process each)")
    parser.add_argument("--sample-s", type=float, default=1.0, help="RSS sampling interval")
    parser.add_argument(
        "--warmup-s",
        type=float,
        default=None,
        help="samples before this are not compared (default: 10%% of the run, at least 5 s)",
    )
    parser.add_argument(
        "--max-rss-growth",
        type=float,
        default=1.25,
        help="largest last-quarter / first-quarter mean RSS of any process",
    )
    parser.add_argument(
        "--peer-timeout-s",
        type=float,
        default=None,
        help="handoff.peer_timeout_s of every service (default: the service's default)",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--out", help="also write the JSON result here")
    parser.add_argument("--quiet", action="store_true", help="no progress line on stderr")


# -- memory ----------------------------------------------------------------------------------


def read_rss(pid: int) -> tuple[int, int] | None:
    """(VmRSS, RssAnon) of `pid` in bytes, from /proc; None once the process is gone."""
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    values: dict[str, int] = {}
    for line in text.splitlines():
        key, _, rest = line.partition(":")
        if key in ("VmRSS", "RssAnon"):
            values[key] = int(rest.split()[0]) * 1024  # kB
    if "VmRSS" not in values:
        return None
    return values["VmRSS"], values.get("RssAnon", values["VmRSS"])


@dataclass
class RssSeries:
    """One process's samples: seconds since the start, VmRSS and RssAnon in bytes."""

    t_s: list[float] = field(default_factory=list)
    rss: list[int] = field(default_factory=list)
    anon: list[int] = field(default_factory=list)


@dataclass(frozen=True)
class RssVerdict:
    process: str
    first_mib: float  # mean VmRSS of the first quarter after warm-up
    last_mib: float  # ... and of the last quarter
    ratio: float
    anon_ratio: float  # the same for RssAnon
    peak_mib: float
    ok: bool
    reason: str | None


def default_warmup(duration_s: float, done_at: Sequence[float], history: int) -> float:
    """10% of the run (at least 5 s), or longer: until the decode's bounded history of
    finished handoffs was full (`done_at`: completion times, in order), if it filled with at
    least a quarter of the run left to compare."""
    warmup = max(5.0, 0.1 * duration_s)
    if len(done_at) >= history:
        full_at = sorted(done_at)[history - 1]
        if full_at <= 0.75 * duration_s:
            warmup = max(warmup, full_at)
    return warmup


def rss_check(
    series: Mapping[str, RssSeries], *, warmup_s: float, max_growth: float
) -> list[RssVerdict]:
    """Per process: the mean of the last quarter of the samples after `warmup_s` against the
    mean of the first quarter, for VmRSS and for RssAnon; a process fails when either ratio
    exceeds `max_growth`, or when it has fewer than 4 samples to compare (a check that cannot
    see growth must not pass)."""
    verdicts = []
    for name, s in series.items():
        kept = [i for i, t in enumerate(s.t_s) if t >= warmup_s]
        peak = max(s.rss, default=0) / MIB
        if len(kept) < 4:
            verdicts.append(
                RssVerdict(name, 0.0, 0.0, 0.0, 0.0, peak, False, f"{len(kept)} samples after "
                           f"the {warmup_s:.0f} s warm-up: too few to compare")
            )  # fmt: skip
            continue
        q = len(kept) // 4
        first, last = kept[:q], kept[-q:]

        def mean(values: list[int], idx: list[int]) -> float:
            return sum(values[i] for i in idx) / len(idx)

        ratio = mean(s.rss, last) / mean(s.rss, first)
        anon_ratio = mean(s.anon, last) / max(1.0, mean(s.anon, first))
        worst = max(ratio, anon_ratio)
        reason = None
        if worst > max_growth:
            which = "VmRSS" if ratio >= anon_ratio else "RssAnon"
            reason = (
                f"{which} grew {worst:.2f}x from the first to the last quarter "
                f"(bound {max_growth:.2f}x)"
            )
        verdicts.append(
            RssVerdict(
                name,
                mean(s.rss, first) / MIB,
                mean(s.rss, last) / MIB,
                ratio,
                anon_ratio,
                peak,
                reason is None,
                reason,
            )
        )
    return verdicts


async def sample_rss(
    pids: Mapping[str, int], every_s: float, t0: float, out: dict[str, RssSeries]
) -> None:
    """Append a sample of every process to `out` each `every_s` until cancelled."""
    for name in pids:
        out.setdefault(name, RssSeries())
    while True:
        now = time.monotonic() - t0
        for name, pid in pids.items():
            got = read_rss(pid)
            if got is not None:
                s = out[name]
                s.t_s.append(now)
                s.rss.append(got[0])
                s.anon.append(got[1])
        await asyncio.sleep(every_s)


# -- the run ---------------------------------------------------------------------------------


def _percentile(values: Sequence[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    k = min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))
    return ordered[k]


async def _peer_lost(http: Any, url: str) -> int:
    """The sum of `kvhandoff_peer_lost` over its peers on the service at `url`."""
    from prometheus_client.parser import text_string_to_metric_families

    async with http.get(f"{url}/metrics") as resp:
        text = await resp.text()
    return int(
        sum(
            s.value
            for family in text_string_to_metric_families(text)
            for s in family.samples
            if s.name in ("kvhandoff_peer_lost_total", "kvhandoff_peer_lost")
        )
    )


async def _until_ended(client: Any, hid: str, bound_s: float = 120.0) -> None:
    """Poll handoff `hid` until it is terminal (or gone), at most `bound_s`."""
    import aiohttp

    give_up = time.monotonic() + bound_s
    while time.monotonic() < give_up:
        with contextlib.suppress(aiohttp.ClientError, TimeoutError):
            view = await client.until_terminal(hid)
            if view["state"] in TERMINAL or view["state"] == "unreachable":
                return
        await asyncio.sleep(0.5)


@dataclass
class _Tally:
    """What one load run saw, filled by its lanes and samplers (one event loop)."""

    t0: float
    outcomes: Counter[str] = field(default_factory=Counter)
    errors: Counter[str] = field(default_factory=Counter)
    latencies: list[float] = field(default_factory=list)
    done_at: list[float] = field(default_factory=list)  # completion times, since t0
    series: dict[str, RssSeries] = field(default_factory=dict)
    #: `kvhandoff_peer_lost` per process before the run, and what the run added to it.
    lost_before: dict[str, int] = field(default_factory=dict)
    lost_peers: dict[str, int] = field(default_factory=dict)
    wall_s: float = 0.0


async def load(args: argparse.Namespace, progress: Any = None) -> dict[str, Any]:
    from kvhandoff.service.config import HandoffConfig
    from kvhandoff.service.testing.deployment import LocalDeployment

    timeouts = {} if args.peer_timeout_s is None else {"peer_timeout_s": args.peer_timeout_s}
    with LocalDeployment(
        preset="dense-mha",
        model={"scale": 64, "num_layers": 4},
        pp_size=args.pp,
        num_pages=args.inflight,
        handoff=HandoffConfig(max_concurrent=args.inflight + LIVE_MARGIN, **timeouts),
        log_level="warning",
    ) as dep:
        tally = await _drive(dep, args, progress)
    return _result(args, tally)


async def _drive(dep: LocalDeployment, args: argparse.Namespace, progress: Any) -> _Tally:
    """Run `args.inflight` lanes for `args.duration_s` while sampling every process's memory."""
    import aiohttp

    from kvhandoff.service.tools.router_client import RouterClient

    pids = {p.name: p.popen.pid for p in dep.processes if p.popen is not None}
    pids["driver"] = os.getpid()
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as http:
        client = RouterClient(http, dep)
        # Declared before the run (a decode that starts before its prefills finds them
        # refusing connections) is not what the run is judged on: only what it adds.
        lost_before = {p.name: await _peer_lost(http, p.url) for p in dep.processes}
        tally = _Tally(t0=time.monotonic(), lost_before=lost_before)
        stop_at = tally.t0 + args.duration_s
        sampler = asyncio.create_task(sample_rss(pids, args.sample_s, tally.t0, tally.series))
        reporter = asyncio.create_task(_report(tally, args.duration_s, progress))
        try:
            async with asyncio.TaskGroup() as tg:
                for k in range(args.inflight):
                    tg.create_task(_lane(client, tally, k, stop_at))
        finally:
            tally.wall_s = time.monotonic() - tally.t0
            for task in (sampler, reporter):
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        for p in dep.processes:
            tally.lost_peers[p.name] = await _peer_lost(http, p.url) - lost_before[p.name]
    return tally


async def _lane(client: Any, tally: _Tally, k: int, stop_at: float) -> None:
    """Handoffs back to back on page `k` until `stop_at`."""
    n = 0
    while time.monotonic() < stop_at:
        hid = f"load-{k}-{n}"
        n += 1
        start = time.monotonic()
        out = await client.handoff(hid, [k], [k], None, None)
        end = time.monotonic()
        tally.outcomes[out.state] += 1
        if out.state == "completed":
            tally.latencies.append(end - start)
            tally.done_at.append(end - tally.t0)
        else:
            tally.errors[f"{out.state}: {(out.error or '')[:160]}"] += 1
        if out.state not in TERMINAL:
            # The client gave up, not the handoff: its page stays leased until it ends. The
            # lane waits for that (as a router must) before reusing it.
            await _until_ended(client, hid)


async def _report(tally: _Tally, duration_s: float, progress: Any) -> None:
    while True:
        await asyncio.sleep(1.0)
        if progress is not None:
            elapsed = time.monotonic() - tally.t0
            done = len(tally.done_at)
            progress.note(
                f"{elapsed:4.0f}/{duration_s:.0f} s, {done} completed "
                f"({done / max(elapsed, 1e-9):.0f}/s), {sum(tally.outcomes.values()) - done} not"
            )


def _result(args: argparse.Namespace, tally: _Tally) -> dict[str, Any]:
    """The run's report and verdicts (see the module's checks)."""
    from kvhandoff.service.config import HandoffConfig

    warmup = (
        args.warmup_s
        if args.warmup_s is not None
        else default_warmup(args.duration_s, tally.done_at, DecodeSettings().history)
    )
    verdicts = rss_check(tally.series, warmup_s=warmup, max_growth=args.max_rss_growth)
    started = sum(tally.outcomes.values())
    completed = tally.outcomes["completed"]
    # Throughput over the window where every lane was busy: completions before the stop.
    steady = [t for t in tally.done_at if t <= args.duration_s]
    failures = []
    if completed != started:
        failures.append(f"{started - completed} of {started} handoffs did not complete")
    if any(tally.lost_peers.values()):
        failures.append(f"peers declared lost: {dict(tally.lost_peers)}")
    failures += [f"{v.process}: {v.reason}" for v in verdicts if not v.ok]
    return {
        "case": "load",
        "model": f"dense-mha 4 layers, 1 page, PP={args.pp}, one process per stage",
        "peer_timeout_s": args.peer_timeout_s or HandoffConfig().peer_timeout_s,
        "inflight": args.inflight,
        "duration_s": args.duration_s,
        "wall_s": tally.wall_s,
        "started": started,
        "completed": completed,
        "lost": started - completed,
        "outcomes": dict(tally.outcomes),
        "errors": dict(tally.errors.most_common(10)),
        "handoffs_per_s": len(steady) / args.duration_s,
        "p50_ms": _percentile(tally.latencies, 50) * 1e3,
        "p99_ms": _percentile(tally.latencies, 99) * 1e3,
        "peer_lost": tally.lost_peers,
        "peer_lost_before_run": tally.lost_before,
        "warmup_s": warmup,
        "max_rss_growth": args.max_rss_growth,
        "rss": [v.__dict__ for v in verdicts],
        "rss_series": {name: _series_mib(s) for name, s in tally.series.items()},
        "ok": not failures,
        "failures": failures,
    }


def _series_mib(s: RssSeries) -> dict[str, list[float]]:
    return {
        "t_s": [round(t, 2) for t in s.t_s],
        "rss_mib": [round(r / MIB, 1) for r in s.rss],
        "anon_mib": [round(a / MIB, 1) for a in s.anon],
    }


def run(args: argparse.Namespace) -> int:
    import uvloop

    from kvhandoff.service.tools.bench.progress import Progress

    progress = None if args.quiet else Progress(1, "load")
    if progress is not None:
        progress.step(f"{args.inflight} in flight for {args.duration_s:.0f} s, PP={args.pp}")
    result = uvloop.run(load(args, progress))
    if progress is not None:
        progress.done()
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    if args.json:
        print(json.dumps(result))
    else:
        _print(result)
    return 0 if result["ok"] else 1


def _print(r: Mapping[str, Any]) -> None:
    print(f"load: {r['model']}, {r['inflight']} in flight for {r['duration_s']:.0f} s")
    print(
        f"  {r['completed']} of {r['started']} completed   {r['handoffs_per_s']:.0f} handoffs/s"
        f"   p50 {r['p50_ms']:.0f} ms   p99 {r['p99_ms']:.0f} ms"
    )
    print(
        f"  peers declared lost during the run: {r['peer_lost']} "
        f"(before it: {r['peer_lost_before_run']})"
    )
    for v in r["rss"]:
        print(
            f"  {v['process']:<10} RSS {v['first_mib']:7.1f} -> {v['last_mib']:7.1f} MiB "
            f"({v['ratio']:.3f}x, anon {v['anon_ratio']:.3f}x)  peak {v['peak_mib']:7.1f} MiB"
        )
    for error, count in r["errors"].items():
        print(f"  {count:6d} x {error}")
    for f in r["failures"]:
        print(f"  FAILED: {f}", file=sys.stderr)
