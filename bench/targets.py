"""Issue #35's targets judged against one `make bench` run and the engine runs beside it: one
verdict per target (per router shape where the control section measured several) and what limits
each. `report.render` writes them as BENCHMARKS.md's "Targets" section (`section`).

A verdict is computed from the results, never typed. What limits a target is prose the team
writes from its profiles (`LIMITS`, one entry per target key); it is printed under the table for
every target judged, so a missed target always stands beside its figure and its reason. Issue
#20's load checks (0 lost, no peer declared lost, RSS flat) keep rows of their own.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from bench.tables import num, ratio, table

TITLE = "Targets (issue #35)"

#: One-page handoffs/s ÷ `GET /healthz`/s at concurrency 64, by PP.
HEALTHZ_SHARE = {1: 0.15, 4: 0.08}
#: p50 create → completed at concurrency 1, PP=1.
P50_MS = 2.0
#: Landed GB/s ÷ raw Mooncake's (1 MiB blocks, same topology), worst e2e row.
LANDED_VS_RAW = 0.9
#: Decode CPU-seconds per landed GB ÷ direct mode's, worst e2e row.
DECODE_CPU_VS_DIRECT = 1.5
#: kvhandoff ÷ the engine's own backend: request latency p50 at concurrency 1 at most, and
#: requests/s at concurrency 16 at least.
ENGINE_LATENCY, ENGINE_RATE = 1.1, 0.9

#: The control section's router shapes, in the order they are judged. A row without the `router`
#: key (results from before the shapes were told apart) is the per-request router.
SHAPES = ("per-request", "coalesced")


@dataclass(frozen=True)
class Verdict:
    """One target against this run; `met` is None where the run did not measure it, and
    `limit` names its entry in LIMITS."""

    target: str
    figure: str
    met: bool | None
    limit: str

    @property
    def word(self) -> str:
        return "not measured" if self.met is None else "met" if self.met else "**missed**"


@dataclass(frozen=True)
class Limit:
    """What limits a target, as profiled: a short title for the table and the paragraph."""

    title: str
    text: str


#: What limits each target, keyed by `Verdict.limit`; written from the team's profiles (py-spy on
#: the decode and the prefills, /proc CPU accounting per process) and updated with them.
LIMITS: dict[str, Limit] = {
    "control": Limit(
        "per-handoff work on two shared cores",
        "Each one-page handoff is an HTTP create on the decode and an HTTP ready on each stage "
        "(the `coalesced` router sends those of one loop turn as one batch request: about 16 "
        "creates per batch at concurrency 64), a destination and a segment notice per stage on "
        "the persistent signed peer channel, and its outcome on the router's one event stream; "
        "the router itself runs on the same two cores. At one page the bytes cost nothing: a "
        "handoff is the Python each service runs for it, already cut to each check done once "
        "where it is cheapest (docs/performance: cached layout bounds, a layout decoded once "
        "per decode life, one-chunk gather and commit, young-generation garbage collection). "
        "Profiled with py-spy after those cuts (PP=1, concurrency 64, coalesced router): on the "
        "decode, the create (admission, validation, the lease, the records' look-up of an "
        "earlier handoff of that id) about 25% of its event loop, the segment's notice and "
        "commit about a third (the one-chunk commit 15%), publishing each handoff's events to "
        "the records, metrics and dashboard about 13%, the records' SQLite group commit about "
        "7%, and the WebSocket and HTTP writes of the answers, destinations and outcome stream "
        "the rest; on the prefill, the stage's run about a quarter (the gather and digest 7%, "
        "the write), the destination about 9%, the ready and its HTTP answer about 14%, and "
        "uvloop's own I/O. `GET /healthz` is one parse and one write on one loop, so 0.15x "
        "means the whole handoff (these steps on two processes, the router's share) in the CPU "
        "of about seven plain requests: each step is a handoff's own work that batching "
        "requests cannot share (coalescing removed most of the HTTP cost: its rows beside the "
        "per-request ones). With PP=4 every stage is its own prefill process: four readies, "
        "four destinations and four notices per handoff, which nothing batches across "
        "processes. The prefill's transport lane to the decode holds up to "
        "`max_inflight_batches_per_peer` (64) batches and `max_inflight_bytes_per_peer` (64 "
        "MiB) in flight, so the one-page writes queued at concurrency 64 share one or two "
        "engine calls; bounded at 8 batches, as before, about 56 of them waited for a slot and "
        "the write took 30-100 ms of a 60-130 ms handoff.",
    ),
    "latency": Limit(
        "hops between processes",
        "At concurrency 1 nothing is batched: the figure is one handoff's chain of hops. Timed "
        "on the decode's events (200 handoffs, p50 2.35 ms at load 9): the router's create to "
        "`handoff.created` 0.44 ms; created to the segment committed 1.59 ms (the destination to "
        "the prefill on the peer channel, the prefill's plan and Mooncake write of the page's "
        "blocks, the notice back, the commit); arrival, completion and release about 0.1 ms; "
        "the outcome to the router on its stream 0.25 ms. The create and the readies already "
        "leave at once. Created to committed, split with the prefill's events and the "
        "transport's write timed inside (1,000 handoffs at load 5): the destination reaches "
        "the prefill in 0.5-0.7 ms, its plan takes 0.15 ms, the Mooncake write of the page "
        "0.5 ms, of which the engine call is 0.2 ms and the rest two thread hops (the loop "
        "wakes a worker at niceness 10; the worker posts the outcome back to the loop), and "
        "the notice to the commit about 0.6 ms. Each hop is a loopback message or a thread "
        "that wakes another on two shared cores (a `GET /healthz` round trip alone is "
        "0.13-0.15 ms here), so the chain's five messages, its two thread hops and its "
        "Mooncake call are the floor the design sets at this size.",
    ),
    "bulk": Limit(
        "CPU per GB on two cores",
        "On two cores the bytes are CPU-bound (the cores-busy column), so landed ÷ raw is about "
        "raw Mooncake's CPU-seconds per GB over landed mode's (the CPU table). Raw Mooncake is "
        "measured two ways: the engine's synchronous call, which busy-waits a core until its "
        "batch ends, and its async calls checked between 200 µs sleeps, which moves the same "
        "blocks for about half the CPU and is the baseline the target is judged on. Landed "
        "mode then does what its promise rests on (S1-S4): each prefill stage gathers a "
        "segment's pages into its staging buffer and digests them (about 0.08 CPU s per GB "
        "alone: `kvhandoff bench handoff --cases gather`), the decode scatters each chunk of a "
        "landed window into the handoff's pages and digests the pages (about 0.09: `--cases "
        "commit`), and each segment costs bookkeeping on both event loops (`main` in the thread "
        "split). A landed stage's Mooncake calls wait by sleeping as the sleeping raw writer "
        "does (`mooncake-call` near zero in the thread split). What is left beyond raw is that "
        "work: the gather and its digest in the prefill's workers, the commit in the decode's, "
        "the segments' bookkeeping on both loops. Landed mode reads and writes every byte twice "
        "more than raw Mooncake, so on two cores it cannot reach "
        "0.9x of a baseline that spends under 0.6 CPU s per GB.",
    ),
    "decode_cpu": Limit(
        "the decode's commit pass",
        "Direct mode's decode only receives: Mooncake's TCP threads write into its KV pages. A "
        "landed decode receives the same bytes into its landing arena, then commits them: it "
        "scatters each 1 MiB chunk of the window into the handoff's pages and digests the pages "
        "just written (about 0.09 CPU s per GB alone: `kvhandoff bench handoff --cases commit`; "
        "no private copy, since no one else can write those pages), and each segment's notice, "
        "events and records cost its event loop (`decode, main` in the thread split). The pass "
        "is the price of S1: nothing but a matched digest changes decode KV. The loop's share "
        "falls as segments grow: with 64 MiB windows the ratio measured 1.36-1.61x against "
        "1.66-1.73x at the default 16 MiB (`--window-mb`), but one PP=4 handoff would then fill "
        "the default 256 MiB arena.",
    ),
    "sglang": Limit(
        "per-request control path (SGLang)",
        "SGLang's own PD path is a few ZMQ frames per request between the schedulers; "
        "kvhandoff's is its control plane (bootstrap, handoff creation, destination, notice, "
        "commit) run in each scheduler process. On the tiny model a request's KV is 64 KiB, so "
        "the figures compare those control paths, on two cores four servers share. The run is "
        "its own (`make bench-engines`), at the commit and date in its row.",
    ),
    "vllm": Limit(
        "per-request control path (vLLM)",
        "vLLM's `NixlConnector` hands the decode one `kv_transfer_params` dictionary and reads "
        "the prefill's blocks with NIXL; kvhandoff's connector runs its control plane (handoff "
        "creation, destination, notice, commit) in each worker. A request's KV is 64 KiB: the "
        "figures compare control paths, on two cores four servers share. The run is its own "
        "(`make bench-vllm`), at the commit and date in its row.",
    ),
    "load": Limit(
        "load checks (issue #20), not speed",
        "1,000 handoffs kept in flight through a PP=2 deployment of separate processes: a lost "
        "handoff or a peer declared lost would be a bug, and RSS that grows from the first "
        "quarter of the run to the last a leak.",
    ),
}


# -- the results' rows --------------------------------------------------------------------------


def _section(doc: Mapping[str, Any], name: str) -> Mapping[str, Any]:
    section: Mapping[str, Any] = doc.get("sections", {}).get(name, {})
    return section


def _rows(doc: Mapping[str, Any], name: str) -> list[Mapping[str, Any]]:
    rows: list[Mapping[str, Any]] = _section(doc, name).get("result", {}).get("rows", [])
    return rows


def _unmeasured(doc: Mapping[str, Any], name: str, otherwise: str) -> str:
    """Why a target of section `name` has no figure: the section did not run, failed, or
    (`otherwise`) ran without the rows the target needs."""
    section = _section(doc, name)
    if not section:
        return f"not measured: no `{name}` section in this run"
    if "error" in section:
        return f"not measured: the `{name}` section failed"
    return f"not measured: {otherwise}"


def _find(rows: Sequence[Mapping[str, Any]], **where: Any) -> Mapping[str, Any] | None:
    for row in rows:
        if all(row.get(k) == v for k, v in where.items()):
            return row
    return None


def shape_of(row: Mapping[str, Any]) -> str:
    """The router shape a control row measured."""
    return str(row.get("router", "per-request"))


def shapes_of(rows: Sequence[Mapping[str, Any]]) -> list[str]:
    """The router shapes the rows measured, known ones first; the per-request router where
    there are no rows (so the targets still show, as not measured)."""
    present = {shape_of(r) for r in rows}
    shapes = [s for s in SHAPES if s in present] + sorted(present - set(SHAPES))
    return shapes or [SHAPES[0]]


def _not_completed(row: Mapping[str, Any]) -> str:
    failed = row.get("failed", 0)
    return f"; {num(failed)} not completed" if failed else ""


# -- verdicts -----------------------------------------------------------------------------------


def _control(doc: Mapping[str, Any]) -> list[Verdict]:
    """Handoffs ÷ healthz at concurrency 64 per shape and PP, then p50 at concurrency 1."""
    rows = _rows(doc, "control")
    shares, latencies = [], []
    for shape in shapes_of(rows):
        mine = [r for r in rows if shape_of(r) == shape]
        for pp, share in HEALTHZ_SHARE.items():
            target = (
                f"one-page handoffs ≥ {share:g}x `GET /healthz`, PP={pp}, concurrency 64, "
                f"{shape} router"
            )
            row = _find(mine, pp=pp, concurrency=64)
            if row is None:
                why = _unmeasured(doc, "control", f"no PP={pp} concurrency-64 row")
                shares.append(Verdict(target, why, None, "control"))
                continue
            figure = (
                f"{ratio(row['ratio'])} ({num(row['handoffs_per_s'])} handoffs/s against "
                f"{num(row['healthz_per_s'])} healthz/s{_not_completed(row)})"
            )
            shares.append(Verdict(target, figure, row["ratio"] >= share, "control"))
        target = (
            f"p50 ≤ {P50_MS:g} ms create → completed, one page, PP=1, concurrency 1, {shape} router"
        )
        row = _find(mine, pp=1, concurrency=1)
        if row is None:
            why = _unmeasured(doc, "control", "no PP=1 concurrency-1 row")
            latencies.append(Verdict(target, why, None, "latency"))
        else:
            figure = f"{num(row['p50_ms'])} ms (p99 {num(row['p99_ms'])} ms{_not_completed(row)})"
            latencies.append(Verdict(target, figure, row["p50_ms"] <= P50_MS, "latency"))
    return shares + latencies


def _where(row: Mapping[str, Any]) -> str:
    return f"PP={row['pp']}, {row['pages']} pages"


def _over_rows(
    doc: Mapping[str, Any],
    key: str,
    bound: float,
    *,
    higher_is_better: bool,
    detail: Callable[[Mapping[str, Any]], str],
) -> tuple[str, bool | None]:
    """The e2e rows' `key` judged on the worst row against `bound`: (figure, met); the figure
    gives the worst row with `detail` and the best one."""
    rows = [r for r in _rows(doc, "e2e") if r.get(key) is not None]
    if not rows:
        return _unmeasured(doc, "e2e", f"the rows carry no `{key}`"), None
    order = sorted(rows, key=lambda r: float(r[key]), reverse=not higher_is_better)
    worst, best = order[0], order[-1]
    figure = f"{ratio(worst[key])} ({_where(worst)}: {detail(worst)})"
    if len(rows) > 1:
        figure = f"worst {figure}, best {ratio(best[key])} ({_where(best)})"
    value = float(worst[key])
    return figure, value >= bound if higher_is_better else value <= bound


def _bulk(doc: Mapping[str, Any]) -> list[Verdict]:
    # Against the faster raw baseline where both ran: the sync call's spin slows raw Mooncake
    # on two cores, and a landed stage's large blocks do not spin (`bench.e2e`).
    both = any(r.get("landed_vs_best_raw") is not None for r in _rows(doc, "e2e"))
    figure, met = _over_rows(
        doc, "landed_vs_best_raw" if both else "landed_vs_raw", LANDED_VS_RAW,
        higher_is_better=True, detail=_raw_detail,
    )  # fmt: skip
    target = (
        f"landed bulk ≥ {LANDED_VS_RAW:g}x raw Mooncake (1 MiB blocks"
        f"{', the faster of its sync and sleeping waits' if both else ''}), same topology, "
        "worst end-to-end row"
    )
    return [Verdict(target, figure, met, "bulk")]


def _raw_detail(r: Mapping[str, Any]) -> str:
    raw = f"{num(r['raw_large_gb_s'])}"
    if r.get("raw_sleeping_gb_s") is not None:
        raw += f" (sync) and {num(r['raw_sleeping_gb_s'])} (sleeping)"
    return f"{num(r['landed_gb_s'])} against {raw} GB/s"


def _decode_cpu(doc: Mapping[str, Any]) -> list[Verdict]:
    figure, met = _over_rows(
        doc, "decode_cpu_landed_vs_direct", DECODE_CPU_VS_DIRECT, higher_is_better=False,
        detail=lambda r: (
            f"{num(r.get('landed_decode_cpu_s_per_gb'))} against "
            f"{num(r.get('direct_decode_cpu_s_per_gb'))} CPU s per GB"
        ),
    )  # fmt: skip
    target = (
        f"decode CPU per landed GB ≤ {DECODE_CPU_VS_DIRECT:g}x direct mode's, worst end-to-end row"
    )
    return [Verdict(target, figure, met, "decode_cpu")]


@dataclass(frozen=True)
class EngineRun:
    """A real-server comparison the targets read: its results file, its own backend's name in
    the rows and in words, and the make target that writes it."""

    name: str
    limit: str
    native: str
    native_label: str
    make: str
    results: str


ENGINE_RUNS = (
    EngineRun("SGLang", "sglang", "mooncake", "SGLang's `mooncake` backend",
              "make bench-engines", "bench/engines.json"),
    EngineRun("vLLM", "vllm", "nixl", "vLLM's `NixlConnector`", "make bench-vllm",
              "bench/vllm.json"),
)  # fmt: skip


def _when(run: Mapping[str, Any]) -> str:
    """The commit and date a real-server run was measured at."""
    m = run.get("machine", {})
    at = str(m.get("at", "an unknown date"))
    if len(at) >= 16 and at[10] == "T":
        at = f"{at[:10]} {at[11:16]} UTC"
    return f"`{str(m.get('commit', 'unknown'))[:7]}`, {at}"


def _engine(which: EngineRun, run: Mapping[str, Any] | None) -> list[Verdict]:
    """Latency p50 at concurrency 1 and requests/s at 16 against the engine's own backend."""
    out = []
    for conc, key, unit, bound, what in (
        (1, "p50_ms", " ms", ENGINE_LATENCY, "request latency p50 ≤"),
        (16, "req_per_s", "/s", ENGINE_RATE, "requests/s ≥"),
    ):
        target = f"{which.name}: {what} {bound:g}x {which.native_label}'s, concurrency {conc}"
        figure, met = _versus(which, run, conc, key, unit, bound)
        out.append(Verdict(target, figure, met, which.limit))
    return out


