"""`GET /` and `GET /v1/dashboard` on a live decode service and its prefill service."""

from __future__ import annotations

import asyncio
import re
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from kvhandoff.service.serve import serve
from tests.unit.service.api.test_handoffs import MOVE, ready_all
from tests.unit.service.handoff_fixtures import (
    Deployment,
    decode_config,
    extensions,
    fill_sources,
    open_deployment,
    prefill_config,
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


async def test_the_page_s_icon_is_served_open(d: Deployment) -> None:
    # Browsers ask for /favicon.ico on every load: a 404 there was noise in every log.
    async with d.http.get(f"{d.decode.url}/favicon.ico", headers={"Authorization": ""}) as resp:
        assert resp.status == 200 and resp.content_type == "image/svg+xml"
        assert (await resp.read()).startswith(b"<svg")


async def test_peers_are_labelled_and_ordered_by_the_stages_they_host_and_pages_shown() -> None:
    async with open_deployment(split=True) as d:
        fill_sources(d)
        urls = d.prefill_urls
        # Named in reverse: the snapshot orders peers by stage, not as a create listed them.
        body = {"id": "p", "prefill": urls[::-1], "dst_pages": [5, 6], "dst_slot": 1}
        reply = await d.request("POST", f"{d.decode.url}/v1/handoffs", json=body)
        assert reply.status == 201, reply.body
        body = (await d.request("GET", f"{d.decode.url}/v1/dashboard")).body
        assert body["peer_stages"] == {urls[0]: [0], urls[1]: [1]}
        assert [p["url"] for p in body["peers"]] == urls  # stage 0's host first
        assert not any(p["configured"] for p in body["peers"])  # named by the create only
        pages = body["pages"]
        assert (pages["leased"], pages["live"], pages["fenced"]) == (2, 2, 0)
        assert pages["total"] > 2 and pages["fenced_handoffs"] == []


async def test_after_a_restart_the_snapshot_shows_the_earlier_life_s_records(
    tmp_path: Path,
) -> None:
    """Issue 18 D: a restarted decode's page showed no earlier handoffs (the failure being
    investigated included) while saying "history reloaded"."""
    config = decode_config({"server.state_dir": str(tmp_path)})
    async with (
        serve(prefill_config([0, 1]), extensions) as prefill,
        aiohttp.ClientSession() as http,
    ):
        async with serve(config, extensions) as first:
            d = Deployment(http, first, [prefill])
            fill_sources(d)
            assert (await d.create("done", MOVE.dst_pages, MOVE.dst_slot)).status == 201
            await ready_all(d, "done")
            assert (await d.finish("done"))["state"] == "completed"
            assert (await d.create("broken", [9], 2)).status == 201
            reply = await d.request("DELETE", f"{first.url}/v1/handoffs/broken")
            assert reply.status == 200, reply.body
        async with serve(config, extensions) as again:
            d = Deployment(http, again, [prefill])
            body = (await d.request("GET", f"{again.url}/v1/dashboard")).body
            got = {h["id"]: (h["state"], h["recorded"]) for h in body["handoffs"]}
            assert got == {"done": ("completed", True), "broken": ("aborted", True)}
            done = next(h for h in body["handoffs"] if h["id"] == "done")
            assert done["finished_at"] is not None and done["bytes"] > 0
            assert [s["done"] for s in done["stages"]] == [True, True]


async def test_an_idle_decode_labels_its_configured_prefill_by_stage() -> None:
    """No handoff since start: the page still names which stage each configured prefill hosts
    (asked of the peers once they answer), in stage order."""
    async with (
        serve(prefill_config([1]), extensions) as second,
        serve(prefill_config([0]), extensions) as first,
        aiohttp.ClientSession() as http,
    ):
        urls = [second.url, first.url]  # configured in neither stage nor URL order
        async with serve(decode_config({"peers.prefill": urls}), extensions) as dec:
            d = Deployment(http, dec, [first, second])
            body: dict[str, Any] = {}
            for _ in range(3000):
                body = (await d.request("GET", f"{dec.url}/v1/dashboard")).body
                if len(body["peer_stages"]) == 2:
                    break
                await asyncio.sleep(0.01)
            assert body["peer_stages"] == {first.url: [0], second.url: [1]}, body
            peers = body["peers"]
            assert [p["url"] for p in peers] == [first.url, second.url]
            assert all(p["configured"] and p["up"] for p in peers)
