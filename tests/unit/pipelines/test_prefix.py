"""A decode that holds a request's prefix (`prefix_pages`): the prefills send the pages after
it only, into the decode's pages for those positions, and no byte reaches any other page. And
what a prefill's engine learns of its destination (`stage.destination`).

Real memory and the local transport, both pipelines in one loop (`test_landed.make_world`), in
landed and direct mode, signalled by layer and by page range, before and after the destination.
"""

from __future__ import annotations

import itertools
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import numpy as np
import pytest

from kvhandoff.pipelines.decode.views import HandoffRequest
from kvhandoff.pipelines.errors import InvalidInput
from kvhandoff.pipelines.events import DestinationReceived, SegmentCommitted
from kvhandoff.pipelines.states import HandoffState
from tests.fakes import eventually
from tests.unit.pipelines.test_landed import (
    World,
    assert_landed,
    close_world,
    make_world,
    open_handoff,
    wait_released,
)

SRC = [3, 4, 9, 10, 11, 20, 21]
PREFIX = 3
DST = [10, 11, 2, 20]  # positions 3..6 of the request
#: Range cuts: the first range inside the prefix, the second across its end.
CUTS = [0, 2, 4, 5, 7]


@asynccontextmanager
async def opened(*, landed: bool = True) -> AsyncIterator[World]:
    w = await make_world(landed=landed)
    try:
        yield w
    finally:
        await close_world(w)


def kv_rows(w: World) -> list[np.ndarray]:
    return [
        w.dec.region(i)[: e.nbytes].reshape(-1, e.item_len).copy()
        for i, e in enumerate(w.dec.layout.kv)
    ]


def assert_only(w: World, dst: list[int], before: list[np.ndarray]) -> None:
    """No KV page of the decode changed but `dst`."""
    for i, (a, b) in enumerate(zip(before, kv_rows(w))):
        keep = np.setdiff1d(np.arange(a.shape[0]), dst)
        assert np.array_equal(a[keep], b[keep]), f"KV entry {i}: a page outside {dst} changed"


def signal(w: World, hid: str, how: str, slot: int) -> None:
    for rank in (0, 1):
        if how == "layers":
            w.prefill.ready(hid, rank, SRC, slot)
            continue
        for i, (a, b) in enumerate(itertools.pairwise(CUTS)):
            last = i == len(CUTS) - 2
            w.prefill.ready(
                hid, rank, SRC[a:b], slot if last else None, pages_from=a, last_pages=last
            )


@pytest.mark.parametrize("landed", [True, False], ids=["landed", "direct"])
@pytest.mark.parametrize("how", ["layers", "ranges"])
@pytest.mark.parametrize("destination_first", [True, False], ids=["dest-first", "signals-first"])
async def test_the_pages_after_the_prefix_land_in_the_decode_pages_and_nothing_else(
    landed: bool, how: str, destination_first: bool
) -> None:
    async with opened(landed=landed) as w:
        before = kv_rows(w)
        commits: list[SegmentCommitted] = []
        w.bus.add_listener(lambda e: commits.append(e) if isinstance(e, SegmentCommitted) else None)
        # Direct mode checks the decode's pages against the prefill's digests of the suffix.
        request = HandoffRequest(
            id="x",
            prefill=["p"],
            dst_pages=DST,
            prefix_pages=PREFIX,
            dst_slot=1,
            verify=not landed,
        )
        expected: dict[int, int] = {}
        if destination_first:
            await w.decode.create(request)
            expected = {r: w.landing.expected("x", r) for r in (0, 1)} if landed else {}
            await eventually(
                lambda: (
                    open_handoff(w, "x") is not None
                    and open_handoff(w, "x").known_destination is not None
                ),
                what="the destination",
            )
            signal(w, "x", how, 2)
        else:
            signal(w, "x", how, 2)
            await w.decode.create(request)
            expected = {r: w.landing.expected("x", r) for r in (0, 1)} if landed else {}
        assert await wait_released(w, "x") == HandoffState.COMPLETED
        assert w.decode.get("x").verification == "passed"
        assert_landed(w, SRC[PREFIX:], DST, 2, 1)
        assert_only(w, DST, before)
        # The decode expected, and committed, the suffix's bytes only.
        for rank, nbytes in expected.items():
            assert sum(e.bytes for e in commits if e.pp_rank == rank) == nbytes
            stage = w.stages[rank].layout
            per_page = sum(e.item_len for e in stage.kv)
            slot = sum(s.item_len for s in stage.state) + sum(a.item_len for a in stage.aux)
            assert nbytes == len(DST) * per_page + slot


async def test_a_prefix_of_every_page_sends_the_state_only() -> None:
    async with opened() as w:
        before = kv_rows(w)
        await w.decode.create(
            HandoffRequest(id="all", prefill=["p"], dst_pages=[], prefix_pages=len(SRC), dst_slot=3)
        )
        signal(w, "all", "ranges", 0)
        assert await wait_released(w, "all") == HandoffState.COMPLETED
        assert_landed(w, [], [], 0, 3)
        assert_only(w, [], before)