def _versus(
    which: EngineRun, run: Mapping[str, Any] | None, conc: int, key: str, unit: str, bound: float
) -> tuple[str, bool | None]:
    """(figure, met) of kvhandoff ÷ the native backend's `key` at `conc`: at most `bound` for a
    latency, at least for a rate; kvhandoff with no completed request misses it."""
    if run is None:
        return f"not measured: no {which.results} (`{which.make}`)", None
    rows = {(r["backend"], r["concurrency"]): r for r in run.get("rows", [])}
    mine, native = rows.get(("kvhandoff", conc)), rows.get((which.native, conc))
    if mine is None or native is None:
        return f"not measured: no concurrency-{conc} rows of both backends ({_when(run)})", None
    failed = f"; {num(mine['failed'])} kvhandoff requests failed" if mine.get("failed") else ""
    if mine.get(key) is None:
        return f"kvhandoff completed no request ({_when(run)})", False
    if not native.get(key):
        return f"not measured: {which.native_label} completed no request ({_when(run)})", None
    value = float(mine[key]) / float(native[key])
    figure = (
        f"{ratio(value)} ({num(float(mine[key]))}{unit} against {num(float(native[key]))}{unit}"
        f"{failed}; {_when(run)})"
    )
    return figure, value <= bound if key == "p50_ms" else value >= bound


