"""The SSE routes (`kvhandoff.service.api.events`), read the way a router or a browser reads them.

A decode service runs with `serve()` on a free port; most tests publish events on its bus
directly (the stream does not care who published) and read them with `httpx-sse`. Every wait is
on something the test can observe (a frame read, a counter), never a sleep.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
from httpx_sse import ServerSentEvent, aconnect_sse

from kvhandoff.pipelines.events import EventBus, HandoffCompleted, HandoffCreated, StageArrived
from kvhandoff.service.api.events import Frames
from kvhandoff.service.observability.streams import STREAMS, StreamStats
from kvhandoff.service.runtime.roles import RUNTIME
from kvhandoff.service.serve import Server, serve
from tests.unit.service.api.test_handoffs import MOVE, ready_all
from tests.unit.service.handoff_fixtures import (
    WAIT_S,
    Deployment,
    decode_config,
    extensions,
    fill_sources,
    open_deployment,
)


@asynccontextmanager
async def decode_service(settings: Mapping[str, Any] | None = None) -> AsyncIterator[Server]:
    async with serve(decode_config(settings), extensions) as server:
        yield server


def bus_of(server: Server) -> EventBus:
    return server.app[RUNTIME].bus


def stats_of(server: Server) -> StreamStats:
    return server.app[STREAMS]


def created(handoff_id: str, pad: int = 0) -> HandoffCreated:
    metadata = {"pad": "x" * pad} if pad else {}
    return HandoffCreated(
        handoff_id=handoff_id, role="decode", num_pages=1, pp_size=1, metadata=metadata
    )


def publish_many(bus: EventBus, n: int, handoff_id: str = "h", pad: int = 0) -> list[int]:
    return [bus.publish(created(handoff_id, pad)).seq for _ in range(n)]


async def read(source: Any, n: int) -> list[ServerSentEvent]:
    """The next `n` frames (comments are not frames), or fail after WAIT_S."""
    out: list[ServerSentEvent] = []
    async with asyncio.timeout(WAIT_S):
        async for sse in source.aiter_sse():
            out.append(sse)
            if len(out) == n:
                break
    return out


@pytest.fixture
async def http() -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(timeout=httpx.Timeout(WAIT_S)) as client:
        yield client


async def test_frames_carry_seq_tag_and_the_event_and_filters_select(
    http: httpx.AsyncClient,
) -> None:
    async with decode_service() as server:
        bus = bus_of(server)
        url = f"{server.url}/v1/events?handoff=a&handoff=b&types=handoff.completed,stage."
        async with aconnect_sse(http, "GET", url) as source:
            assert source.response.headers["content-type"].startswith("text/event-stream")
            assert source.response.headers["cache-control"].startswith("no-cache")
            assert source.response.headers["x-accel-buffering"] == "no"
            bus.publish(created("a"))  # type not selected
            bus.publish(
                StageArrived(
                    handoff_id="c", role="decode", pp_rank=0, bytes=1, arrived=1, expected=1
                )
            )  # handoff not selected
            want = [
                bus.publish(
                    StageArrived(
                        handoff_id="a", role="decode", pp_rank=0, bytes=7, arrived=1, expected=1
                    )
                ),
                bus.publish(
                    HandoffCompleted(
                        handoff_id="b", role="decode", bytes=7, seconds=0.5, verified=False
                    )
                ),
            ]
            position, *frames = await read(source, 3)
        assert [f.event for f in frames] == ["stage.arrived", "handoff.completed"]
        o = bus.first_seq - 1  # this life's ids start after every earlier life's
        assert [int(f.id) for f in frames] == [e.seq for e in want] == [o + 3, o + 4]
        # A filtered reader is told where it starts (nothing published yet: this life's 0th).
        assert (position.event, int(position.id)) == ("stream.position", o)
        assert position.json() == {"type": "stream.position", "last_id": o}
        assert frames[0].json()["bytes"] == 7 and frames[0].json()["type"] == "stage.arrived"
        assert frames[1].json()["handoff_id"] == "b"


async def test_a_dropped_reader_resumes_with_last_event_id_missing_and_repeating_nothing(
    http: httpx.AsyncClient,
) -> None:
    async with decode_service() as server:
        bus = bus_of(server)
        url = f"{server.url}/v1/events"
        seen: list[int] = []
        async with aconnect_sse(http, "GET", url) as source:
            publish_many(bus, 10)
            seen += [int(f.id) for f in await read(source, 4)]
        # The connection is gone mid-run; more happens before the reader is back.
        publish_many(bus, 10)
        async with aconnect_sse(http, "GET", url, headers={"Last-Event-ID": str(seen[-1])}) as s:
            publish_many(bus, 5)
            seen += [int(f.id) for f in await read(s, 25 - len(seen))]
        assert seen == list(range(bus.first_seq, bus.first_seq + 25))


async def test_a_resume_older_than_the_buffer_is_announced_as_a_gap(
    http: httpx.AsyncClient,
) -> None:
    async with decode_service({"handoff.sse_buffer": 8}) as server:
        publish_many(bus_of(server), 20)  # the buffer keeps 13..20 (of this life)
        o = bus_of(server).first_seq - 1
        url = f"{server.url}/v1/events?last_event_id={o + 2}"
        async with aconnect_sse(http, "GET", url) as source:
            frames = await read(source, 9)
        assert frames[0].event == "stream.gap"
        assert frames[0].json() == {
            "type": "stream.gap",
            "first_id": o + 3,
            "last_id": o + 12,
            "reason": "expired",
            "resumed_from": o + 2,
        }
        assert int(frames[0].id) == o + 12
        assert [int(f.id) for f in frames[1:]] == list(range(o + 13, o + 21))
        assert stats_of(server).gaps_total == 1


async def test_an_id_from_before_a_restart_is_announced_and_the_new_ids_follow(
    http: httpx.AsyncClient,
) -> None:
    """Ids grow across lives: one below this life's first is an earlier life's (and one above
    any this life gave, a life whose clock ran ahead); either way the gap says so, and this
    life's events follow, none of them an earlier life's."""
    async with decode_service() as server:
        bus = bus_of(server)
        publish_many(bus, 3)
        o = bus.first_seq - 1
        for earlier in (1000, bus.last_seq + 10**6):
            headers = {"Last-Event-ID": str(earlier)}
            async with aconnect_sse(http, "GET", f"{server.url}/v1/events", headers=headers) as s:
                frames = await read(s, 4)
            assert frames[0].event == "stream.gap"
            assert frames[0].json() == {
                "type": "stream.gap",
                "first_id": o + 1,
                "last_id": o,  # none of this life's is gone yet
                "reason": "restarted",
                "resumed_from": earlier,
            }
            assert [int(f.id) for f in frames[1:]] == [o + 1, o + 2, o + 3]


class FastReader:
    """Reads one stream as fast as frames come, and lets the test wait until it has an id."""

    def __init__(self, source: Any) -> None:
        self.ids: list[int] = []
        self._caught_up = asyncio.Condition()
        self._task = asyncio.create_task(self._read(source))

    async def _read(self, source: Any) -> None:
        async for sse in source.aiter_sse():
            self.ids.append(int(sse.id))
            async with self._caught_up:
                self._caught_up.notify_all()

    async def wait_for(self, seq: int) -> None:
        async with self._caught_up, asyncio.timeout(WAIT_S):
            await self._caught_up.wait_for(lambda: bool(self.ids) and self.ids[-1] >= seq)

    async def stop(self) -> None:
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task


async def publish_until_dropped(
    bus: EventBus, stats: StreamStats, fast: FastReader, n: int
) -> None:
    """Publish big events, `n` at a time and each round only once the fast reader has it, until
    the bus drops a reader that reads nothing (its socket buffers full, then its queue)."""
    for _ in range(5000):
        await fast.wait_for(publish_many(bus, n, pad=8192)[-1])
        if stats.dropped_total:
            return


async def test_a_slow_reader_is_dropped_with_overflow_while_a_fast_one_sees_everything(
    http: httpx.AsyncClient,
) -> None:
    queue = 16
    async with decode_service({"handoff.sse_queue": queue, "handoff.sse_buffer": 64}) as server:
        bus, stats = bus_of(server), stats_of(server)
        url = f"{server.url}/v1/events"
        async with (
            aconnect_sse(http, "GET", url) as fast_source,
            httpx.AsyncClient(timeout=httpx.Timeout(WAIT_S)) as slow_http,
            aconnect_sse(slow_http, "GET", url) as slow_source,
        ):
            fast = FastReader(fast_source)
            await publish_until_dropped(bus, stats, fast, queue // 2)
            assert stats.dropped_total == 1
            for _ in range(4):  # the fast reader is unaffected afterwards
                await fast.wait_for(publish_many(bus, queue // 2)[-1])
            slow = [sse async for sse in slow_source.aiter_sse()]  # ends: it was disconnected
            await fast.stop()
        assert fast.ids == list(range(bus.first_seq, bus.last_seq + 1))
        assert slow[-1].event == "stream.overflow"
        delivered = [int(f.id) for f in slow[:-1]]
        assert delivered == list(range(bus.first_seq, bus.first_seq + len(delivered)))
        assert slow[-1].json() == {
            "type": "stream.overflow",
            "last_id": delivered[-1],
            "queue": queue,
        }
        assert stats.subscribers == 1


async def test_a_reader_that_stopped_reading_is_cut_off(http: httpx.AsyncClient) -> None:
    settings = {"handoff.sse_queue": 16, "handoff.sse_keepalive_s": 0.05}
    async with decode_service(settings) as server:
        bus, stats = bus_of(server), stats_of(server)
        url = f"{server.url}/v1/events"
        async with (
            aconnect_sse(http, "GET", url) as fast_source,
            httpx.AsyncClient(timeout=httpx.Timeout(WAIT_S)) as stuck_http,
            aconnect_sse(stuck_http, "GET", url),
        ):
            fast = FastReader(fast_source)
            await publish_until_dropped(bus, stats, fast, 8)
            # Its handler waits on a full socket; after four keep-alive periods it gives up
            # and closes the connection instead of waiting for ever.
            async with asyncio.timeout(WAIT_S):
                while stats.subscribers != 1:
                    await asyncio.sleep(0.01)
            await fast.wait_for(publish_many(bus, 1)[-1])  # the other reader still reads
            await fast.stop()
        assert stats.dropped_total == 1


async def test_keep_alive_comments_flow_while_nothing_happens() -> None:
    async with (
        decode_service({"handoff.sse_keepalive_s": 0.05}) as server,
        httpx.AsyncClient(timeout=httpx.Timeout(WAIT_S)) as http,
        http.stream("GET", f"{server.url}/v1/events") as response,
    ):
        lines: list[str] = []
        async with asyncio.timeout(WAIT_S):
            async for line in response.aiter_lines():
                lines.append(line)
                if lines.count(": keep-alive") == 2:
                    break
        assert lines[0] == ": kvhandoff event stream"


async def test_bad_filters_and_ids_are_refused_naming_the_field(
    http: httpx.AsyncClient,
) -> None:
    async with decode_service() as server:
        for query, headers, field in [
            ("types=handoff.finished", {}, "types"),
            ("handoff=a/b", {}, "handoff"),
            ("last_event_id=x", {}, "last_event_id"),
            ("", {"Last-Event-ID": "-1"}, "Last-Event-ID"),
            # Issue 18 B: Unicode digits passed isdigit() and then int() raised (a 500).
            ("last_event_id=%C2%B2", {}, "last_event_id"),
            ("last_event_id=%E2%91%A0", {}, "last_event_id"),
            ("", {"Last-Event-ID": "\u00b2".encode()}, "Last-Event-ID"),
        ]:
            reply = await http.get(f"{server.url}/v1/events?{query}", headers=headers)
            assert reply.status_code == 422, (query, reply.text)
            assert reply.headers["content-type"] == "application/problem+json"
            assert reply.json()["field"] == field
        reply = await http.get(f"{server.url}/v1/handoffs/nope/events")
        assert reply.status_code == 404
        assert stats_of(server).opened_total == 0


async def test_cors_allows_configured_origins_only(http: httpx.AsyncClient) -> None:
    async with decode_service({"server.cors_origins": ["http://dash.example"]}) as server:
        url = f"{server.url}/v1/events"
        for origin, allowed in [("http://dash.example", True), ("http://other.example", False)]:
            async with http.stream("GET", url, headers={"Origin": origin}) as response:
                got = response.headers.get("access-control-allow-origin")
                assert got == (origin if allowed else None)


async def test_shutdown_closes_open_streams(http: httpx.AsyncClient) -> None:
    async with decode_service() as server:
        stats = stats_of(server)
        opened = await http.send(http.build_request("GET", f"{server.url}/v1/events"), stream=True)
        assert stats.subscribers == 1
    # `serve` returned: the open stream did not hold shutdown for its 5 s timeout.
    assert stats.subscribers == 0
    await opened.aclose()


# ------------------------------------------------------------------ one handoff's stream, for real


@pytest.fixture
async def d() -> AsyncIterator[Deployment]:
    async with open_deployment() as deployment:
        fill_sources(deployment)
        yield deployment


async def test_one_handoffs_stream_runs_from_its_first_event_to_its_release(
    d: Deployment, http: httpx.AsyncClient
) -> None:
    assert (await d.create("h1", MOVE.dst_pages, MOVE.dst_slot)).status == 201
    url = f"{d.decode.url}/v1/handoffs/h1/events"
    async with aconnect_sse(http, "GET", url) as source:
        await ready_all(d, "h1")
        async with asyncio.timeout(WAIT_S):
            frames = [sse async for sse in source.aiter_sse()]  # ends by itself
    tags = [f.event for f in frames]
    assert tags[0] == "handoff.created" and tags[-2:] == ["handoff.completed", "handoff.released"]
    assert tags.count("stage.arrived") == 2
    ids = [int(f.id) for f in frames]
    assert ids == sorted(ids) and len(set(ids)) == len(ids)
    assert all(json.loads(f.data)["handoff_id"] == "h1" for f in frames)
    # Read again later: the whole stored timeline, then the end; with its last id: 204.
    async with aconnect_sse(http, "GET", url) as source:
        again = [int(sse.id) async for sse in source.aiter_sse()]
    assert again == ids
    reply = await http.get(url, headers={"Last-Event-ID": str(ids[-1])})
    assert reply.status_code == 204


def test_a_frame_is_encoded_once_and_the_cache_is_bounded() -> None:
    frames = Frames(2)
    bus = EventBus()
    events = [bus.publish(created(f"h{i}")) for i in range(3)]
    first = frames(events[0])
    assert first.startswith(b"id: 1\nevent: handoff.created\ndata: {") and first.endswith(b"\n\n")
    assert frames(events[0]) is first  # the same bytes object: not encoded again
    frames(events[1])
    frames(events[2])  # evicts the oldest
    assert frames(events[0]) is not first and frames(events[0]) == first


#: Where the SSE loop a reader copies is printed (it was the README's before the docs site).
EVENTS_PAGE = Path(__file__).resolve().parents[4] / "docs" / "operations" / "events.md"


def docs_block(marker: str) -> str:
    """The events page's ```python block that contains `marker`, as printed."""
    for block in re.findall(r"```python\n(.*?)```", EVENTS_PAGE.read_text(), flags=re.S):
        if marker in block:
            return str(block)
    raise AssertionError(f"no python block with {marker!r} in {EVENTS_PAGE}")


