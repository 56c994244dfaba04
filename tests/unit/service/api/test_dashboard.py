"""`GET /` and `GET /v1/dashboard` on a live decode service and its prefill service."""

from __future__ import annotations

import re
from collections.abc import AsyncIterator

import pytest

from tests.unit.service.api.test_handoffs import MOVE, ready_all
from tests.unit.service.handoff_fixtures import (
    Deployment,
    fill_sources,
    open_deployment,
)


@pytest.fixture
async def d() -> AsyncIterator[Deployment]:
    async with open_deployment(token="t0k") as deployment:
        fill_sources(deployment)
        yield deployment


async def test_the_page_is_self_contained_and_open(d: Deployment) -> None:
    async with d.http.get(f"{d.decode.url}/", headers={"Authorization": ""}) as resp:
        assert resp.status == 200
        assert resp.content_type == "text/html"
        assert "default-src 'none'" in resp.headers["Content-Security-Policy"]
        html = await resp.text()
    # Nothing loads from elsewhere: no absolute URLs, no external scripts, styles or fonts.
    assert not re.search(r"(?:src|href)\s*=|https?://|@import|url\(", html)
    assert 'new EventSource("/v1/events"' in html and 'fetch("/v1/events"' in html
    for keeps_token in ("localStorage", "sessionStorage", "document.cookie", "?token"):
        assert keeps_token not in html


async def test_the_snapshot_needs_the_token_and_shows_what_happened(d: Deployment) -> None:
    async with d.http.get(f"{d.decode.url}/v1/dashboard", headers={"Authorization": ""}) as r:
        assert r.status == 401
    assert (await d.create("dash", MOVE.dst_pages, MOVE.dst_slot)).status == 201
    await ready_all(d, "dash")
    view = await d.finish("dash")
    reply = await d.request("GET", f"{d.decode.url}/v1/dashboard")
    assert reply.status == 200, reply.body
    body = reply.body
    assert body["role"] == "decode" and body["in_flight"] == 0
    assert body["last_event_id"] == view["timeline"][-1]["seq"]
    [h] = body["handoffs"]
    assert (h["id"], h["state"], h["bytes"]) == ("dash", "completed", view["bytes"])
    assert [(s["pp_rank"], s["done"]) for s in h["stages"]] == [(0, True), (1, True)]
    assert sum(b["handoffs"] for b in body["throughput"]) == 1
    assert body["latency"]["count"] == 1
    assert [p["url"] for p in body["peers"]] == d.prefill_urls
    # The landing arena: every window of the completed handoff given back.
    [arena] = body["arenas"]
    assert arena["arena"] == "landing" and arena["capacity_bytes"] > 0
    assert (arena["used_bytes"], arena["quarantined_bytes"], arena["waiting"]) == (0, 0, 0)

    reply = await d.request("GET", f"{d.prefills[0].url}/v1/dashboard")
    assert reply.body["role"] == "prefill"
    assert [(a["arena"], a["used_bytes"]) for a in reply.body["arenas"]] == [("staging", 0)]
    [h] = reply.body["handoffs"]
    assert h["state"] == "sent" and h["finished_at"] is not None  # its stages are done
    assert [(s["pp_rank"], s["done"]) for s in h["stages"]] == [(0, True), (1, True)]
    assert sum(s["bytes"] for s in h["stages"]) == view["bytes"]