async def test_a_last_range_inside_the_prefix_is_refused_naming_last_pages() -> None:
    # The destination known: the signal itself is refused and changes nothing.
    async with opened() as w:
        await w.decode.create(
            HandoffRequest(id="s", prefill=["p"], dst_pages=DST, prefix_pages=PREFIX, dst_slot=0)
        )
        await eventually(
            lambda: (
                open_handoff(w, "s") is not None
                and open_handoff(w, "s").known_destination is not None
            ),
            what="the destination",
        )
        w.prefill.ready("s", 0, SRC[:2], None, pages_from=0, last_pages=False)
        with pytest.raises(InvalidInput) as err:
            w.prefill.ready("s", 0, SRC[2:3], 0, pages_from=2, last_pages=True)
        assert err.value.context["field"] == "last_pages"
        assert "3 of them its cached prefix" in err.value.message
        assert open_handoff(w, "s").inputs[0].src_pages.tolist() == SRC[:2]


@pytest.mark.parametrize("landed", [True, False], ids=["landed", "direct"])
@pytest.mark.parametrize("how", ["layers", "ranges"])
async def test_a_stage_shorter_than_the_prefix_fails_naming_the_field_and_writes_nothing(
    how: str, landed: bool
) -> None:
    # Signalled before the destination said how long the prefix is: the stage worker checks
    # when it comes, and the handoff fails naming the field; no decode page changes.
    async with opened(landed=landed) as w:
        before = kv_rows(w)
        for rank in (0, 1):
            if how == "layers":
                w.prefill.ready("short", rank, SRC[:2], 0)
            else:
                w.prefill.ready("short", rank, SRC[:2], 0, pages_from=0, last_pages=True)
        await w.decode.create(
            HandoffRequest(id="short", prefill=["p"], dst_pages=[], prefix_pages=PREFIX, dst_slot=0)
        )
        assert await wait_released(w, "short") == HandoffState.FAILED
        error = w.decode.get("short").error
        assert error is not None and error.context.get("field") == "prefix_pages", error
        assert "has 2 pages, fewer than the 3-page prefix" in error.reason
        assert_only(w, [], before)


@pytest.mark.parametrize(
    ("how", "pages", "field", "says"),
    [
        ("ranges", [*SRC, 22], "src_pages", "the last range ends at position 8; the decode has 7"),
        ("layers", [*SRC, 22], "dst_pages", "src_pages has 8 pages; the decode has 7"),
        ("ranges", SRC[:5], "last_pages", "the last range ends at position 5; the decode has 7"),
        ("layers", SRC[:5], "dst_pages", "src_pages has 5 pages; the decode has 7"),
    ],
)
@pytest.mark.parametrize("landed", [True, False], ids=["landed", "direct"])
async def test_pages_that_do_not_add_up_with_the_prefix_fail_in_request_positions(
    how: str, pages: list[int], field: str, says: str, landed: bool
) -> None:
    # Every page signalled before the destination came: checked once it does.
    async with opened(landed=landed) as w:
        before = kv_rows(w)
        for rank in (0, 1):
            if how == "layers":
                w.prefill.ready("n", rank, pages, 0)
            else:
                w.prefill.ready("n", rank, pages[:2], None, pages_from=0, last_pages=False)
                w.prefill.ready("n", rank, pages[2:], 0, pages_from=2, last_pages=True)
        await w.decode.create(
            HandoffRequest(id="n", prefill=["p"], dst_pages=DST, prefix_pages=PREFIX, dst_slot=0)
        )
        assert await wait_released(w, "n") == HandoffState.FAILED
        error = w.decode.get("n").error
        assert error is not None and error.context.get("field") == field, error
        assert says in error.reason and "(3 of them its cached prefix)" in error.reason, error
        assert_only(w, [], before)


async def test_a_range_queued_before_the_destination_past_its_pages_fails_naming_src_pages() -> (
    None
):
    # Queued before the destination, not the last: the worker checks its end as it reads it.
    async with opened() as w:
        before = kv_rows(w)
        for rank in (0, 1):
            w.prefill.ready("q", rank, [*SRC, 22], None, pages_from=0, last_pages=False)
        await w.decode.create(
            HandoffRequest(id="q", prefill=["p"], dst_pages=DST, prefix_pages=PREFIX, dst_slot=0)
        )
        assert await wait_released(w, "q") == HandoffState.FAILED
        error = w.decode.get("q").error
        assert error is not None and error.context.get("field") == "src_pages", error
        assert "the range ends at position 8; the decode has 7 pages (3 of them" in error.reason
        assert_only(w, [], before)


async def test_the_prefill_publishes_each_destination_for_its_engine() -> None:
    # What an engine adapter reads of a destination: where it goes, how many pages after which
    # prefix, and how many decode handoffs take the same bytes (`fan_out`).
    async with opened() as w:
        seen: list[DestinationReceived] = []
        w.bus.add_listener(lambda e: seen.append(e) if isinstance(e, DestinationReceived) else None)
        await w.decode.create(
            HandoffRequest(
                id="f", prefill=["p"], dst_pages=DST, prefix_pages=PREFIX, fan_out=3, dst_slot=0
            )
        )
        await eventually(lambda: bool(seen), what="the destination event")
        (event,) = seen
        assert (event.role, event.decode_url, event.pp_ranks) == ("prefill", "d", [0, 1])
        assert (event.num_pages, event.prefix_pages, event.fan_out) == (len(DST), PREFIX, 3)
        await w.decode.abort("f")
