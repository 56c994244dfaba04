"""The live event stream over Server-Sent Events: `GET /v1/events` and
`GET /v1/handoffs/{id}/events` (installed on both roles by `install_events`).

Each frame is `id: <bus seq>`, `event: <stable tag>`, `data: <the event as JSON>`. A reader
resumes with `Last-Event-ID` (header, or `?last_event_id=` where a client cannot set headers)
from the bus's bounded replay buffer; ids it can no longer get are announced with a
`stream.gap` frame, never skipped silently (`kvhandoff.service.observability.streams`). Every
stream has its own bounded queue on the bus, of the events it carries: the bus never waits for
a reader, and a reader that falls `handoff.sse_queue` of them behind gets a final
`stream.overflow` frame and is disconnected (and counted), so a slow reader costs neither the
pipeline nor the other readers anything.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Collection
from typing import get_args

from aiohttp import web

from kvhandoff.pipelines.decode.views import HANDOFF_ID_PATTERN
from kvhandoff.pipelines.errors import InvalidInput
from kvhandoff.pipelines.events import (
    Event,
    HandoffReleased,
    Subscription,
    event_encoder,
    event_tag,
)
from kvhandoff.service.http.app import CONFIG, ROUTES
from kvhandoff.service.http.egress import EGRESS
from kvhandoff.service.http.routing import RouteTable
from kvhandoff.service.observability.streams import (
    STREAMS,
    StreamGap,
    StreamOverflow,
    StreamStats,
    stream_encoder,
)
from kvhandoff.service.runtime.roles import DECODE, RUNTIME

_ID = re.compile(HANDOFF_ID_PATTERN)
#: Every tag a `?types=` prefix may select (a prefix that selects none is a typo: 422).
EVENT_TAGS = tuple(t.__struct_config__.tag for t in get_args(Event))
#: Frames written in one `write()` when a reader is behind (fewer syscalls, same order).
BATCH = 256

routes = RouteTable()


def install_events(app: web.Application) -> None:
    """Serve the SSE routes over the role's event bus (an `Extension`)."""
    app[STREAMS] = StreamStats()
    app[_FRAMES] = Frames(app[CONFIG].handoff.sse_buffer)
    app.on_shutdown.append(_close_streams)
    app[ROUTES].include(routes)


async def _close_streams(app: web.Application) -> None:
    # Open streams never end by themselves: cancel them so shutdown need not wait for them.
    for task in list(app[STREAMS].open.values()):
        if task is not None:
            task.cancel()


class Filter:
    """Which events a stream carries: any of `handoffs` (all when empty) and any tag starting
    with one of `types` (all when empty)."""

    def __init__(self, handoffs: Collection[str] = (), types: Collection[str] = ()) -> None:
        self.handoffs = frozenset(handoffs)
        self.types = tuple(types)

    def __call__(self, event: Event) -> bool:
        if self.handoffs and event.handoff_id not in self.handoffs:
            return False
        return not self.types or event_tag(event).startswith(self.types)


def parse_filter(request: web.Request) -> Filter:
    handoffs = request.query.getall("handoff", [])
    for value in handoffs:
        if not _ID.match(value):
            raise InvalidInput(f"handoff={value!r} is not a valid handoff id", field="handoff")
    types = [t for raw in request.query.getall("types", []) for t in raw.split(",") if t]
    for prefix in types:
        if not any(tag.startswith(prefix) for tag in EVENT_TAGS):
            raise InvalidInput(
                f"types={prefix!r} selects no event; tags are {', '.join(EVENT_TAGS)}",
                field="types",
            )
    return Filter(handoffs, types)


def last_event_id(request: web.Request) -> int | None:
    raw = request.headers.get("Last-Event-ID")
    field = "Last-Event-ID"
    if raw is None:
        raw, field = request.query.get("last_event_id"), "last_event_id"
    if raw is None or raw == "":
        return None
    # ASCII digits only: `isdigit()` also takes "²" and "①", which int() refuses (a 500).
    if not (raw.isascii() and raw.isdigit()) or len(raw) > 18:
        raise InvalidInput(f"{field}={raw!r} is not an event id (an integer ≥ 0)", field=field)
    return int(raw)


def frame(event: Event) -> bytes:
    return b"id: %d\nevent: %s\ndata: %s\n\n" % (
        event.seq,
        event_tag(event).encode(),
        event_encoder.encode(event),
    )


class Frames:
    """Each event's frame, encoded once however many streams send it; keeps the last `size`
    (the replay buffer's worth), so a resume replays from here too."""

    def __init__(self, size: int) -> None:
        self._size = size
        self._frames: dict[int, bytes] = {}  # by seq, oldest first

    def __call__(self, event: Event) -> bytes:
        data = self._frames.get(event.seq)
        if data is None:
            data = self._frames[event.seq] = frame(event)
            if len(self._frames) > self._size:
                del self._frames[next(iter(self._frames))]
        return data


