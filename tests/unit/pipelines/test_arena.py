"""The arena: first-fit extents, FIFO waiting bounded by a deadline, quarantine."""

from __future__ import annotations

import asyncio
import random
import time

import pytest

from kvhandoff.pipelines.arena import Arena
from kvhandoff.pipelines.errors import CapacityExceeded


async def test_extents_are_taken_first_fit_and_coalesce_when_given_back() -> None:
    a = Arena(base_addr=1 << 20, capacity_bytes=4 * 4096)
    x, y, z = (a.try_take(4096, o) for o in "xyz")
    assert x and y and z and [e.offset for e in (x, y, z)] == [0, 4096, 8192]
    assert a.addr(y) == (1 << 20) + 4096
    a.give_back(x)
    a.give_back(y)  # coalesces with x: one free run of 8 KiB before z
    big = a.try_take(8192, "big")
    assert big is not None and big.offset == 0
    assert a.stats.used_bytes == 8192 + 4096
    assert a.try_take(4097, "w") is None  # 4 KiB left: a rounded 8 KiB does not fit


async def test_a_waiter_is_served_in_order_when_room_frees() -> None:
    a = Arena(0, 2 * 4096)
    first = a.try_take(8192, "first")
    assert first is not None
    later = asyncio.ensure_future(a.take(4096, "w1", until_mono=time.monotonic() + 5))
    latest = asyncio.ensure_future(a.take(4096, "w2", until_mono=time.monotonic() + 5))
    await asyncio.sleep(0)
    assert a.stats.waiting == 2 and a.try_take(1, "x") is None  # FIFO: no cutting in
    a.give_back(first)
    e1, e2 = await asyncio.gather(later, latest)
    assert (e1.owner, e2.owner) == ("w1", "w2") and a.stats.waits == 2


async def test_a_wait_ends_at_its_deadline_and_a_request_too_big_at_once() -> None:
    a = Arena(0, 4096)
    assert a.try_take(4096, "x") is not None
    with pytest.raises(TimeoutError):
        await a.take(4096, "w", until_mono=time.monotonic() + 0.05)
    assert a.stats.waiting == 0
    with pytest.raises(CapacityExceeded):
        await a.take(8192, "huge", until_mono=time.monotonic() + 5)


async def test_quarantined_extents_come_back_only_when_their_time_passed() -> None:
    a = Arena(0, 2 * 4096)
    e = a.try_take(4096, "h")
    assert e is not None
    assert a.quarantine_owner("h", time.monotonic() + 0.05) == 1
    assert a.stats.quarantined_bytes == 4096
    waiter = asyncio.ensure_future(a.take(8192, "next", until_mono=time.monotonic() + 5))
    await asyncio.sleep(0.01)
    assert not waiter.done()  # the window is still out of use
    got = await waiter
    assert got.length == 8192 and a.stats.quarantined_bytes == 0


async def test_an_indefinite_quarantine_waits_for_its_owner() -> None:
    a = Arena(0, 4096)
    e = a.try_take(4096, "h")
    assert e is not None
    a.quarantine(e, float("inf"))
    await asyncio.sleep(0.01)
    assert a.try_take(4096, "x") is None
    a.give_back_owner("h")  # its handoff ended with every writer done
    assert a.try_take(4096, "x") is not None


async def test_each_owner_s_extents_are_found_without_the_others_in_the_order_taken() -> None:
    rng = random.Random(7)
    a = Arena(base_addr=0, capacity_bytes=64 * 4096)
    held: dict[str, list[int]] = {}
    for step in range(400):
        owner = f"h{rng.randrange(5)}"
        mine = held.setdefault(owner, [])
        if mine and rng.random() < 0.4:
            offset = mine.pop(rng.randrange(len(mine)))
            a.give_back(next(e for e in a.owned_by(owner) if e.offset == offset))
        else:
            extent = a.try_take(4096 * rng.randint(1, 3), owner)
            if extent is not None:
                mine.append(extent.offset)
        for name, offsets in held.items():
            assert [e.offset for e in a.owned_by(name)] == offsets, step
    a.give_back_owner("h0")
    assert a.owned_by("h0") == [] and a.owned_by("nobody") == []


async def test_a_stale_extent_frees_or_quarantines_nothing_of_its_offset_s_next_owner() -> None:
    """An extent given back and taken again at its offset (by another owner, or the same one)
    is a new extent: giving back or quarantining the old one leaves the new one taken."""
    a = Arena(0, 4096)
    old = a.try_take(4096, "h")
    assert old is not None
    a.give_back(old)
    new = a.try_take(4096, "h2")
    assert new is not None and new.offset == old.offset
    a.give_back(old)
    a.quarantine(old, time.monotonic() + 0.01)
    assert a.taken() == [new] and a.stats.used_bytes == 4096
    assert a.stats.quarantined_bytes == 0
    same = Arena(0, 4096)  # the same owner taking it again: equal fields, not the same extent
    first = same.try_take(4096, "h")
    assert first is not None
    same.give_back(first)
    again = same.try_take(4096, "h")
    assert again is not None and again == first
    same.give_back(first)
    assert same.taken() == [again]


async def test_tagged_bytes_are_what_a_scan_of_the_taken_extents_counts() -> None:
    """A share's bytes (`tag`, `tagged_bytes`) are kept as extents come and go, instead of a
    scan per window asked for: random takes, tags, give-backs, quarantines (lifted by their
    timer or by the owner's give-back) agree with the scan at every step."""
    clock = [0.0]
    a = Arena(0, 64 * 4096, monotonic=lambda: clock[0])
    rng = random.Random(7)
    tags: dict[int, tuple[object, str]] = {}  # offset -> (the extent tagged, its tag)

    def scanned(tag: str) -> int:
        def is_tagged(e: object) -> bool:
            found = tags.get(e.offset)  # type: ignore[attr-defined]
            return found is not None and found[0] is e and found[1] == tag

        return sum(e.length for e in a.taken() if is_tagged(e))

    for _ in range(3000):
        op = rng.random()
        held = a.taken()
        if op < 0.35:
            e = a.try_take(rng.randint(1, 5) * 4096, rng.choice("abc"))
            if e is not None and rng.random() < 0.8:
                tag = rng.choice(["p", "q"])
                a.tag(e, tag)
                a.tag(e, "other")  # a second tag does not move it
                tags[e.offset] = (e, tag)
        elif op < 0.6 and held:
            a.give_back(rng.choice(held))
        elif op < 0.7 and held:
            a.quarantine(rng.choice(held), clock[0] + rng.random())
        elif op < 0.8:
            a.give_back_owner(rng.choice("abc"))
        elif op < 0.9:
            a.quarantine_owner(rng.choice("abc"), float("inf"))
        else:
            clock[0] += rng.random()
            a._expire()  # what the quarantine's timer runs
        for tag in ("p", "q", "other"):
            assert a.tagged_bytes(tag) == scanned(tag)
    a.close()