async def test_the_readme_sse_loop_runs_through_keep_alives_as_printed() -> None:
    """Issue 18 C: httpx-sse 0.4 keeps the last id across messages, so a keep-alive comment
    followed by a blank line read as an empty message and the README's `sse.json()` raised
    JSONDecodeError at the first keep-alive. The snippet (now on docs/operations/events.md)
    runs here exactly as printed (wrapped in a coroutine, with its `decode` and a `print` that
    records), across several keep-alives between events."""
    snippet = docs_block("aconnect_sse")
    printed: list[tuple[Any, ...]] = []
    async with decode_service({"handoff.sse_keepalive_s": 0.02}) as server:
        bus, stats = bus_of(server), stats_of(server)
        scope: dict[str, Any] = {"decode": server.url, "print": lambda *a: printed.append(a)}
        body = "".join(f"    {line}\n" if line else "\n" for line in snippet.splitlines())
        exec(f"async def readme_loop():\n{body}", scope)
        task = asyncio.create_task(scope["readme_loop"]())
        try:
            async with asyncio.timeout(WAIT_S):
                while stats.subscribers == 0:
                    await asyncio.sleep(0.005)
            first = bus.publish(created("a")).seq
            await asyncio.sleep(0.1)  # five keep-alive periods with nothing else to read
            assert not task.done(), task.exception()
            second = bus.publish(created("b")).seq
            async with asyncio.timeout(WAIT_S):
                while len(printed) < 2 and not task.done():
                    await asyncio.sleep(0.005)
            assert not task.done(), task.exception()
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
    assert printed == [(str(first), "handoff.created", "a"), (str(second), "handoff.created", "b")]