def _load(doc: Mapping[str, Any]) -> list[Verdict]:
    """Issue #20's checks of the load run."""
    load = _section(doc, "load").get("result")
    if not load:
        return []
    lost = sum(load["peer_lost"].values())
    worst = max((max(v["ratio"], v["anon_ratio"]) for v in load["rss"]), default=0.0)
    return [
        Verdict("load: 0 handoffs lost", f"{num(load['lost'])} lost of {num(load['started'])}",
                load["lost"] == 0, "load"),
        Verdict("load: no peer declared lost", f"{num(lost)} declared", lost == 0, "load"),
        Verdict(f"load: RSS flat (last ÷ first quarter ≤ {num(load['max_rss_growth'])})",
                f"worst {ratio(worst)}", all(v["ok"] for v in load["rss"]), "load"),
    ]  # fmt: skip


def verdicts(
    doc: Mapping[str, Any],
    engines: Mapping[str, Any] | None = None,
    vllm: Mapping[str, Any] | None = None,
) -> list[Verdict]:
    """Every target against `doc` (a `make bench` results document) and the real-server runs
    beside it (`engines`: SGLang's, `vllm`: vLLM's; None where they did not run)."""
    runs = dict(zip(ENGINE_RUNS, (engines, vllm), strict=True))
    return [
        *_control(doc),
        *_bulk(doc),
        *_decode_cpu(doc),
        *(v for which, run in runs.items() for v in _engine(which, run)),
        *_load(doc),
    ]


