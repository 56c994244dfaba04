"""The sleeping wait of a few large Mooncake blocks (`kvhandoff.transport.mooncake_polled`): its
outcome rules against a scripted engine; the real engine is `tests/integration/
test_transport_mooncake.py` (bytes, a refused destination, a dead or stopped receiver)."""

from __future__ import annotations

import asyncio
import logging
import time

import numpy as np
import pytest

from kvhandoff.transport import config as transport_config
from kvhandoff.transport import mooncake_polled
from kvhandoff.transport.blocks import Blocks
from kvhandoff.transport.config import MooncakeConfig
from kvhandoff.transport.errors import TransportTimeout
from kvhandoff.transport.mooncake import MooncakeTransport
from kvhandoff.transport.mooncake_polled import MIN_BLOCK_BYTES, polled_call, write_polled
from kvhandoff.transport.regions import Region

MiB = 1 << 20


class Script:
    """The engine's async calls: batch ids 1, 2, ... in submission order; each id's statuses
    in order (the last one repeats); submission `fail_at` (1-based) returns 0, submission
    `raise_at` raises MemoryError (as the binding may); ids handed over go to `orphans`."""

    def __init__(self, statuses: dict[int, list[int]], fail_at: int = 0, raise_at: int = 0) -> None:
        self.statuses = statuses
        self.fail_at = fail_at
        self.raise_at = raise_at
        self.submitted: list[list[int]] = []
        self.checks: list[int] = []
        self.ended: set[int] = set()
        self.orphans: list[int] = []

    def call(self, budget_ns: int = 10**10, poll_s: float = 0) -> int:
        return write_polled(
            self.submit, self.check, "peer", ROWS, budget_ns, self.orphans.extend, poll_s
        )

    def submit(self, peer: str, src: list[int], dst: list[int], length: list[int]) -> int:
        assert peer == "peer" and len(src) == len(dst) == len(length) == 1  # one entry each
        if len(self.submitted) + 1 == self.raise_at:
            raise MemoryError("std::bad_alloc")
        self.submitted.append([src[0], dst[0], length[0]])
        return 0 if len(self.submitted) == self.fail_at else len(self.submitted)

    def check(self, batch: int) -> int:
        assert batch not in self.ended, f"batch {batch} checked after it ended (freed)"
        self.checks.append(batch)
        script = self.statuses[batch]
        status = script.pop(0) if len(script) > 1 else script[0]
        if status in (1, -1):  # the engine frees the id; -2 keeps it (the write may run)
            self.ended.add(batch)
        return status


ROWS = [[100, 200, MiB], [101, 201, MiB], [102, 202, MiB]]


def test_every_block_completes_and_the_call_succeeds() -> None:
    s = Script({1: [0, 0, 1], 2: [1], 3: [0, 1]})
    assert s.call() == 0
    assert s.submitted == ROWS
    assert s.ended == {1, 2, 3}


def test_a_failed_block_fails_the_call_only_after_the_others_ended() -> None:
    s = Script({1: [-1], 2: [0, 0, 0, 1], 3: [1]})
    assert s.call() == -1
    assert s.ended == {1, 2, 3}
    assert s.checks[-1] == 2  # waited for block 2 to end, not just until block 1 failed


def test_a_failed_submission_stops_submitting_and_waits_for_what_runs() -> None:
    s = Script({1: [0, 0, 1]}, fail_at=2)
    assert s.call() == -1
    assert s.submitted == ROWS[:2]  # the third block never went
    assert s.ended == {1}


def test_a_submission_that_raises_still_waits_for_the_blocks_already_submitted() -> None:
    s = Script({1: [0, 0, 1]}, raise_at=2)
    with pytest.raises(MemoryError):
        s.call()
    assert s.submitted == ROWS[:1]
    assert s.ended == {1}  # block 1 was checked until it ended, not abandoned running
    assert s.orphans == []


def test_a_submission_that_raises_hands_over_what_still_runs_at_the_budget() -> None:
    s = Script({1: [0], 2: [0, 1]}, raise_at=3)
    with pytest.raises(MemoryError):
        s.call(budget_ns=20_000_000, poll_s=0.001)
    assert s.ended == {2} and s.orphans == [1]


def test_a_status_check_that_raises_hands_over_every_id_not_ended() -> None:
    s = Script({1: [1], 2: [0], 3: [0]})

    def check(batch: int) -> int:
        if batch == 3:
            raise RuntimeError("binding")
        return s.check(batch)

    with pytest.raises(RuntimeError):
        write_polled(s.submit, check, "peer", ROWS, 10**10, s.orphans.extend, 0)
    assert s.ended == {1} and s.orphans == [2, 3]  # 1 ended: never handed over (freed)


def test_a_timed_out_status_is_still_running_until_the_budget_and_is_handed_over() -> None:
    s = Script({1: [1], 2: [-2], 3: [1]})  # -2: the engine keeps the id; the write may run
    assert s.call(budget_ns=20_000_000, poll_s=0.001) == -1
    assert s.checks.count(2) > 1 and s.orphans == [2]