async def test_a_filtered_reader_is_neither_woken_nor_dropped_by_events_it_does_not_carry(
    http: httpx.AsyncClient,
) -> None:
    # A router's outcome stream: far more events than its queue pass while it reads nothing.
    async with decode_service({"handoff.sse_queue": 4}) as server:
        bus, stats = bus_of(server), stats_of(server)
        url = f"{server.url}/v1/events?types=handoff.completed"
        async with aconnect_sse(http, "GET", url) as source:
            async with asyncio.timeout(WAIT_S):
                while stats.subscribers < 1:
                    await asyncio.sleep(0.01)
            [sub] = stats.open
            publish_many(bus, 64)
            assert sub.queue.empty() and not sub.lagged
            done = HandoffCompleted(
                handoff_id="h", role="decode", bytes=7, seconds=0.1, verified=True
            )
            seq = bus.publish(done).seq
            position, frame = await read(source, 2)
        assert (frame.event, int(frame.id), frame.json()["bytes"]) == ("handoff.completed", seq, 7)
        assert (position.event, int(position.id)) == ("stream.position", bus.first_seq - 1)
        assert stats.dropped_total == 0


# ------------------------------------------------------------------ a filtered reader's position

OUTCOMES = "handoff.completed,handoff.failed,handoff.aborted"


