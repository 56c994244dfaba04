"""`GET /v1/handoffs` across restarts: a decode app restarted over the same state directory (a
real SQLite file) lists the handoffs of its earlier lives with this life's, once each, in
creation order, a page at a time — the set `GET /v1/handoffs/{id}` answers for, with its views.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from kvhandoff.pipelines.decode.views import HandoffRequest
from kvhandoff.service.config import Config
from kvhandoff.service.records.handoffs import HandoffRecords
from kvhandoff.service.runtime.persistence import PERSISTENCE, RESTARTED, purge_once
from kvhandoff.service.serve import serve
from kvhandoff.service.storage import FILE_NAME, Database
from tests.unit.service.handoff_fixtures import (
    WAIT_S,
    Deployment,
    assert_problem,
    decode_config,
    extensions,
    fill_sources,
    open_deployment,
    prefill_config,
)

SRC, SLOT = [3, 4], 1


async def run(d: Deployment, hid: str, page: int) -> dict[str, Any]:
    """A completed handoff into decode pages `page` and `page + 1`."""
    reply = await d.create(hid, [page, page + 1], SLOT)
    assert reply.status == 201, reply.body
    for rank in (0, 1):
        assert (await d.ready(hid, rank, SRC, 0)).status == 202
    view = await d.finish(hid)
    assert view["state"] == "completed", view
    return view


async def listed(d: Deployment, query: str = "") -> tuple[list[dict[str, Any]], int | None]:
    reply = await d.request("GET", f"{d.decode.url}/v1/handoffs?{query}")
    assert reply.status == 200, reply.body
    return reply.body["items"], reply.body["next_cursor"]


async def every(
    d: Deployment, query: str, limit: int, cursor: int | None = None
) -> list[dict[str, Any]]:
    """Every item after `cursor`, following `next_cursor` `limit` at a time."""
    items: list[dict[str, Any]] = []
    for _ in range(100):  # a cursor that does not move fails the test instead of hanging it
        more, cursor = await listed(
            d, f"{query}&limit={limit}" + ("" if cursor is None else f"&cursor={cursor}")
        )
        assert len(more) <= limit and (more or cursor is None)
        items += more
        if cursor is None:
            return items
    raise AssertionError(f"still paging after {ids(items)}")


def ids(items: list[dict[str, Any]]) -> list[str]:
    return [v["id"] for v in items]


async def transferring(d: Deployment, hid: str) -> None:
    """Wait until the prefill services have the handoff's destination."""
    async with asyncio.timeout(WAIT_S):
        while (await d.get(hid)).body["state"] != "transferring":
            await asyncio.sleep(0.01)


def killed_in_flight(state_dir: Path, hid: str) -> None:
    """What a killed process leaves of a handoff it accepted: a record without an outcome."""
    now = time.time()
    db = Database(state_dir / FILE_NAME)
    request = HandoffRequest(id=hid, prefill=["http://p"], dst_pages=[60], dst_slot=9)
    with db.transaction() as tx:
        # Its deadline long past: nothing of it is fenced, its pages count as released.
        HandoffRecords(db, grace_s=1.0).accepted(tx, request, now - 7200, now - 3600)
    db.close()


def config_in(state_dir: Path, **settings: Any) -> Config:
    return decode_config({"server.state_dir": str(state_dir), **settings})


