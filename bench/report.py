"""BENCHMARKS.md and results.csv from the results of `make bench` (`suite.py`): nothing in the
report is typed by hand, so it says what the last run measured and nothing else.

`python -m bench.report bench/results.json` regenerates BENCHMARKS.md from a
results file (with the plots already beside it) without running anything.
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from bench import cpu_budget, targets
from bench.tables import div, kib, num, ratio, table

#: The plot of each section (`plots.render_all` writes them under these names).
PLOTS = {
    "planning": "planning.png",
    "transport": "transport.png",
    "e2e": "e2e.png",
    "segments": "segments.png",
    "control": "control.png",
    "load": "load_rss.png",
}


# -- sections -----------------------------------------------------------------------------------


def _planning(r: Mapping[str, Any]) -> str:
    rows = r["rows"]
    sglang = r.get("sglang", "")
    measured = bool(rows) and "sglang_ms" in rows[0]
    body = table(
        ["layers", "pages", "landed ms", "landed to 1st call ms", "direct ms", "reference ms",
         "SGLang ms", "SGLang ÷ landed", "SGLang ÷ landed 1st call", "SGLang ÷ direct",
         "reference ÷ direct"],
        (
            [num(x["layers"]), num(x["pages"]), num(x["landed_ms"], 3),
             num(x["landed_first_segment_ms"], 3), num(x["direct_ms"], 3),
             num(x["reference_ms"], 3), num(x.get("sglang_ms"), 3),
             ratio(x.get("sglang_over_landed")), ratio(x.get("sglang_over_landed_first_call")),
             ratio(x.get("sglang_over_direct")), ratio(x["reference_over_direct"])]
            for x in rows
        ),
    )  # fmt: skip
    source = (
        f"SGLang's column runs SGLang {sglang}'s own functions from its installed sources "
        "(`group_concurrent_contiguous`, `build_transfer_entry_pairs` and its block loop, in "
        "`.venv-sglang`)"
        if measured
        else f"SGLang's path: {sglang or 'not measured'}"
    )
    return (
        "Per-request work on a prefill stage before its engine call, over the same fragmented "
        "request (runs of 1 to 32 pages): a landed stage's whole plan and its plan up to the first "
        "engine call (one window-sized segment; the rest is planned while earlier segments "
        "move), a direct stage's plan, the per-entry Python reference planner "
        f"(`kvhandoff.pipelines.planning_reference`). {source}. Medians; gc on.\n\n{body}"
    )


def _transport(r: Mapping[str, Any]) -> str:
    by_block: dict[int, dict[str, float]] = {}
    for row in r["rows"]:
        by_block.setdefault(row["block_bytes"], {})[row["method"]] = row["best_gbps"]
    rows = []
    for block, m in sorted(by_block.items()):
        rows.append(
            [kib(block), num(m.get("memcpy")), num(m.get("local")), num(m.get("mooncake-raw")),
             num(m.get("mooncake")), ratio(div(m.get("local"), m.get("memcpy"))),
             ratio(div(m.get("mooncake"), m.get("mooncake-raw")))]
        )  # fmt: skip
    body = table(
        ["block", "memcpy GB/s", "local GB/s", "raw Mooncake GB/s", "kvhandoff Mooncake GB/s",
         "local ÷ memcpy", "kvhandoff ÷ raw"],
        rows,
    )  # fmt: skip
    return (
        f"{r['total_mib']} MiB moved as blocks of each size into a receiver process's shm pool "
        "(loopback TCP for Mooncake), best of the runs: memcpy of the block list in this process, "
        "the local transport, the engine's `batch_transfer_sync_write` called in a loop, and "
        f"kvhandoff's `MooncakeTransport.write`.\n\n{body}"
    )


def _e2e(r: Mapping[str, Any]) -> str:
    rows = r["rows"]
    conc = rows[0]["concurrency"] if rows else "-"
    return (
        "Whole handoffs of a hybrid NPU-MLA model at full size (128-token pages, fragmented "
        f"pages), {conc} at a time, router → decode → every stage → Mooncake over loopback TCP "
        "(→ digest-checked commit when landed), one prefill process per stage and a PP=1 decode; "
        "a landed and a direct deployment of the same shape up at once. Raw Mooncake runs in the "
        "same topology: one engine per stage, each in a process of its own with only its stage's "
        "pool registered, all writing at once into the direct decode's KV memory, the same "
        "bytes — as 1 MiB blocks (how a landed stage packs them) and as the per-page blocks "
        "direct mode plans. Runs interleaved, best of the rounds; p50 is create → completed "
        "as the router sees it.\n\n"
        f"{_e2e_rates(rows)}{_e2e_sleeping(rows)}{_e2e_cpu(rows)}"
    )


def _e2e_sleeping(rows: Sequence[Mapping[str, Any]]) -> str:
    """The raw baseline that waits by sleeping (`bench.e2e`'s `raw_sleeping`), where measured:
    "" for results without it."""
    if not rows or any(x.get("raw_sleeping_gb_s") is None for x in rows):
        return ""
    body = table(
        ["PP", "pages", "raw 1 MiB GB/s (sync call)", "raw 1 MiB GB/s (async, sleeping)",
         "landed GB/s", "landed ÷ raw (sync)", "landed ÷ raw (sleeping)", "landed ÷ faster raw"],
        (
            [num(x["pp"]), num(x["pages"]), num(x["raw_large_gb_s"]),
             num(x["raw_sleeping_gb_s"]), num(x["landed_gb_s"]), ratio(x["landed_vs_raw"]),
             ratio(x["landed_vs_raw_sleeping"]), ratio(x["landed_vs_best_raw"])]
            for x in rows
        ),
    )  # fmt: skip
    return (
        "\n\nThe engine's synchronous call busy-waits a core until its batch ends; a landed "
        "stage's calls of a few large blocks instead submit each block as an async batch and "
        "check them between 200 µs sleeps. So raw Mooncake also runs that way, the same 1 MiB "
        "blocks from the same processes: the target is judged against the faster of the two.\n\n"
        f"{body}"
    )


def _e2e_rates(rows: Sequence[Mapping[str, Any]]) -> str:
    return table(
        ["PP", "pages", "MB / request", "landed GB/s", "direct GB/s", "raw 1 MiB GB/s",
         "raw per-page GB/s", "landed ÷ direct", "landed ÷ raw", "direct ÷ raw",
         "direct ÷ raw per-page", "landed p50 ms", "direct p50 ms"],
        (
            [num(x["pp"]), num(x["pages"]), num(x["bytes_per_request"] / 1e6),
             num(x["landed_gb_s"]), num(x["direct_gb_s"]), num(x["raw_large_gb_s"]),
             num(x["raw_pages_gb_s"]), ratio(x["landed_vs_direct"]), ratio(x["landed_vs_raw"]),
             ratio(x["direct_vs_raw"]), ratio(x["direct_vs_raw_pages"]),
             num(x["landed_p50_ms"]), num(x["direct_p50_ms"])]
            for x in rows
        ),
    )  # fmt: skip


#: The e2e rows' CPU accounting (`bench.e2e`, since issue #35), by run: its key prefix, its
#: senders' key (the prefill stages; raw Mooncake's writer processes) and its label.
CPU_RUNS = (
    ("raw", "writer", "raw Mooncake (1 MiB blocks)"),
    ("raw_sleeping", "writer", "raw Mooncake (1 MiB blocks, sleeping wait)"),
    ("landed", "prefill", "landed"),
    ("direct", "prefill", "direct"),
)


def _e2e_cpu(rows: Sequence[Mapping[str, Any]]) -> str:
    """The e2e rows' CPU-seconds per GB by run and process, and where the worst row's went by
    thread; "" for results without them."""
    runs = [
        run for run in CPU_RUNS
        if rows and all(x.get(f"{run[0]}_decode_cpu_s_per_gb") is not None for x in rows)
    ]  # fmt: skip
    if not runs:
        return ""
    body = table(
        ["PP", "pages", "run", "all CPU s/GB", "decode CPU s/GB", "senders CPU s/GB",
         "cores busy"],
        (
            [num(x["pp"]), num(x["pages"]), label, num(x.get(f"{k}_cpu_s_per_gb")),
             num(x[f"{k}_decode_cpu_s_per_gb"]), num(x.get(f"{k}_{side}_cpu_s_per_gb")),
             num(x.get(f"{k}_cpu_cores"))]
            for x in rows
            for k, side, label in runs
        ),
    )  # fmt: skip
    return (
        "\n\nCPU-seconds per GB moved, as `bench.e2e` accounts them over the same runs (user "
        "and system time of each process, from /proc): of all the run's processes, of the "
        "decode, and of the senders (the prefill stages; raw Mooncake's writer processes); "
        "cores busy is CPU-seconds per wall second: near the host's cores, the run was CPU "
        f"bound and its GB/s about cores ÷ CPU-seconds per GB.\n\n{body}{_cpu_threads(rows)}"
    )


def _cpu_threads(rows: Sequence[Mapping[str, Any]]) -> str:
    """Where the CPU of the row furthest below raw Mooncake went, by process and thread kind
    (the rows' `cpu_threads`: `run.process.thread` → CPU s per GB); "" without it."""
    split = [x for x in rows if x.get("cpu_threads") and x.get("landed_vs_raw") is not None]
    if not split:
        return ""
    worst = min(split, key=lambda x: float(x["landed_vs_raw"]))
    by_thread: dict[str, dict[str, float]] = {}
    for key, seconds in worst["cpu_threads"].items():
        run, thread = key.split(".", 1)
        by_thread.setdefault(thread, {})[run] = seconds
    runs = [k for k, _, _ in CPU_RUNS if any(k in v for v in by_thread.values())]
    # The threads that cost most first; those that cost nothing a table shows are left out.
    order = sorted(
        ((t, v) for t, v in by_thread.items() if max(v.values()) >= 0.0005),
        key=lambda item: -sum(item[1].values()),
    )
    body = table(
        ["process, thread", *(f"{k} CPU s/GB" for k in runs)],
        ([thread.replace(".", ", ", 1), *(num(v.get(k), 3) for k in runs)] for thread, v in order),
    )
    return (
        f"\n\nWhere the CPU went in the row furthest below raw Mooncake (PP={worst['pp']}, "
        f"{worst['pages']} pages: landed at {ratio(worst['landed_vs_raw'])} of raw), by process "
        "and thread kind as `kvhandoff.service.tools.bench.cpu` names them (its docstring and "
        "the performance page say what each kind holds).\n\n"
        f"{body}"
    )


def _segments(r: Mapping[str, Any]) -> str:
    rate, gbs, ratios = r["handoffs_per_s"], r["gb_s"], r["ratios"]
    chunks = r["chunks"]
    label = {"one": "one signal per stage", "layers": "one signal per layer",
             f"pages:{chunks}": f"{chunks} page ranges per stage"}  # fmt: skip
    body = table(
        ["signals", "handoffs/s", "GB/s", "÷ one signal"],
        ([label.get(w, w), num(rate[w]), num(gbs[w]), ratio(ratios.get(w, 1.0))] for w in rate),
    )
    text = (
        f"{r['model']}, {r['pages']} pages per request ({num(r['bytes_per_request'] / 1e6)} MB), "
        f"{r['concurrency']} at a time: each stage signalled ready once, once per layer "
        f"({', '.join(str(n) for n in r['layers_per_stage'])} layers per stage; the pages with "
        f"the first), or in {chunks} page ranges (the slot with the last), each signal an HTTP "
        f"request in order as an engine sends them.\n\n{body}"
    )
    book = r.get("bookkeeping")
    if book:
        text += (
            f"\n\nIn one process, without moving bytes (the planning and bookkeeping a segment "
            f"costs on both sides, {book['layers']} layers x {book['pages']} pages): "
            f"{book['one_layer_segments']} one-layer segments take "
            f"{num(book['one_layer_segments_ms'])} ms against "
            f"{num(book['one_segment_ms'])} ms for one segment of all layers "
            f"({ratio(book['ratio'])})."
        )  # fmt: skip
    return text


#: How each router shape drives a handoff (`bench.control`'s `router` key of a control row).
ROUTER_SHAPES = {
    "per-request": "one create and one ready per stage, sent at once, the outcome from the "
    "decode's event stream",
    "coalesced": "the creates, and each prefill's readies, issued in one loop turn sent as one "
    "batch request",
}


def _control(r: Mapping[str, Any]) -> str:
    shapes = any("router" in x for x in r["rows"])
    # Outcomes the event stream did not tell (looked up by GET), where the rows count them.
    fallbacks = any("fallbacks" in x for x in r["rows"])
    body = table(
        ["PP", *(["router"] if shapes else []), "concurrency", "handoffs/s", "GET /healthz/s",
         "handoffs ÷ healthz", "p50 ms", "p99 ms", "healthz p50 ms", "not completed",
         *(["outcomes by GET"] if fallbacks else [])],
        (
            [num(x["pp"]), *([targets.shape_of(x)] if shapes else []), num(x["concurrency"]),
             num(x["handoffs_per_s"]), num(x["healthz_per_s"]), ratio(x["ratio"]),
             num(x["p50_ms"]), num(x["p99_ms"]), num(x["healthz_p50_ms"]),
             num(x.get("failed", 0)), *([num(x.get("fallbacks"))] if fallbacks else [])]
            for x in r["rows"]
        ),
    )  # fmt: skip
    failed = [x for x in r["rows"] if x.get("failed")]
    if failed:
        body += "\n\nHandoffs that did not complete:\n\n" + "\n".join(
            f"- PP={x['pp']}, {targets.shape_of(x) + ' router, ' if shapes else ''}"
            f"concurrency {x['concurrency']}: "
            + "; ".join(f"{n} x `{e}`" for e, n in x["errors"].items())
            for x in failed
        )
    if fallbacks:
        body += (
            "\n\n`outcomes by GET`: outcomes of the best run that the event stream did not tell "
            "(a gap, an overflow or the stream down), which the router looked up one by one."
        )
    budget = cpu_budget.table_text(r["rows"])
    if budget:
        body += "\n\n" + budget
    if shapes:
        how = "as a router and engines drive them, in each router shape measured (" + "; ".join(
            f"`{shape}`: {ROUTER_SHAPES.get(shape, 'as `bench.control` names it')}"
            for shape in targets.shapes_of(r["rows"])
        ) + ")"  # fmt: skip
    else:
        how = (
            "as a router and engines drive them (create on the decode, ready on every stage, "
            "long-poll to the end)"
        )
    return (
        f"One-page handoffs of a small dense model (4 layers), every step over HTTP {how}, with "
        "records, the webhook outbox and signed peer messages on; beside plain `GET /healthz` "
        "round trips to the same decode from the same client at the same concurrency, "
        f"interleaved, best of the rounds.\n\n{body}"
    )


def _events(r: Mapping[str, Any]) -> str:
    return table(
        ["readers", "events", "delivered events/s (all readers)", "bus alone events/s",
         "fan-out ÷ bus alone", "dropped"],
        [[num(r["subscribers"]), num(r["events"]), num(float(r["fanout_events_per_s_total"])),
          num(float(r["bus_only_events_per_s"])), ratio(r["fanout_vs_bus_only"]),
          num(r["dropped"])]],
    )  # fmt: skip


def _webhooks(r: Mapping[str, Any]) -> str:
    return table(
        ["events", "handoffs", "in flight", "signed deliveries/s (outbox on disk)",
         "plain POSTs/s (no outbox)", "deliveries ÷ POSTs", "publish µs/event"],
        [[num(r["events"]), num(r["handoffs"]), num(r["concurrency"]),
          num(r["deliveries_per_s"]), num(r["raw_posts_per_s"]), ratio(r["ratio"]),
          num(r["publish_us_per_event"])]],
    )  # fmt: skip


def _load(r: Mapping[str, Any]) -> str:
    rss = table(
        ["process", "first quarter MiB", "last quarter MiB", "last ÷ first (VmRSS)",
         "last ÷ first (RssAnon)", "peak MiB", "flat"],
        (
            [v["process"], num(v["first_mib"]), num(v["last_mib"]), ratio(v["ratio"]),
             ratio(v["anon_ratio"]), num(v["peak_mib"]), "yes" if v["ok"] else "**no**"]
            for v in r["rss"]
        ),
    )  # fmt: skip
    lost = r["peer_lost"]
    verdict = "passed" if r["ok"] else "**failed**: " + "; ".join(r["failures"])
    errors = ""
    if r.get("errors"):
        errors = "\n\nHandoffs that did not complete, by error:\n\n" + "\n".join(
            f"- {count} x `{err}`" for err, count in r["errors"].items()
        )
    return (
        f"{r['model']}: {num(r['inflight'])} handoffs kept in flight for "
        f"{num(float(r['duration_s']))} s (each lane starts its next handoff when the last "
        f"ends). {num(r['completed'])} of {num(r['started'])} completed ({num(r['lost'])} lost), "
        f"{num(r['handoffs_per_s'])} handoffs/s, p50 {num(r['p50_ms'])} ms, p99 "
        f"{num(r['p99_ms'])} ms; peers declared lost: "
        f"{', '.join(f'{k} {num(v)}' for k, v in lost.items())}. RSS of every process sampled "
        f"each second (VmRSS, and RssAnon: the private heap); the first and last quarters "
        f"after a {num(float(r['warmup_s']))} s warm-up compared, bound "
        f"{ratio(r['max_rss_growth'])}. Verdict: {verdict}.\n\n{rss}{errors}"
    )


ENGINES_TITLE = "Real SGLang servers: kvhandoff against SGLang's mooncake backend"


def _versus(r: Mapping[str, Any], native: str) -> list[list[str]]:
    """A real-server comparison's table rows: each concurrency's latency, TTFT and
    requests/s of kvhandoff and of the engine's `native` backend, and their ratio."""
    rows = {(x["backend"], x["concurrency"]): x for x in r["rows"]}
    body = []
    for c in sorted({c for _, c in rows}):
        k, n = rows.get(("kvhandoff", c)), rows.get((native, c))
        if k is None or n is None:
            continue
        for label, key, digits in (
            ("latency p50 ms (send → last token)", "p50_ms", 1),
            ("latency p99 ms", "p99_ms", 1),
            ("TTFT p50 ms (decode's first token)", "ttft_p50_ms", 1),
            ("TTFT p99 ms", "ttft_p99_ms", 1),
            ("requests/s", "req_per_s", 2),
            ("requests", "requests", 0),
            ("failed requests", "failed", 0),
        ):
            if key not in k and key not in n:  # a run that did not count it
                continue
            if not digits:  # a count, not compared
                body.append([num(c), label, num(k.get(key)), num(n.get(key)), ""])
                continue
            a, b = _figure(k.get(key)), _figure(n.get(key))
            body.append([num(c), label, num(a, digits), num(b, digits), ratio(div(a, b))])
    return body


def _figure(value: Any) -> float | None:
    """A row's figure; None where no request completed to give one."""
    return None if value is None else float(value)


def _failures(r: Mapping[str, Any]) -> str:
    """The failed requests of a real-server comparison, per backend, concurrency and round,
    with their causes; "" when none failed."""
    lines = []
    for row in r["rows"]:
        for f in row.get("failures", ()):
            lines.append(
                f"- {row['backend']}, concurrency {num(row['concurrency'])}, round "
                f"{num(int(f['round']) + 1)}: `{f['cause']}`: {f['detail']}"
            )
    if not lines:
        return ""
    return (
        "\n\nFailed requests (counted, not timed: the percentiles and requests/s are over the "
        "completed ones):\n\n" + "\n".join(lines)
    )


def _starts(r: Mapping[str, Any]) -> str:
    return ", ".join(f"{name} {num(float(s))} s" for name, s in r["start_s"].items())


def _engines(r: Mapping[str, Any]) -> str:
    """`bench/engines.json` (`make bench-engines`, `bench/engines.py`): its own run."""
    m = r["machine"]
    load = m.get("load_avg_at_start")
    body = _versus(r, "mooncake")
    starts = _starts(r)
    return (
        f"Measured at commit `{m.get('commit')}` on {m.get('at')}, in a run of its own "
        f"(`make bench-engines`, {num(float(r['wall_s']))} s"
        + (f"; load average {', '.join(num(x) for x in load)} at the start" if load else "")
        + "). SGLang 0.5.23 `launch_server` on CPU (the engine tests' flags, "
        "`--sleep-on-idle` among them: an idle server no longer busy-polls a core), "
        f"{r['model']}; two PD pairs up at once on the same machine: prefill and decode over "
        "kvhandoff (landed mode, Mooncake TCP on loopback) and over SGLang's own `mooncake` "
        "backend (Mooncake TCP on loopback; a bench-only hook turns off its pinned page "
        "indices, which a CPU torch refuses). Both answered the same prompts with "
        + ("the same tokens" if r["same_tokens"] else "**different tokens**")
        + f". Requests of {num(r['prompt_tokens'])} prompt tokens and "
        f"{num(r['new_tokens'])} new tokens (greedy, `ignore_eos`), {num(r['rounds'])} "
        "rounds alternating which backend goes first, each concurrency a closed loop (the "
        "table's `requests` per backend over all rounds); streamed from the decode. p99 of so "
        "few requests is close to their maximum. On a model this small a request's KV is "
        f"{num(r['prompt_tokens'])} KiB (1 KiB a token): the "
        "figures compare each backend's per-request control path (bootstrap, handoff "
        f"creation, notices, commit) far more than its data path. Start-up: {starts}.\n\n"
        + table(["concurrency", "", "kvhandoff", "mooncake", "kvhandoff ÷ mooncake"], body)
    )


VLLM_TITLE = "Real vLLM servers: kvhandoff's connector against vLLM's NixlConnector"


def _vllm_verdict(r: Mapping[str, Any]) -> str:
    """What the run says, ratio by ratio, with how far load moved while it ran."""
    rows = {(x["backend"], x["concurrency"]): x for x in r["rows"]}
    parts = []
    for c in sorted({c for _, c in rows}):
        k, n = rows.get(("kvhandoff", c)), rows.get(("nixl", c))
        if k is None or n is None:
            continue
        lat, rps = div(k["p50_ms"], n["p50_ms"]), div(k["req_per_s"], n["req_per_s"])
        ttft = div(k["ttft_p50_ms"], n["ttft_p50_ms"])
        if lat is None or rps is None or ttft is None:
            continue
        if max(abs(lat - 1), abs(rps - 1)) <= 0.1:
            word = "on par with NixlConnector (within 10% in latency p50 and requests/s)"
        elif lat < 1 and rps > 1:
            word = "faster than NixlConnector"
        elif lat > 1 and rps < 1:
            word = "slower than NixlConnector"
        else:
            word = "mixed against NixlConnector"
        parts.append(
            f"at concurrency {c} kvhandoff is {word}: latency p50 {ratio(lat)}, TTFT p50 "
            f"{ratio(ttft)}, requests/s {ratio(rps)}"
        )
    load = [float(x) for x in r.get("load_avg_1min", [])]
    said = "; ".join(parts) or "no concurrency has both backends' figures"
    spread = (
        f" The 1-minute load average was {num(min(load))} to {num(max(load))} during the run "
        f"({len(load)} samples: at the start, after the token check and after each closed "
        f"loop) on {r['machine'].get('cpus')} CPUs that the servers share with each other and "
        "with other work: the ratios are rough, and one run does not rank ratios near 1."
        if load
        else ""
    )
    return said[0].upper() + said[1:] + "." + spread


def _vllm(r: Mapping[str, Any]) -> str:
    """`bench/vllm.json` (`make bench-vllm`, `bench/vllm.py`): its own run."""
    m = r["machine"]
    kv = int(r["prompt_tokens"]) * int(r["kv_bytes_per_token"])
    return (
        f"Measured at commit `{m.get('commit')}` on {m.get('at')}, in a run of its own "
        f"(`make bench-vllm`, {num(float(r['wall_s']))} s). {m.get('vllm')} OpenAI servers on "
        f"CPU (the vLLM tests' flags: `--enforce-eager`, bfloat16, block size 32), {r['model']}; "
        "two PD pairs up at once on the same machine: prefill and decode over kvhandoff's "
        "`KVHandoffConnector` (landed mode, Mooncake TCP on loopback) and over vLLM's own "
        "`NixlConnector` (`kv_buffer_device` cpu). Both answered the same prompts with "
        + ("the same tokens" if r["same_tokens"] else "**different tokens**")
        + f". Requests of {num(r['prompt_tokens'])} prompt tokens and {num(r['new_tokens'])} "
        "new tokens (greedy, `ignore_eos`), sent as vLLM's PD proxy sends them (the prefill "
        "with `do_remote_decode`, then the decode with its `kv_transfer_params`, streamed); "
        f"{num(r['rounds'])} rounds alternating which backend goes first, each concurrency a "
        "closed loop (the table's `requests` per backend over all rounds). Latency and TTFT run "
        "from the send to the prefill. p99 of so few requests is close to their maximum. A "
        f"request's KV is {kib(kv)}: the figures compare each connector's per-request control "
        f"path far more than its data path. Start-up: {_starts(r)}.\n\n"
        + table(["concurrency", "", "kvhandoff", "NixlConnector", "kvhandoff ÷ Nixl"],
                _versus(r, "nixl"))
        + _failures(r)
        + f"\n\nVerdict: {_vllm_verdict(r)}"
    )  # fmt: skip


SECTION_TEXT: dict[str, tuple[str, Callable[[Mapping[str, Any]], str]]] = {
    "planning": ("Planning time against pages x layers", _planning),
    "transport": ("Transport throughput against block size", _transport),
    "e2e": ("End to end against request size and PP stages", _e2e),
    "segments": ("Layer-by-layer and page-chunk segments against one", _segments),
    "control": ("Control plane against concurrency", _control),
    "events": ("SSE events", _events),
    "webhooks": ("Webhook deliveries", _webhooks),
    "load": ("Load run: handoffs in flight, memory over time", _load),
}


# -- the document -------------------------------------------------------------------------------


def render(
    doc: Mapping[str, Any],
    plots: Mapping[str, str],
    *,
    base: Path,
    engines: Mapping[str, Any] | None = None,
    vllm: Mapping[str, Any] | None = None,
) -> str:
    """BENCHMARKS.md for `doc`; `plots` maps a section to its PNG, linked relative to `base`
    (the directory the report is written to); `engines` and `vllm`, the real-server
    comparisons' own results (`engines_beside`, `vllm_beside`), are its last sections."""
    m = doc["machine"]
    software = ", ".join(
        str(v) for v in (f"Python {m.get('python')}", m.get("torch"), m.get("numpy"),
                         m.get("aiohttp"), m.get("mooncake"),
                         f"SGLang {m['sglang']}" if m.get("sglang") else None) if v
    )  # fmt: skip
    load = m.get("load_avg_at_start")
    parts = [
        "# Benchmarks",
        "",
        "<!-- Generated by `make bench` (bench/report.py) from "
        "bench/results.json; edit the generator, not this file. -->",
        "",
        f"Measured at commit `{m.get('commit')}` on {m.get('at')}: {m.get('cpus')} CPUs "
        f"({m.get('cpu_model') or 'unknown CPU'}), {software}"
        + (f"; load average {', '.join(num(x) for x in load)} at the start" if load else "")
        + f". `make bench` took {num(float(doc['wall_s']))} s (bound {num(doc['budget_s'])} s"
        + ("; **over its bound**)" if float(doc["wall_s"]) > float(doc["budget_s"]) else ")")
        + (" — a `--quick` smoke run: sizes are tiny" if doc.get("quick") else "")
        + ".",
        "",
        "Every figure stands beside a baseline measured in the same run, in the same process "
        "topology, and is compared only as a ratio to it: the development machine is shared by "
        "several engineers and its absolute numbers move by ±30% from run to run. Raw results: "
        "[bench/results.json](bench/results.json) and [bench/results.csv](bench/results.csv). "
        "Reproduce with `make bench` (`make soak` runs the load check for ten minutes).",
    ]
    judged = targets.verdicts(doc, engines, vllm)
    parts += ["", f"## {targets.TITLE}", "", targets.section(judged, cpu_budget.limits(doc))]
    for name, section in doc["sections"].items():
        title, fn = SECTION_TEXT[name]
        parts += ["", f"## {title}", ""]
        if "error" in section:
            parts.append(f"**Not measured**: the section failed: `{section['error']}`.")
        else:
            parts.append(fn(section["result"]))
        if name in plots:
            rel = os.path.relpath(plots[name], base)
            parts += ["", f"![{title}]({rel})"]
        parts += ["", f"<sub>{num(float(section['wall_s']))} s</sub>"]
    if engines is not None:
        parts += ["", f"## {ENGINES_TITLE}", "", _engines(engines)]
    if vllm is not None:
        parts += ["", f"## {VLLM_TITLE}", "", _vllm(vllm)]
    return "\n".join(parts) + "\n"


# -- CSV ----------------------------------------------------------------------------------------


def flat_rows(doc: Mapping[str, Any]) -> list[dict[str, Any]]:
    """Every numeric figure as (section, params, metric, value): params are the row's
    identifying fields (pp, pages, concurrency, the control rows' router shape, ...), `k=v`
    joined by `;`."""
    keys = ("pp", "pages", "layers", "concurrency", "router", "block_bytes", "method", "process")
    out: list[dict[str, Any]] = []
    for name, section in doc["sections"].items():
        result = section.get("result")
        if not result:
            continue
        rows = result.get("rows") or result.get("rss") or [result]
        for row in rows:
            params = ";".join(f"{k}={row[k]}" for k in keys if k in row)
            for metric, value in row.items():
                if metric in keys or isinstance(value, bool):
                    continue
                if isinstance(value, int | float):
                    out.append(
                        {"section": name, "params": params, "metric": metric, "value": value}
                    )
                elif isinstance(value, dict) and all(
                    isinstance(v, int | float) for v in value.values()
                ):
                    out += [
                        {"section": name, "params": params, "metric": f"{metric}.{k}", "value": v}
                        for k, v in value.items()
                    ]
    return out


def to_csv(doc: Mapping[str, Any]) -> str:
    buf = io.StringIO()
    writer = csv.DictWriter(buf, ["section", "params", "metric", "value"], lineterminator="\n")
    writer.writeheader()
    writer.writerows(flat_rows(doc))
    return buf.getvalue()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results", nargs="?", default="bench/results.json")
    parser.add_argument("--out", default="BENCHMARKS.md")
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.write_text(regenerate(Path(args.results), out.parent))
    return 0


def regenerate(results: Path, base: Path) -> str:
    """The report of a results file, linking the plots found beside it, for a report written
    in `base`."""
    doc = json.loads(results.read_text())
    engines, vllm = engines_beside(results.parent), vllm_beside(results.parent)
    return render(doc, plots_beside(results, doc), base=base.resolve(), engines=engines, vllm=vllm)


def engines_beside(out_dir: Path) -> dict[str, Any] | None:
    """The results of `make bench-engines` in `out_dir` (`engines.json`), if it ran."""
    return _beside(out_dir / "engines.json")


def vllm_beside(out_dir: Path) -> dict[str, Any] | None:
    """The results of `make bench-vllm` in `out_dir` (`vllm.json`), if it ran."""
    return _beside(out_dir / "vllm.json")


def _beside(path: Path) -> dict[str, Any] | None:
    if not path.exists():
        return None
    doc: dict[str, Any] = json.loads(path.read_text())
    return doc


def plots_beside(results: Path, doc: Mapping[str, Any]) -> dict[str, str]:
    return {
        name: str(results.parent.resolve() / png)
        for name, png in PLOTS.items()
        if name in doc["sections"] and (results.parent / png).exists()
    }


if __name__ == "__main__":
    sys.exit(main())