async def take(frames: AsyncIterator[ServerSentEvent], n: int) -> list[ServerSentEvent]:
    """The next `n` frames of one stream read across several calls, or fail after WAIT_S."""
    async with asyncio.timeout(WAIT_S):
        return [await anext(frames) for _ in range(n)]


def completed(handoff_id: str) -> HandoffCompleted:
    return HandoffCompleted(
        handoff_id=handoff_id, role="decode", bytes=7, seconds=0.1, verified=True
    )


async def test_a_filtered_reader_resumes_from_its_position_after_a_buffer_of_other_events(
    http: httpx.AsyncClient,
) -> None:
    """Review finding 8: a reader of outcomes resumed from its last outcome's id, which more
    than a replay buffer of other events had pushed out: `stream.gap` although it lost nothing.
    Its position now moves with the events it skips, and a resume from it has no gap."""
    async with decode_service({"handoff.sse_buffer": 64}) as server:
        bus, stats = bus_of(server), stats_of(server)
        url = f"{server.url}/v1/events?types={OUTCOMES}"
        async with aconnect_sse(http, "GET", url) as source:
            frames = source.aiter_sse()
            [opened] = await take(frames, 1)
            first = bus.publish(completed("a")).seq
            publish_many(bus, 200)  # three buffers of events this reader does not carry
            outcome, position = await take(frames, 2)
        assert (outcome.event, int(outcome.id)) == ("handoff.completed", first)
        # Every 16th skipped event (a quarter of the buffer) is a marker; the 12 queued at once
        # make one frame, at the last marker: what follows it is still buffered.
        assert (position.event, int(position.id)) == ("stream.position", first + 192)
        assert position.json() == {"type": "stream.position", "last_id": first + 192}
        later = bus.publish(completed("b")).seq
        headers = {"Last-Event-ID": position.id}
        async with aconnect_sse(http, "GET", url, headers=headers) as source:
            [frame] = await read(source, 1)
        assert (frame.event, int(frame.id)) == ("handoff.completed", later)
        assert stats.gaps_total == 0
        assert int(opened.id) == bus.first_seq - 1


