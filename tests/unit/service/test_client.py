"""The router client against a real decode service (in-process, local transport), its event
stream against the service's own `GET /v1/events`, and — for what a live service cannot be made
to do on cue (a connection cut half-way through a frame, a gap of chosen ids) — against a small
SSE endpoint speaking the same wire format (`event:` tag, `id:` sequence number, `data:` JSON,
`Last-Event-ID` resume, `stream.gap` with `first_id`/`last_id`)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from kvhandoff.pipelines.decode import HandoffState
from kvhandoff.service.client import ApiError, KVHandoffClient, StreamEvent
from tests.unit.service.handoff_fixtures import Deployment, fill_sources, open_deployment

SRC, DST = [3, 4], [10, 11]


@pytest.fixture
async def d() -> AsyncIterator[Deployment]:
    async with open_deployment() as deployment:
        fill_sources(deployment)
        yield deployment


async def test_create_get_wait_list_abort(d: Deployment) -> None:
    async with KVHandoffClient(d.decode.url) as kv:
        created = await kv.create("h1", DST, dst_slot=1, prefill=d.prefill_urls)
        assert created.state == HandoffState.PENDING or created.state == HandoffState.TRANSFERRING
        again = await kv.create("h1", DST, dst_slot=1, prefill=d.prefill_urls)
        assert again.id == "h1"  # the same request is idempotent
        for rank in (0, 1):
            await d.ready("h1", rank, SRC, 0)
        done = await kv.wait("h1")
        assert done.state == HandoffState.COMPLETED and done.bytes > 0
        assert (await kv.get("h1")).state == HandoffState.COMPLETED
        await kv.create("h2", [20], dst_slot=2, prefill=d.prefill_urls)
        still = await kv.wait("h2", timeout_s=0.05)  # a bounded wait answers as it is
        assert not still.state.terminal
        aborted = await kv.abort("h2")
        assert aborted.state == HandoffState.ABORTED
        listed = [v.id async for v in kv.list(page_size=1)]
        assert listed == ["h1", "h2"]
        assert [v.id async for v in kv.list(state="aborted")] == ["h2"]


async def test_api_errors_carry_the_problem_members(d: Deployment) -> None:
    async with KVHandoffClient(d.decode.url) as kv:
        with pytest.raises(ApiError) as missing:
            await kv.get("nope")
        assert missing.value.status == 404 and missing.value.code == "not_found"
        with pytest.raises(ApiError) as bad:
            await kv.create("h1", [10_000], dst_slot=1, prefill=d.prefill_urls)
        assert bad.value.status == 422 and bad.value.problem["field"] == "dst_pages[0]"


# ------------------------------------------------------------------------------ events


async def test_events_from_the_service_stream_and_resume_from_an_id(d: Deployment) -> None:
    async with KVHandoffClient(d.decode.url) as kv:
        stream = kv.events(handoffs=["h1"], types=["handoff."])
        first = asyncio.ensure_future(anext(stream))
        await kv.create("h1", DST, dst_slot=1, prefill=d.prefill_urls)
        for rank in (0, 1):
            await d.ready("h1", rank, SRC, 0)
        got = [await first]
        async with asyncio.timeout(10):
            async for event in stream:
                got.append(event)
                if event.type == "handoff.completed":
                    break
        await stream.aclose()  # type: ignore[attr-defined]
        assert got[0].type == "handoff.created" and got[-1].type == "handoff.completed"
        assert all(e.data["handoff_id"] == "h1" for e in got)
        ids = [e.id for e in got]
        assert ids == sorted(ids) and len(set(ids)) == len(ids)
        # Resuming after the first event replays the rest from the service's buffer, exactly.
        again = kv.events(handoffs=["h1"], types=["handoff."], last_event_id=ids[0])
        rest = await collect(again, len(ids) - 1)
        await again.aclose()  # type: ignore[attr-defined]
        assert [e.id for e in rest] == ids[1:]


class SseSource:
    """Serves `events` (id 1..N) as text/event-stream from `Last-Event-ID`; the first
    connection is cut after `cut_after` events; ids before `oldest` are announced as a gap."""

    def __init__(self, count: int, cut_after: int, oldest: int = 1) -> None:
        self.events = [
            {"type": "handoff.created" if i % 2 else "handoff.completed", "seq": i}
            for i in range(1, count + 1)
        ]
        self.cut_after = cut_after
        self.oldest = oldest
        self.requests: list[dict[str, Any]] = []

    async def handle(self, request: web.Request) -> web.StreamResponse:
        last = request.headers.get("Last-Event-ID") or request.query.get("last_event_id")
        self.requests.append({"last": last, "query": list(request.query.items())})
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        start = int(last) + 1 if last else 1
        await resp.write(b": keep-alive\n\nretry: 10\n\n")
        if start < self.oldest:
            gap = {"type": "stream.gap", "first_id": start, "last_id": self.oldest - 1}
            await resp.write(f"event: stream.gap\ndata: {json.dumps(gap)}\n\n".encode())
            start = self.oldest
        for sent, ev in enumerate(self.events[start - 1 :]):
            if len(self.requests) == 1 and sent == self.cut_after:
                # Drop the connection mid-stream, half-way through an event.
                await resp.write(b"event: handoff.created\nid: 99")
                assert request.transport is not None
                request.transport.close()
                return resp
            data = json.dumps(ev)
            await resp.write(f"event: {ev['type']}\nid: {ev['seq']}\ndata: {data}\n\n".encode())
        return resp


async def collect(stream: AsyncIterator[StreamEvent], n: int) -> list[StreamEvent]:
    out: list[StreamEvent] = []
    async with asyncio.timeout(10):
        async for event in stream:
            out.append(event)
            if len(out) == n:
                break
    return out


async def test_events_resume_from_the_last_id_after_a_dropped_connection() -> None:
    source = SseSource(count=50, cut_after=17)
    app = web.Application()
    app.router.add_get("/v1/events", source.handle)
    async with TestServer(app) as server, KVHandoffClient(str(server.make_url(""))) as kv:
        stream = kv.events(types=["handoff."], handoffs=["a", "b"])
        got = await collect(stream, 50)
        await stream.aclose()  # type: ignore[attr-defined]
    assert [e.id for e in got] == list(range(1, 51))  # nothing missing, nothing twice
    assert [e.data["seq"] for e in got] == list(range(1, 51))
    assert got[0].type == "handoff.created" and got[1].type == "handoff.completed"
    assert [r["last"] for r in source.requests] == [None, "17"]
    assert source.requests[0]["query"] == [
        ("handoff", "a"),
        ("handoff", "b"),
        ("types", "handoff."),
    ]


async def test_events_surface_a_gap_explicitly() -> None:
    source = SseSource(count=10, cut_after=100, oldest=6)
    app = web.Application()
    app.router.add_get("/v1/events", source.handle)
    async with TestServer(app) as server, KVHandoffClient(str(server.make_url(""))) as kv:
        stream = kv.events(last_event_id=2)
        got = await collect(stream, 6)
        await stream.aclose()  # type: ignore[attr-defined]
    assert got[0].type == "stream.gap" and got[0].data == {
        "type": "stream.gap",
        "first_id": 3,
        "last_id": 5,
    }
    assert [e.id for e in got[1:]] == [6, 7, 8, 9, 10]
    assert source.requests[0]["last"] == "2"


async def test_events_resume_from_a_position_and_do_not_yield_it() -> None:
    """A filtered stream's `stream.position` moves the id a re-open resumes from (past the
    events the reader does not carry), and is not an event a caller has to skip."""
    opens: list[str | None] = []

    async def handle(request: web.Request) -> web.StreamResponse:
        opens.append(request.headers.get("Last-Event-ID"))
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(b"retry: 10\n\n")
        if len(opens) == 1:
            await resp.write(b'id: 3\nevent: handoff.completed\ndata: {"seq": 3}\n\n')
            await resp.write(b'id: 900\nevent: stream.position\ndata: {"last_id": 900}\n\n')
            return resp  # the connection ends here
        await resp.write(b'id: 901\nevent: handoff.completed\ndata: {"seq": 901}\n\n')
        return resp

    app = web.Application()
    app.router.add_get("/v1/events", handle)
    async with TestServer(app) as server, KVHandoffClient(str(server.make_url(""))) as kv:
        stream = kv.events(types=["handoff.completed"])
        got = await collect(stream, 2)
        await stream.aclose()  # type: ignore[attr-defined]
    assert [(e.type, e.id) for e in got] == [("handoff.completed", 3), ("handoff.completed", 901)]
    assert opens[:2] == [None, "900"]
