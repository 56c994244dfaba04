"""The benchmarks' raw Mooncake baselines (`kvhandoff.service.testing.raw_engines`) move every
byte: a writer process per stage, over the engine's sync call and over its async calls with a
sleeping wait, into a receiving engine in this process (real engines, TCP on loopback)."""

from __future__ import annotations

import contextlib
import os

import numpy as np

from kvhandoff.service.testing.raw_engines import IN_FLIGHT, RawEngine, StageProcesses
from kvhandoff.transport.blocks import Blocks
from kvhandoff.transport.pool_shm import ShmPool

BLOCK = 1 << 20


def test_both_raw_baselines_land_every_byte_in_place() -> None:
    # More blocks than the sleeping writer keeps in flight, so its refill is on the path.
    count = IN_FLIGHT + 6
    name = f"kvh-test-raw-{os.getpid()}"
    with contextlib.ExitStack() as stack:
        src = ShmPool(f"{name}-src", [count * BLOCK], align_bytes=4096)
        stack.callback(src.close)
        dst = ShmPool(f"{name}-dst", [count * BLOCK], align_bytes=4096)
        stack.callback(dst.close)
        receiver = RawEngine([dst])
        stack.callback(receiver.close)
        target = f"127.0.0.1:{receiver.engine.get_rpc_port()}"
        writers = StageProcesses([src])
        stack.callback(writers.close)
        # Block k of the source goes to slot count-1-k of the destination: a writer that
        # ignored the addresses, or wrote in place, would not give this picture.
        order = np.arange(count, dtype=np.uint64)[::-1]
        blocks = Blocks.of(
            np.uint64(src.regions[0].addr) + np.arange(count, dtype=np.uint64) * np.uint64(BLOCK),
            np.uint64(dst.regions[0].addr) + order * np.uint64(BLOCK),
            np.full(count, BLOCK, dtype=np.uint64),
        )
        rng = np.random.default_rng(7)
        for sleeping in (False, True):
            data = rng.integers(0, 256, count * BLOCK, dtype=np.uint8)
            src.view(0)[:] = data
            dst.view(0)[:] = 0
            assert writers.seconds(target, [blocks], sleeping=sleeping) > 0
            want = data.reshape(count, BLOCK)[::-1].reshape(-1)
            assert np.array_equal(dst.view(0), want), f"sleeping={sleeping}"