async def test_position_frames_are_bounded_by_the_events_a_reader_skips(
    http: httpx.AsyncClient,
) -> None:
    """One frame per quarter of the buffer of skipped events at most, even when the events
    come one loop turn apart (the stream is woken by each marker, not by each event); a
    reader of everything gets no position at all."""
    every, skipped = 16, 16 * 20
    async with decode_service({"handoff.sse_buffer": 4 * every}) as server:
        bus = bus_of(server)
        filtered, everything = f"{server.url}/v1/events?handoff=z", f"{server.url}/v1/events"
        async with (
            aconnect_sse(http, "GET", filtered) as source,
            aconnect_sse(http, "GET", everything) as all_source,
        ):
            frames = source.aiter_sse()
            [opened] = await take(frames, 1)
            for _ in range(skipped):
                publish_many(bus, 1)
                await asyncio.sleep(0)
            o = int(opened.id)
            positions = await take(frames, 1)
            while int(positions[-1].id) < o + skipped:
                positions += await take(frames, 1)
            last = bus.publish(created("z")).seq
            [mine] = await take(frames, 1)
            frames = await read(all_source, skipped + 1)
        assert {p.event for p in positions} == {"stream.position"}
        # One per marker, or fewer where the stream was slower than the markers came.
        assert len(positions) <= skipped // every
        assert all((int(p.id) - o) % every == 0 for p in positions)
        assert int(positions[-1].id) == o + skipped
        assert (mine.event, int(mine.id)) == ("handoff.created", last)  # no position between
        assert [f.event for f in frames] == ["handoff.created"] * (skipped + 1)
        assert [int(f.id) for f in frames] == list(range(o + 1, last + 1))