_FRAMES = web.AppKey("sse_frames", Frames)


def control_frame(event: StreamGap | StreamOverflow, event_id: int) -> bytes:
    tag = type(event).__struct_config__.tag
    return b"id: %d\nevent: %s\ndata: %s\n\n" % (
        event_id,
        str(tag).encode(),
        stream_encoder.encode(event),
    )


#: A comment line alone, no blank line after it: a blank line ends a message, and a client that
#: keeps the last id across messages (httpx-sse 0.4, as the SSE spec says) would dispatch it as
#: an empty message, which `sse.json()` cannot parse. The next frame's blank line ends nothing
#: but that frame.
KEEPALIVE = b": keep-alive\n"


#: A write that the reader does not take within this many keep-alive periods ends the stream.
STUCK_KEEPALIVES = 4


class _Stream:
    """One open SSE response: writes frames, tracks the last id written."""

    def __init__(
        self, request: web.Request, response: web.StreamResponse, last_id: int, keepalive_s: float
    ) -> None:
        self.frames = request.app[_FRAMES]
        self.request = request
        self.response = response
        self.last_id = last_id
        self.keepalive_s = keepalive_s

    async def write(self, data: bytes) -> None:
        """Write, or close the connection of a reader that stopped reading altogether (its
        handler would otherwise wait on the socket for ever)."""
        await self.request.app[EGRESS].before()  # the events these frames tell of are on disk first
        try:
            async with asyncio.timeout(self.keepalive_s * STUCK_KEEPALIVES):
                await self.response.write(data)
        except TimeoutError:
            self.response.force_close()
            if self.request.transport is not None:
                self.request.transport.close()
            raise ConnectionResetError("SSE reader stopped reading") from None

    async def send(self, events: list[Event]) -> None:
        data = [self.frames(e) for e in events if e.seq > self.last_id]
        if data:
            await self.write(b"".join(data))
            self.last_id = max(self.last_id, events[-1].seq)


async def _open(request: web.Request) -> web.StreamResponse:
    response = web.StreamResponse(
        headers={
            "Content-Type": "text/event-stream; charset=utf-8",
            "Cache-Control": "no-cache, no-transform",
            "X-Accel-Buffering": "no",  # nginx and the like: pass each frame on at once
            "Connection": "keep-alive",
        }
    )
    origin = request.headers.get("Origin")
    allowed = request.app[CONFIG].server.cors_origins
    if origin is not None and ("*" in allowed or origin in allowed):
        response.headers["Access-Control-Allow-Origin"] = "*" if "*" in allowed else origin
        response.headers["Vary"] = "Origin"
    response.enable_chunked_encoding()
    await response.prepare(request)
    await response.write(b": kvhandoff event stream\n")  # headers out now, not on event 1
    return response


def _replay(
    request: web.Request, last_id: int, keep: Filter
) -> tuple[list[Event], StreamGap | None]:
    """What a reader resuming after `last_id` is owed from the replay buffer, and the gap."""
    bus = request.app[RUNTIME].bus
    # An id from an earlier process: below this life's first (ids grow across lives), or above
    # any this one gave (the clock stepped back across a restart). What that process sent
    # after it is lost; this life's events follow, all of them new to the reader.
    if 0 < last_id < bus.first_seq - 1 or last_id > bus.last_seq:
        events, _ = bus.since(0)
        first = events[0].seq if events else bus.last_seq + 1
        restart = StreamGap(
            first_id=bus.first_seq, last_id=first - 1, reason="restarted", resumed_from=last_id
        )
        return [e for e in events if keep(e)], restart
    events, complete = bus.since(last_id)
    gap: StreamGap | None = None
    if not complete:
        first = events[0].seq if events else bus.last_seq + 1
        gap = StreamGap(
            first_id=last_id + 1, last_id=first - 1, reason="expired", resumed_from=last_id
        )
    return [e for e in events if keep(e)], gap


@routes.get(
    "/v1/events",
    content_type="text/event-stream",
    errors=(422,),
    summary="Live event stream (Server-Sent Events) of this service's handoffs",
    description="Frames: `id:` bus sequence number, `event:` the event's tag, `data:` the event "
    "as JSON. Query: `handoff` (repeatable) and `types` (comma-separated tag prefixes, e.g. "
    "`stage.`). Resume with the `Last-Event-ID` header or `?last_event_id=`; ids no longer in "
    "the replay buffer are announced by a `stream.gap` frame. A reader that falls behind gets "
    "`stream.overflow` and is disconnected. Keep-alive comments every `handoff.sse_keepalive_s`.",
    tags=("events",),
)
async def events_stream(request: web.Request) -> web.StreamResponse:
    keep = parse_filter(request)
    resume = last_event_id(request)
    return await _serve(request, keep, resume)


