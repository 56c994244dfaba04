"""The real-server comparisons' shared driver (`bench/engines.py`): failed requests are counted
with their causes, and the figures are over the completed ones."""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp

from bench import engines
from bench.engines import RequestFailed


async def _send(
    session: aiohttp.ClientSession, pair: Any, prompt: list[int]
) -> tuple[float, float]:
    await asyncio.sleep(0)
    if prompt[0] % 3 == 0:
        raise RequestFailed(f"request {prompt[0]} failed", cause="peer_timeout")
    if prompt[0] == 4:
        raise aiohttp.ServerDisconnectedError()
    return 0.1 * prompt[0], 0.2 * prompt[0]


def test_a_failed_request_is_counted_with_its_cause_and_the_loop_goes_on() -> None:
    batch = [[i] for i in range(1, 9)]  # 3 and 6 fail by cause, 4 by its connection
    run = asyncio.run(engines.closed_loop(None, batch, 2, _send))
    assert sorted(run["latency_s"]) == [0.2 * i for i in (1, 2, 5, 7, 8)]
    assert sorted(f["detail"] for f in run["failures"] if f["cause"] == "peer_timeout") == [
        "request 3 failed",
        "request 6 failed",
    ]
    assert [f["cause"] for f in run["failures"]].count("connection") == 1
    row = engines.summary([run])
    assert row["requests"] == 5 and row["failed"] == 3
    assert row["failed_by_cause"] == {"connection": 1, "peer_timeout": 2}
    assert row["p50_ms"] == 1e3 * 0.2 * 5
    assert row["req_per_s"] == 5 / run["wall_s"]


def test_a_round_where_every_request_failed_has_no_percentiles() -> None:
    run = asyncio.run(engines.closed_loop(None, [[3], [6]], 1, _send))
    row = engines.summary([run])
    assert row["requests"] == 0 and row["failed"] == 2
    assert row["p50_ms"] is None and row["ttft_p99_ms"] is None and row["req_per_s"] == 0


def test_measure_reports_failures_per_round_and_backend(monkeypatch: Any) -> None:
    monkeypatch.setattr(engines, "REQUESTS", {1: 3})
    monkeypatch.setattr(engines, "CONCURRENCY", (1,))
    batches = iter([[[1], [2], [3]], [[5], [6], [9]]])
    rows = engines.measure(
        {"kvhandoff": None}, 2, send=_send, batch_of=lambda n, seed: next(batches)
    )
    (row,) = rows
    assert row["by_round"] == [
        {"round": 0, "requests": 2, "failed": 1},
        {"round": 1, "requests": 1, "failed": 2},
    ]
    assert [(f["round"], f["detail"]) for f in row["failures"]] == [
        (0, "request 3 failed"),
        (1, "request 6 failed"),
        (1, "request 9 failed"),
    ]
    assert row["requests"] == 3 and row["failed"] == 3