def test_the_call_gives_up_once_the_engine_allowance_is_spent() -> None:
    s = Script({1: [0], 2: [1], 3: [1]})
    t0 = time.monotonic()
    assert s.call(budget_ns=50_000_000, poll_s=0.001) == -1
    assert 0.05 <= time.monotonic() - t0 < 1.0
    assert s.orphans == [1]  # still running: handed over, not abandoned


class AsyncEngine:
    def batch_transfer_async_write(self, *args: object) -> int:
        return 1

    def transfer_check_status(self, batch: int) -> int:
        return 1


def _blocks(n: int, size: int) -> Blocks:
    offs = np.arange(n, dtype=np.uint64) * np.uint64(size)
    return Blocks.of(offs + np.uint64(1 << 30), offs + np.uint64(1 << 31), [size] * n)


def test_only_few_large_tcp_blocks_on_an_engine_with_async_calls_take_the_polled_wait() -> None:
    tcp = MooncakeConfig()
    orphans: list[int] = []
    engine = AsyncEngine()
    assert polled_call(engine, tcp, "peer", _blocks(16, MiB), orphans.extend) is not None
    small = _blocks(16, MIN_BLOCK_BYTES // 2)
    assert polled_call(engine, tcp, "peer", small, orphans.extend) is None
    # A staged segment's tail block, smaller than the others, keeps its call on the polled
    # wait (a fifth of a landed stage's calls carry one): the rule is the blocks' mean size.
    tail = Blocks.concat([_blocks(15, MiB), _blocks(1, 4096)])
    assert polled_call(engine, tcp, "peer", tail, orphans.extend) is not None
    mostly_small = Blocks.concat([_blocks(1, MiB), _blocks(15, 4096)])
    assert polled_call(engine, tcp, "peer", mostly_small, orphans.extend) is None
    assert polled_call(engine, tcp, "peer", _blocks(65, MiB), orphans.extend) is None
    assert polled_call(object(), tcp, "peer", _blocks(16, MiB), orphans.extend) is None
    rdma = MooncakeConfig(protocol="rdma", device_name="mlx5_0")
    assert polled_call(engine, rdma, "peer", _blocks(16, MiB), orphans.extend) is None


class StalledEngine:
    """A receiver that stays stopped: every batch runs until `resume()`, then completes."""

    def __init__(self) -> None:
        self.resumed = False
        self.next_id = 0
        self.unregistered: list[list[int]] = []

    def batch_register_memory(self, addrs: list[int], lengths: list[int]) -> int:
        return 0

    def batch_unregister_memory(self, addrs: list[int]) -> int:
        self.unregistered.append(addrs)
        return 0

    def batch_transfer_async_write(self, *args: object) -> int:
        self.next_id += 1
        return self.next_id

    def transfer_check_status(self, batch: int) -> int:
        return 1 if self.resumed else 0

    def resume(self) -> None:
        self.resumed = True


async def test_orphans_keep_the_peer_stuck_and_close_gives_up_on_them_within_max_call_s(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The call gives up (budget 1 s here) with both batches running: the peer stays stuck and
    `quiesce` waits; `close` waits at most `max_call_s` more, then leaves the source memory
    registered (logged) instead of unregistering it under running writes; once the batches
    end, `quiesce` returns."""
    monkeypatch.setattr(mooncake_polled, "ENGINE_MIN_TIMEOUT_S", 0)
    monkeypatch.setattr(transport_config, "ENGINE_MIN_TIMEOUT_S", 0)
    engine = StalledEngine()
    config = MooncakeConfig(transfer_timeout_s=0.1, max_bytes_per_batch=4 * MiB)
    t = MooncakeTransport(engine, config, "me:1")  # type: ignore[arg-type]
    source = np.zeros(2 * MIN_BLOCK_BYTES, dtype=np.uint8)
    t.register([Region(source.ctypes.data, source.nbytes)])
    blocks = _blocks(2, MIN_BLOCK_BYTES)
    blocks = Blocks.of(
        blocks.src_addr - blocks.src_addr[0] + np.uint64(source.ctypes.data),
        blocks.dst_addr,
        blocks.length,
    )
    with pytest.raises(TransportTimeout):
        await t.write("peer:1", blocks)
    while t.stats().engine_calls == 0:  # the call gives up after its 1 s budget
        await asyncio.sleep(0.01)
    with pytest.raises(TransportTimeout, match="still"):  # orphans run: the peer is stuck
        await t.write("peer:1", blocks)
    quiet = asyncio.create_task(t.quiesce("peer:1"))
    await asyncio.sleep(0.1)
    assert not quiet.done()
    t0 = time.monotonic()
    with caplog.at_level(logging.WARNING):
        await asyncio.to_thread(t.close)
    assert config.max_call_s <= time.monotonic() - t0 < config.max_call_s + 1.0
    assert engine.unregistered == [] and "still running" in caplog.text
    engine.resume()
    await asyncio.wait_for(quiet, 5.0)