@routes.get(
    "/v1/handoffs/{id}/events",
    content_type="text/event-stream",
    errors=(404, 422),
    summary="One handoff's events (Server-Sent Events), from its first; ends after its last",
    description="On the decode service the handoff must exist (404 otherwise); its stored "
    "timeline is sent first, and the stream ends after `handoff.released` (which follows the "
    "outcome: `handoff.completed`, `.failed` or `.aborted`). On a prefill service the stream "
    "waits for the handoff's events. "
    "204 (no stream) when the handoff has ended and `Last-Event-ID` is at or past its last "
    "event, which stops a browser `EventSource` from reconnecting.",
    tags=("events",),
)
async def handoff_stream(request: web.Request) -> web.StreamResponse:
    handoff_id = request.match_info["id"]
    if not _ID.match(handoff_id):
        raise InvalidInput(f"{handoff_id!r} is not a valid handoff id", field="id")
    resume = last_event_id(request)
    return await _serve(request, Filter([handoff_id]), resume, handoff_id=handoff_id)


async def _serve(
    request: web.Request, keep: Filter, resume: int | None, *, handoff_id: str | None = None
) -> web.StreamResponse:
    runtime = request.app[RUNTIME]
    bus = runtime.bus
    config = request.app[CONFIG].handoff
    stats = request.app[STREAMS]
    # Subscribe before reading any backlog: an event published in between is in both, and
    # `_Stream.send` drops the repeat by id.
    if handoff_id is not None and resume is not None and resume > bus.last_seq:
        resume = None  # an earlier life's id, above this life's: replay the whole timeline
    sub = bus.subscribe(maxsize=config.sse_queue, keep=None if handoff_id else keep)
    task = asyncio.current_task()
    try:
        backlog: list[Event] = []
        gap: StreamGap | None = None
        ended = False  # the handoff's last event is already in its timeline
        if handoff_id is not None:
            decode = request.app.get(DECODE)
            if decode is not None:
                # Raises NotFoundError (404) before any header is sent.
                view = decode.pipeline.get(handoff_id)
                timeline = view.timeline
                # An earlier life's handoff, answered from its record, may have no release event
                # in its timeline: its view says whether it is released.
                ended = view.released and view.state.terminal
            else:
                timeline, gap = _replay(request, 0, keep)
            ended = ended or any(isinstance(e, HandoffReleased) for e in timeline)
            backlog = [e for e in timeline if resume is None or e.seq > resume]
            if not backlog and ended:
                # Ended, and the reader has it all: 204 stops an EventSource reconnecting.
                return web.Response(status=204)
        elif resume is not None:
            backlog, gap = _replay(request, resume, keep)
        # Counted before the response starts, so a reader that has the headers is counted.
        stats.opened(sub, task)
        try:
            response = await _open(request)
        except BaseException:
            stats.closed(sub)
            raise
        try:
            stream = _Stream(request, response, resume or 0, config.sse_keepalive_s)
            if gap is not None:
                stats.gaps_total += 1
                await stream.write(control_frame(gap, gap.last_id))
                if gap.reason == "restarted":
                    stream.last_id = 0  # an earlier life's id: all this life's are new
            await stream.send(backlog)
            if handoff_id is not None and ended:
                return response
            await _live(sub, stream, keep, config.sse_keepalive_s, handoff_id)
        except ConnectionResetError:  # the reader left (aiohttp's reset error subclasses it)
            pass
        finally:
            stats.closed(sub)
        return response
    finally:
        sub.close()


async def _live(
    sub: Subscription,
    stream: _Stream,
    keep: Filter,
    keepalive_s: float,
    handoff_id: str | None,
) -> None:
    queue = sub.queue
    while True:
        if sub.lagged:
            overflow = StreamOverflow(last_id=stream.last_id, queue=queue.maxsize)
            await stream.write(control_frame(overflow, stream.last_id))
            return
        if queue.empty():
            try:
                async with asyncio.timeout(keepalive_s):
                    first = await queue.get()
            except TimeoutError:
                await stream.write(KEEPALIVE)
                continue
            batch = [first]
        else:
            batch = []
        while len(batch) < BATCH and not queue.empty():
            batch.append(queue.get_nowait())
        events = [e for e in batch if keep(e)]
        await stream.send(events)
        # A handoff's last event is its release (after its outcome); judged before the type
        # filter, so a reader of `handoff.completed` alone still sees the stream end (its
        # subscription is not filtered on the bus for this reason, as the whole stream's is).
        if handoff_id is not None and any(
            isinstance(e, HandoffReleased) and e.handoff_id == handoff_id for e in batch
        ):
            return