async def test_a_quiet_filtered_stream_tells_its_position_instead_of_a_keep_alive() -> None:
    """Fewer skipped events than a marker takes: the next keep-alive period sends the position
    (the reader's queue drained, so every event it carries up to the bus's last was sent);
    nothing new since: plain keep-alive comments."""
    async with (
        decode_service({"handoff.sse_keepalive_s": 0.02}) as server,
        httpx.AsyncClient(timeout=httpx.Timeout(WAIT_S)) as http,
        http.stream("GET", f"{server.url}/v1/events?types=handoff.completed") as response,
    ):
        bus = bus_of(server)
        o = bus.first_seq - 1
        lines: list[str] = []
        last = None  # the last of the events published once the stream is open
        async with asyncio.timeout(WAIT_S):
            async for line in response.aiter_lines():
                lines.append(line)
                if line == f"id: {o}":  # the position at open: now some events pass it by
                    last = publish_many(bus, 5)[-1]
                if f"id: {last}" in lines[:-1] and line == ": keep-alive":
                    break  # a keep-alive after the position: nothing new since
        ids = [line for line in lines if line.startswith("id: ")]
        assert ids == [f"id: {o}", f"id: {last}"]
        at = lines.index(f"id: {last}")
        assert lines[at + 1 : at + 3] == [
            "event: stream.position",
            f'data: {{"type":"stream.position","last_id":{last}}}',
        ]