async def test_a_restart_lists_the_earlier_lives_handoffs_with_this_lifes(tmp_path: Path) -> None:
    config = config_in(tmp_path)
    async with (
        serve(prefill_config([0, 1]), extensions) as prefill,
        aiohttp.ClientSession() as http,
    ):
        async with serve(config, extensions) as first:
            d = Deployment(http, first, [prefill])
            fill_sources(d)
            for n, hid in enumerate(["z1", "a2", "m3"]):  # creation order, not id order
                await run(d, hid, 2 * n)
            assert (await d.create("cut", [20], 2)).status == 201  # aborted by the shutdown
            page1, cursor = await listed(d, "limit=2")
            assert ids(page1) == ["z1", "a2"] and cursor is not None
        killed_in_flight(tmp_path, "lost")  # a later life that died with it in flight
        async with serve(config, extensions) as again:
            d = Deployment(http, again, [prefill])
            await run(d, "new", 30)
            live = await d.create("live", [40], 3, deadline_s=600)  # never signalled
            assert live.status == 201
            await transferring(d, "live")  # its state stays put from here on
            # Paging goes on where it was before the restart, into this life's handoffs.
            rest = await every(d, "", 2, cursor)
            assert ids(rest) == ["m3", "cut", "lost", "new", "live"]
            everything = await every(d, "", 3)
            assert ids(everything) == ["z1", "a2", "m3", "cut", "lost", "new", "live"]
            # Each item is what the single GET answers, less the timeline.
            for item in everything:
                one = await d.get(item["id"])
                assert one.status == 200 and one.body.pop("timeline")
                assert item == one.body
            states = {v["id"]: v["state"] for v in everything}
            assert states == {
                "z1": "completed",
                "a2": "completed",
                "m3": "completed",
                "cut": "aborted",
                "lost": "failed",
                "new": "completed",
                "live": "transferring",  # the live view, not its record's "accepted"
            }
            assert everything[4]["error"]["code"] == RESTARTED
            assert ids(await every(d, "state=completed", 2)) == ["z1", "a2", "m3", "new"]
            assert ids(await every(d, "state=failed", 2)) == ["lost"]
            assert ids(await every(d, "state=transferring", 1)) == ["live"]
            assert await listed(d, "state=pending") == ([], None)
            last, end = await listed(d, f"limit=7&cursor={cursor}")
            assert ids(last) == ["m3", "cut", "lost", "new", "live"] and end is None


async def test_a_handoff_held_here_is_listed_once_even_after_its_record_is_purged(
    tmp_path: Path,
) -> None:
    config = config_in(tmp_path, **{"records.max_records": 1})
    async with open_deployment(decode=config) as d:
        fill_sources(d)
        for n, hid in enumerate(["h1", "h2", "h3"]):
            await run(d, hid, 2 * n)
        p = d.decode.app[PERSISTENCE]
        assert purge_once(p, config) == 2 and p.records.find("h1") is None
        # This process still answers for h1 and h2 (GET), so the list has them too.
        assert (await d.get("h1")).status == 200
        assert ids(await every(d, "", 1)) == ["h1", "h2", "h3"]


async def test_without_records_the_list_is_this_processes_handoffs(tmp_path: Path) -> None:
    async with open_deployment(decode=config_in(tmp_path, **{"records.persist": False})) as d:
        fill_sources(d)
        for n, hid in enumerate(["h1", "h2", "h3"]):
            await run(d, hid, 2 * n)
        assert PERSISTENCE not in d.decode.app
        assert ids(await every(d, "state=completed", 2)) == ["h1", "h2", "h3"]
    assert not (tmp_path / FILE_NAME).exists()


@pytest.mark.parametrize(
    ("query", "field"),
    [
        ("limit=0", "limit"),
        ("limit=1001", "limit"),
        ("limit=1.5", "limit"),
        ("cursor=-1", "cursor"),
        ("cursor=x", "cursor"),
        (f"cursor={2**62 + 1}", "cursor"),
        ("cursor=%EF%BC%91", "cursor"),  # a fullwidth "1": int() would take it
        ("state=accepted", "state"),  # the records' word, not a state of the API
        ("state=", "state"),
    ],
)
async def test_a_bad_query_value_is_refused_naming_it(query: str, field: str) -> None:
    async with open_deployment() as d:
        reply = await d.request("GET", f"{d.decode.url}/v1/handoffs?{query}")
        assert_problem(reply, 422, field=field)
