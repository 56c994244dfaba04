"""`handoff_page` over a real decode app's pipeline and its real SQLite file: the records of an
earlier life merged with this life's live handoffs, and what one page reads from the file."""

from __future__ import annotations

import re
from pathlib import Path

import aiohttp

from kvhandoff.pipelines.decode.views import HandoffPage
from kvhandoff.pipelines.states import HandoffState
from kvhandoff.service.records.listing import handoff_page
from kvhandoff.service.runtime.persistence import PERSISTENCE
from kvhandoff.service.runtime.roles import DECODE
from kvhandoff.service.serve import Server, serve
from tests.unit.service.handoff_fixtures import (
    Deployment,
    decode_config,
    extensions,
    fill_sources,
    prefill_config,
)

_LIMIT = re.compile(r"SELECT seq, id FROM handoffs .* LIMIT (\d+)$")


async def run(d: Deployment, hid: str, page: int) -> None:
    assert (await d.create(hid, [page], 1)).status == 201
    for rank in (0, 1):
        assert (await d.ready(hid, rank, [3], 0)).status == 202
    assert (await d.finish(hid))["state"] == "completed"


def page_of(server: Server, state: HandoffState | None, limit: int, cursor: int) -> HandoffPage:
    decode = server.app[DECODE].pipeline
    assert decode is not None
    return handoff_page(decode, server.app[PERSISTENCE].records, state, limit, cursor)


async def test_pages_merge_records_and_live_handoffs_reading_a_bounded_range(
    tmp_path: Path,
) -> None:
    config = decode_config({"server.state_dir": str(tmp_path)})
    earlier = [f"old{i}" for i in range(6)]
    this = [f"new{i}" for i in range(6)]
    async with (
        serve(prefill_config([0, 1]), extensions) as prefill,
        aiohttp.ClientSession() as http,
    ):
        async with serve(config, extensions) as first:
            d = Deployment(http, first, [prefill])
            fill_sources(d)
            for i, hid in enumerate(earlier):
                await run(d, hid, i)
        async with serve(config, extensions) as again:
            d = Deployment(http, again, [prefill])
            for i, hid in enumerate(this):
                await run(d, hid, i)
            decode = again.app[DECODE].pipeline
            assert decode is not None and set(this) <= {h.request.id for h in decode.query.held()}
            limits: list[int] = []
            again.app[PERSISTENCE].db.conn.set_trace_callback(
                lambda sql: limits.extend(int(m) for m in _LIMIT.findall(sql))
            )
            for limit in (1, 2, 5, 12, 13):
                seen: list[str] = []
                cursor = 0
                while True:
                    limits.clear()
                    page = page_of(again, None, limit, cursor)
                    assert limits == [2 * (limit + 1)]  # one range read of the records
                    seen += [v.id for v in page.items]
                    if page.next_cursor is None:
                        break
                    assert len(page.items) == limit
                    cursor = page.next_cursor
                assert seen == [*earlier, *this], limit
            completed = page_of(again, HandoffState.COMPLETED, 100, 0)
            assert [v.id for v in completed.items] == [*earlier, *this]
            assert all(not v.timeline for v in completed.items)
            assert page_of(again, HandoffState.FAILED, 100, 0).items == []