# -- the section --------------------------------------------------------------------------------


def _tally(judged: Sequence[Verdict]) -> str:
    words = [v.word.strip("*") for v in judged]
    return ", ".join(f"{words.count(w)} {w}" for w in dict.fromkeys(words))


def section(judged: Sequence[Verdict], measured: Mapping[str, str] | None = None) -> str:
    """The Targets section's body: the verdicts' table, then what limits each target, each
    followed by what this run measured of it (`measured`, by limit key: `cpu_budget.limits`)."""
    body = table(
        ["target", "this run", "verdict", "what limits it"],
        ([v.target, v.figure, v.word, LIMITS[v.limit].title] for v in judged),
    )
    limits = []
    for key in dict.fromkeys(v.limit for v in judged):
        mine = [v for v in judged if v.limit == key]
        seen = (measured or {}).get(key)
        limits.append(
            f"- **{LIMITS[key].title}** ({_tally(mine)}): {LIMITS[key].text}"
            + (f"\n\n  {seen}" if seen else "")
        )
    return (
        "Issue #35's targets, judged from this run's rows (the engines' from their own runs, at "
        "the commit and date each row gives): a ratio is met or missed by this run alone, and "
        "one run does not rank a ratio near its bound. A target the run did not measure says "
        f"so.\n\n{body}\n\nWhat limits each:\n\n" + "\n".join(limits)
    )
