"""`OutcomeStream` against a scripted SSE server in this process: what it sends on a resume
(`Last-Event-ID`), what it does on an overflow, a closed stream, a look-up that fails or cannot
reach the decode, and two callers of one handoff id. (The real decode's stream is exercised in
tests/integration/test_router_stream.py; here the server's answers are chosen to be exact.)
Last, against a real decode service in this process: a resume from the decode's
`stream.position` after more than a replay buffer of other events needs no look-up."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from kvhandoff.service.observability.streams import STREAMS
from kvhandoff.service.runtime.roles import RUNTIME
from kvhandoff.service.tools import outcome_stream
from kvhandoff.service.tools.outcome_stream import Outcome, OutcomeStream
from tests.unit.service.api.test_events import completed as _completed
from tests.unit.service.api.test_events import created, decode_service

#: What one open of the stream sends, given its request (then it ends, or holds).
Script = Callable[[web.Request], Awaitable[list[bytes]]]


def payload(**data: Any) -> bytes:
    return json.dumps({"role": "decode", **data}).encode()


def frame(event_id: int, tag: str, **data: Any) -> bytes:
    return f"id: {event_id}\nevent: {tag}\ndata: ".encode() + payload(**data) + b"\n\n"


def sends(*chunks: bytes, after: asyncio.Event | None = None) -> Script:
    async def script(_: web.Request) -> list[bytes]:
        if after is not None:
            await after.wait()
        return list(chunks)

    return script


class Decode:
    """Serves `GET /v1/events` by `scripts` (one per open, the last one again; the first `drops`
    opens end after their frames, the others hold), and records each open's `Last-Event-ID`;
    `GET /v1/handoffs/{id}` records look-ups and never answers (a long poll)."""

    def __init__(self) -> None:
        self.scripts: list[Script] = [sends()]
        self.drops = 0
        self.resumes: list[str | None] = []
        self.lookups: list[str] = []
        self.hold = asyncio.Event()

    async def events(self, request: web.Request) -> web.StreamResponse:
        self.resumes.append(request.headers.get("Last-Event-ID"))
        script = self.scripts[min(len(self.resumes), len(self.scripts)) - 1]
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(b": open\n\n")
        for chunk in await script(request):
            await resp.write(chunk)
        if len(self.resumes) > self.drops:
            await self.hold.wait()
        return resp

    async def handoff(self, request: web.Request) -> web.Response:
        self.lookups.append(request.match_info["id"])
        await asyncio.sleep(3600)  # a long poll that the stream's answer must cancel
        return web.json_response({})


@pytest.fixture
async def decode() -> AsyncIterator[tuple[Decode, str]]:
    fake = Decode()
    app = web.Application()
    app.router.add_get("/v1/events", fake.events)
    app.router.add_get("/v1/handoffs/{id}", fake.handoff)
    runner = web.AppRunner(app, shutdown_timeout=0.1)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    yield fake, f"http://127.0.0.1:{port}"
    fake.hold.set()
    await runner.cleanup()


async def until(condition: Callable[[], bool], timeout_s: float = 5.0) -> None:
    """Wait until `condition()` holds, failing after `timeout_s` (far less than any patience)."""
    async with asyncio.timeout(timeout_s):
        while not condition():
            await asyncio.sleep(0.01)


def looking_up(http: aiohttp.ClientSession, url: str) -> Callable[[str], Any]:
    async def fallback(handoff_id: str) -> Outcome:
        async with http.get(f"{url}/v1/handoffs/{handoff_id}") as resp:
            return Outcome("completed", (await resp.json())["bytes"])

    return fallback


async def test_a_dropped_stream_resumes_by_last_event_id_and_the_replay_resolves(
    decode: tuple[Decode, str],
) -> None:
    fake, url = decode
    go = asyncio.Event()
    fake.scripts = [
        sends(frame(5, "handoff.completed", handoff_id="a", bytes=7), after=go),
        sends(frame(6, "handoff.completed", handoff_id="b", bytes=9)),
    ]
    fake.drops = 1  # the first open ends after its frame
    async with aiohttp.ClientSession() as http:
        stream = OutcomeStream(http, url, looking_up(http, url), patience_s=30)
        await stream.start()
        a, b = stream.expect("a"), stream.expect("b")
        waiting = [asyncio.ensure_future(stream.outcome(h, f)) for h, f in (("a", a), ("b", b))]
        await asyncio.sleep(0.01)
        go.set()
        outcomes = await asyncio.wait_for(asyncio.gather(*waiting), 5)
        assert outcomes == [Outcome("completed", 7), Outcome("completed", 9)]
        assert fake.resumes == [None, "5"]  # the replay came by the id it resumed from
        assert (stream.fallbacks, fake.lookups) == (0, [])
        await stream.close()


async def test_an_overflow_resumes_instead_of_looking_every_handoff_up(
    decode: tuple[Decode, str],
) -> None:
    fake, url = decode
    go = asyncio.Event()
    overflow = b'id: 3\nevent: stream.overflow\ndata: {"last_id": 3, "queue": 4}\n\n'
    fake.scripts = [
        sends(overflow, after=go),
        sends(frame(4, "handoff.completed", handoff_id="a", bytes=1)),
    ]
    fake.drops = 1  # the decode cuts the reader off after its overflow frame
    async with aiohttp.ClientSession() as http:
        stream = OutcomeStream(http, url, looking_up(http, url), patience_s=30)
        await stream.start()
        a = stream.expect("a")
        waiting = asyncio.ensure_future(stream.outcome("a", a))
        await asyncio.sleep(0.01)
        go.set()
        assert await asyncio.wait_for(waiting, 5) == Outcome("completed", 1)
        assert (stream.overflows, fake.resumes) == (1, [None, "3"])
        assert (stream.fallbacks, fake.lookups) == (0, [])
        await stream.close()


async def test_the_streams_answer_cancels_the_look_up_and_two_callers_keep_their_own_fate(
    decode: tuple[Decode, str],
) -> None:
    fake, url = decode
    async with aiohttp.ClientSession() as http:
        stream = OutcomeStream(http, url, looking_up(http, url), patience_s=0.05)
        await stream.start()
        first, second = stream.expect("x"), stream.expect("x")
        stream.forget("x", first)  # the first caller's create was refused
        waiting = asyncio.ensure_future(stream.outcome("x", second))
        await until(lambda: bool(fake.lookups))  # past patience: looked up (a long poll)
        # The outcome comes on the stream: the second caller has it, its look-up is cancelled.
        stream._on_frame("handoff.completed", payload(handoff_id="x", bytes=3))
        assert await asyncio.wait_for(waiting, 5) == Outcome("completed", 3)
        await asyncio.sleep(0)
        assert (first.cancelled(), stream._looking, stream._waiting) == (True, {}, {})
        await stream.close()


async def test_close_answers_every_outstanding_caller(decode: tuple[Decode, str]) -> None:
    _, url = decode
    async with aiohttp.ClientSession() as http:
        stream = OutcomeStream(http, url, looking_up(http, url), patience_s=0.05)
        await stream.start()
        future = stream.expect("y")
        waiting = asyncio.ensure_future(stream.outcome("y", future))
        await asyncio.sleep(0.1)  # past patience: its look-up hangs on the decode
        await stream.close()
        outcome = await asyncio.wait_for(waiting, 2)
        assert (outcome.state, stream.up) == ("unreachable", False)
        late = stream.expect("z")  # registered after the close: answered at once
        assert (await asyncio.wait_for(late, 1)).state == "unreachable"


async def test_a_look_up_that_raises_or_cannot_reach_is_retried_until_patience_then_answered(
    decode: tuple[Decode, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    _, url = decode
    monkeypatch.setattr(outcome_stream, "RETRY_S", 0.02)
    tries: list[float] = []

    async def fallback(handoff_id: str) -> Outcome:
        tries.append(asyncio.get_running_loop().time())
        if len(tries) == 1:
            raise RuntimeError("Session is closed")  # a fallback that breaks its promise
        return Outcome("unreachable", 0, "ClientConnectorError: refused")

    async with aiohttp.ClientSession() as http:
        stream = OutcomeStream(http, url, fallback, patience_s=0.3)
        await stream.start()
        future = stream.expect("w")
        stream._up.clear()  # the stream is down: the handoff is looked up at once
        outcome = await asyncio.wait_for(stream.outcome("w", future), 5)
        assert outcome.state == "unreachable"
        # Not answered on the first failure: asked again until its patience was spent.
        assert len(tries) > 3 and tries[-1] - tries[0] >= 0.2
        await stream.close()


async def test_a_gap_looks_up_every_created_handoff_and_marks_the_others(
    decode: tuple[Decode, str],
) -> None:
    fake, url = decode
    go = asyncio.Event()
    gap = b'id: 9\nevent: stream.gap\ndata: {"first_id": 2, "last_id": 8}\n\n'
    fake.scripts = [sends(gap, after=go)]
    async with aiohttp.ClientSession() as http:
        stream = OutcomeStream(http, url, looking_up(http, url), patience_s=30)
        await stream.start()
        created, later = stream.expect("c"), stream.expect("n")
        waiting = asyncio.ensure_future(stream.outcome("c", created))
        await asyncio.sleep(0.01)
        assert fake.lookups == []  # the stream is up: nothing is looked up
        go.set()
        await until(lambda: bool(fake.lookups))
        # "c" (created) is looked up at once; "n" (not created yet) once its create is answered.
        assert (stream.gaps, fake.lookups) == (1, ["c"])
        waiting_later = asyncio.ensure_future(stream.outcome("n", later))
        await until(lambda: len(fake.lookups) == 2)
        assert fake.lookups == ["c", "n"]
        for handoff_id in ("c", "n"):
            stream._on_frame("handoff.completed", payload(handoff_id=handoff_id, bytes=2))
        assert (
            await asyncio.wait_for(asyncio.gather(waiting, waiting_later), 5)
            == [Outcome("completed", 2)] * 2
        )
        await stream.close()


async def test_a_position_before_any_outcome_is_where_a_re_open_resumes(
    decode: tuple[Decode, str],
) -> None:
    fake, url = decode
    go = asyncio.Event()
    position = b'id: 40\nevent: stream.position\ndata: {"last_id": 40}\n\n'
    fake.scripts = [
        sends(position, after=go),
        sends(frame(41, "handoff.completed", handoff_id="a", bytes=5)),
    ]
    fake.drops = 1  # the first open ends after its position
    async with aiohttp.ClientSession() as http:
        stream = OutcomeStream(http, url, looking_up(http, url), patience_s=30)
        await stream.start()
        a = stream.expect("a")
        waiting = asyncio.ensure_future(stream.outcome("a", a))
        go.set()
        assert await asyncio.wait_for(waiting, 5) == Outcome("completed", 5)
        # Not an outcome, not a reason to look anything up: a resume point.
        assert (stream.positions, fake.resumes) == (1, [None, "40"])
        assert (stream.fallbacks, fake.lookups) == (0, [])
        await stream.close()


@pytest.mark.parametrize("seen_outcome", [True, False])
async def test_a_resume_after_a_buffer_of_other_events_needs_no_look_up(
    seen_outcome: bool,
) -> None:
    """Review finding 8, against a real decode (replay buffer of 64 events): the stream is cut
    after 200 events that are not outcomes. It resumes from the last `stream.position`, not
    from its last outcome's id (long gone: a gap, and every outstanding handoff looked up) nor
    with no id at all when it had seen no outcome (every one looked up)."""
    lookups: list[str] = []

    async def fallback(handoff_id: str) -> Outcome:
        lookups.append(handoff_id)
        return Outcome("unreachable")

    async with (
        decode_service({"handoff.sse_buffer": 64}) as server,
        aiohttp.ClientSession() as http,
    ):
        bus, stats = server.app[RUNTIME].bus, server.app[STREAMS]
        stream = OutcomeStream(http, server.url, fallback, patience_s=30)
        await stream.start()
        if seen_outcome:
            first = stream.expect("first")
            bus.publish(_completed("first"))
            assert await asyncio.wait_for(stream.outcome("first", first), 5) == _completed_7
        later = stream.expect("later")
        waiting = asyncio.ensure_future(stream.outcome("later", later))
        for _ in range(200):
            bus.publish(created("other"))
        await until(lambda: stream.positions >= 2)  # the one at open, one after the markers
        for task in stats.open.values():  # the decode drops the stream (as on its shutdown)
            assert task is not None
            task.cancel()
        bus.publish(_completed("later"))
        assert await asyncio.wait_for(waiting, 5) == _completed_7
        assert (stream.gaps, stream.fallbacks, lookups) == (0, 0, [])
        assert (stats.opened_total, stats.gaps_total) == (2, 0)  # it did re-open
        await stream.close()


_completed_7 = Outcome("completed", 7)  # what `_completed` tells a router
