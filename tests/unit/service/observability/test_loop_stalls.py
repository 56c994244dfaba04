"""LoopStalls: a ticker's lateness as the embedded loop's stall metrics, and a warning that
tells a process the OS did not run from one whose own threads kept the loop from running."""

from __future__ import annotations

import asyncio
import logging
import time

import pytest
from prometheus_client import CollectorRegistry

from kvhandoff.service.observability.loop_stalls import LoopStalls


def value(registry: CollectorRegistry, name: str, **labels: str) -> float:
    got = registry.get_sample_value(name, labels)
    assert got is not None, name
    return got


def test_every_tick_is_observed_and_the_longest_kept() -> None:
    registry = CollectorRegistry()
    stalls = LoopStalls(registry)
    for stall in (0.002, 0.7, -0.001, 0.3):
        stalls.record(stall, 0.0)
    assert value(registry, "kvhandoff_embedded_loop_stall_seconds_count") == 4
    assert value(registry, "kvhandoff_embedded_loop_stall_seconds_bucket", le="0.5") == 3
    assert value(registry, "kvhandoff_embedded_loop_stall_max_seconds") == 0.7
    assert stalls.longest_s == 0.7


@pytest.mark.parametrize(
    ("cpu_s", "why"),
    [
        (0.01, "the OS did not run this process"),
        (2.9, "a thread of this process kept the CPU and the GIL"),
    ],
)
def test_a_long_stall_is_logged_with_what_the_process_did_meanwhile(
    cpu_s: float, why: str, caplog: pytest.LogCaptureFixture
) -> None:
    stalls = LoopStalls(CollectorRegistry(), warn_s=1.0)
    with caplog.at_level(logging.WARNING, "kvhandoff.embedded"):
        stalls.record(0.9, cpu_s)
        assert not caplog.records
        stalls.record(3.0, cpu_s)
    (record,) = caplog.records
    assert "ran nothing for 3.00 s" in record.getMessage()
    assert why in record.getMessage()


async def test_the_ticker_measures_a_loop_blocked_by_a_call() -> None:
    registry = CollectorRegistry()
    stalls = LoopStalls(registry, interval_s=0.01)
    ticker = asyncio.create_task(stalls.run())
    await asyncio.sleep(0.05)
    loop = asyncio.get_running_loop()
    loop.call_soon(time.sleep, 0.4)  # a blocking call on the loop
    await asyncio.sleep(0.2)
    ticker.cancel()
    await asyncio.wait([ticker])
    assert 0.35 <= stalls.longest_s < 2.0
    assert value(registry, "kvhandoff_embedded_loop_stall_max_seconds") == stalls.longest_s
