"""How long an embedded service's event loop could not run: a ticker's lateness, as metrics.

Run by `kvhandoff.service.embedded.EmbeddedService` on its loop, for as long as the service serves.
An embedded service answers its peers from a thread of an engine process, so only while that
process is given CPU and its thread the GIL. The ticker sleeps `interval_s`; how much later it
wakes is how long the loop ran nothing (its stall). Every stall goes into a histogram, the
longest into a gauge, and one of `warn_s` or more is logged with the CPU time the whole process
used meanwhile, which tells the two causes apart:

- near zero: the OS did not run the process at all (descheduled on a loaded or oversubscribed
  host, a low-priority engine, a stopped process): no code of it could have answered;
- near the stall: a thread of the process kept the CPU and the GIL (the engine's own Python
  work, or a blocking call on the loop).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Gauge, Histogram

log = logging.getLogger("kvhandoff.embedded")

#: 10 ms (a busy loop) to 30 s (a process that was not run for as long as a handoff lasts).
STALL_BUCKETS_S = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class LoopStalls:
    """The stalls of the loop that runs `run()`, in `registry`'s metrics."""

    def __init__(
        self,
        registry: CollectorRegistry,
        *,
        interval_s: float = 0.1,
        warn_s: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
        cpu_clock: Callable[[], float] = time.process_time,
    ) -> None:
        self.interval_s = interval_s
        self.warn_s = warn_s
        self._clock = clock
        self._cpu_clock = cpu_clock
        self.stalls = Histogram(
            "kvhandoff_embedded_loop_stall_seconds",
            "How much later than asked the embedded service's loop woke a ticker (every "
            "interval): how long it could run nothing, peers' calls included",
            buckets=STALL_BUCKETS_S,
            registry=registry,
        )
        self.longest = Gauge(
            "kvhandoff_embedded_loop_stall_max_seconds",
            "The longest stall of the embedded service's loop since it started",
            registry=registry,
        )
        self.longest_s = 0.0

    async def run(self) -> None:
        """Tick until cancelled."""
        last, cpu = self._clock(), self._cpu_clock()
        while True:
            await asyncio.sleep(self.interval_s)
            now, now_cpu = self._clock(), self._cpu_clock()
            self.record(now - last - self.interval_s, now_cpu - cpu)
            last, cpu = now, now_cpu

    def record(self, stall_s: float, process_cpu_s: float) -> None:
        """One tick: the loop ran nothing for `stall_s` while the process used
        `process_cpu_s` of CPU (all its threads)."""
        stall_s = max(0.0, stall_s)
        self.stalls.observe(stall_s)
        if stall_s > self.longest_s:
            self.longest_s = stall_s
            self.longest.set(stall_s)
        if stall_s >= self.warn_s:
            why = (
                "the OS did not run this process (a loaded host or a low-priority engine)"
                if process_cpu_s < 0.25 * stall_s
                else "a thread of this process kept the CPU and the GIL"
            )
            log.warning(
                "the embedded service's loop ran nothing for %.2f s (the process used %.2f s "
                "of CPU meanwhile: %s); peers' calls to it waited as long",
                stall_s,
                process_cpu_s,
                why,
            )
