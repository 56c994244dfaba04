"""The live event stream over Server-Sent Events: `GET /v1/events` and
`GET /v1/handoffs/{id}/events` (installed on both roles by `install_events`).

Each frame is `id: <bus seq>`, `event: <stable tag>`, `data: <the event as JSON>`. A reader
resumes with `Last-Event-ID` (header, or `?last_event_id=` where a client cannot set headers)
from the bus's bounded replay buffer; ids it can no longer get are announced with a
`stream.gap` frame, never skipped silently (`kvhandoff.service.observability.streams`). Every
stream has its own bounded queue on the bus, of the events it carries: the bus never waits for
a reader, and a reader that falls `handoff.sse_queue` of them behind gets a final
`stream.overflow` frame and is disconnected (and counted), so a slow reader costs neither the
pipeline nor the other readers anything. A filtered reader (`types` or `handoff`) is also told
its position (`stream.position`) at open, once a quarter of the replay buffer has passed
without an event it carries, and instead of a keep-alive when events passed since its last
frame, so its Last-Event-ID stays resumable however rare its events are.
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
    StreamPosition,
    StreamStats,
    stream_encoder,
)
from kvhandoff.service.runtime.roles import DECODE, RUNTIME

_ID = re.compile(HANDOFF_ID_PATTERN)
#: Every tag a `?types=` prefix may select (a prefix that selects none is a typo: 422).
EVENT_TAGS = tuple(t.__struct_config__.tag for t in get_args(Event))
#: Frames written in one `write()` when a reader is behind (fewer syscalls, same order).
BATCH = 256
#: A filtered reader hears its position once this share of the replay buffer has passed without
#: an event it carries: a resume from it has the other (1 - 1/share) of the buffer to come back.
POSITION_SHARE = 4

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

    @property
    def everything(self) -> bool:
        return not self.handoffs and not self.types

    def __call__(self, event: Event) -> bool:
        if self.handoffs and event.handoff_id not in self.handoffs:
            return False
        return not self.types or event_tag(event).startswith(self.types)


class Marking:
    """A filtered stream's filter on the bus: the events `keep` carries, and as a marker the
    `every`-th event in a row that it skips. A marker wakes the stream to send its position
    (never the marker itself), so a reader of rare events is told it has passed the others
    without being woken for each: one queue slot and one frame per `every` skipped events."""

    def __init__(self, keep: Filter, every: int) -> None:
        self.keep, self.every = keep, every
        self.skipped = 0  # events skipped in a row since the last one taken

    def __call__(self, event: Event) -> bool:
        if self.keep(event):
            self.skipped = 0
            return True
        self.skipped += 1
        if self.skipped < self.every:
            return False
        self.skipped = 0
        return True


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


def control_frame(event: StreamGap | StreamOverflow | StreamPosition, event_id: int) -> bytes:
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
    """One open SSE response: writes frames, tracks the last id written; `positions` when it
    tells its reader its position (a filtered `/v1/events`)."""

    def __init__(
        self,
        request: web.Request,
        response: web.StreamResponse,
        last_id: int,
        keepalive_s: float,
        positions: bool,
    ) -> None:
        self.frames = request.app[_FRAMES]
        self.request = request
        self.response = response
        self.last_id = last_id
        self.keepalive_s = keepalive_s
        self.positions = positions

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

    async def send(self, events: list[Event], upto: int = 0) -> None:
        """Write `events` (those past the last id); then, if this stream tells positions and
        `upto` is past them, a `stream.position` at `upto`. The caller vouches that every
        event this stream carries up to `upto` is in `events` or already written."""
        data = [self.frames(e) for e in events if e.seq > self.last_id]
        last_id = max(self.last_id, events[-1].seq) if data else self.last_id
        if self.positions and upto > last_id:
            data.append(control_frame(StreamPosition(last_id=upto), upto))
            last_id = upto
        if data:
            await self.write(b"".join(data))
            self.last_id = last_id


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
    "`stream.overflow` and is disconnected. Keep-alive comments every `handoff.sse_keepalive_s`. "
    "A filtered reader (`handoff` or `types`) also gets `stream.position` frames (`id:` and "
    "`last_id`: every event it carries up to there was sent), to resume from: at open, after "
    "each quarter of `handoff.sse_buffer` events in a row that it does not carry, and instead "
    "of a keep-alive when events passed since its last frame.",
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


def _bus_filter(keep: Filter, handoff_id: str | None, every: int) -> Marking | None:
    """What the stream's subscription takes from the bus: everything for one handoff's stream
    (it ends on that handoff's release, whatever the type filter) and for an unfiltered one;
    a filtered one's events, and its markers."""
    if handoff_id is not None or keep.everything:
        return None
    return Marking(keep, every)


def _timeline(
    request: web.Request, handoff_id: str, resume: int | None, keep: Filter
) -> tuple[list[Event], StreamGap | None, bool]:
    """One handoff's events owed to a reader resuming after `resume`, the gap, and whether its
    last event (its release) is among them."""
    gap: StreamGap | None = None
    ended = False
    decode = request.app.get(DECODE)
    if decode is not None:
        # Raises NotFoundError (404) before any header is sent.
        view = decode.pipeline.get(handoff_id)
        timeline = view.timeline
        # An earlier life's handoff, answered from its record, may have no release event in
        # its timeline: its view says whether it is released.
        ended = view.released and view.state.terminal
    else:
        timeline, gap = _replay(request, 0, keep)
    ended = ended or any(isinstance(e, HandoffReleased) for e in timeline)
    return [e for e in timeline if resume is None or e.seq > resume], gap, ended


async def _serve(
    request: web.Request, keep: Filter, resume: int | None, *, handoff_id: str | None = None
) -> web.StreamResponse:
    bus = request.app[RUNTIME].bus
    config = request.app[CONFIG].handoff
    stats = request.app[STREAMS]
    # Subscribe before reading any backlog: an event published in between is in both, and
    # `_Stream.send` drops the repeat by id.
    if handoff_id is not None and resume is not None and resume > bus.last_seq:
        resume = None  # an earlier life's id, above this life's: replay the whole timeline
    every = max(1, config.sse_buffer // POSITION_SHARE)
    sub = bus.subscribe(maxsize=config.sse_queue, keep=_bus_filter(keep, handoff_id, every))
    # No await until the backlog is read: every event this stream carries up to here is in it.
    opened_at = bus.last_seq
    try:
        backlog: list[Event] = []
        gap: StreamGap | None = None
        ended = False  # the handoff's last event is already in its timeline
        if handoff_id is not None:
            backlog, gap, ended = _timeline(request, handoff_id, resume, keep)
            if not backlog and ended:
                # Ended, and the reader has it all: 204 stops an EventSource reconnecting.
                return web.Response(status=204)
        elif resume is not None:
            backlog, gap = _replay(request, resume, keep)
        # Counted before the response starts, so a reader that has the headers is counted.
        stats.opened(sub, asyncio.current_task())
        try:
            response = await _open(request)
        except BaseException:
            stats.closed(sub)
            raise
        positions = handoff_id is None and not keep.everything
        stream = _Stream(request, response, resume or 0, config.sse_keepalive_s, positions)
        try:
            if gap is not None:
                stats.gaps_total += 1
                await stream.write(control_frame(gap, gap.last_id))
                if gap.reason == "restarted":
                    stream.last_id = 0  # an earlier life's id: all this life's are new
            await stream.send(backlog, opened_at)
            if handoff_id is not None and ended:
                return response
            await _live(sub, stream, keep, handoff_id)
        except ConnectionResetError:  # the reader left (aiohttp's reset error subclasses it)
            pass
        finally:
            stats.closed(sub)
        return response
    finally:
        sub.close()


async def _live(sub: Subscription, stream: _Stream, keep: Filter, handoff_id: str | None) -> None:
    queue = sub.queue
    bus = stream.request.app[RUNTIME].bus
    while True:
        if sub.lagged:
            overflow = StreamOverflow(last_id=stream.last_id, queue=queue.maxsize)
            await stream.write(control_frame(overflow, stream.last_id))
            return
        if queue.empty():
            try:
                async with asyncio.timeout(stream.keepalive_s):
                    first = await queue.get()
            except TimeoutError:
                await _keep_alive(stream, queue.empty(), bus.last_seq)
                continue
            batch = [first]
        else:
            batch = []
        while len(batch) < BATCH and not queue.empty():
            batch.append(queue.get_nowait())
        # A filtered stream's queue holds its events and its markers (`Marking`), in bus order:
        # every event it carries up to the last of the batch is in the batch or written.
        await stream.send([e for e in batch if keep(e)], batch[-1].seq)
        # A handoff's last event is its release (after its outcome); judged before the type
        # filter, so a reader of `handoff.completed` alone still sees the stream end (its
        # subscription is not filtered on the bus for this reason, as the whole stream's is).
        if handoff_id is not None and any(
            isinstance(e, HandoffReleased) and e.handoff_id == handoff_id for e in batch
        ):
            return


async def _keep_alive(stream: _Stream, drained: bool, last_seq: int) -> None:
    """A quiet period's frame: the reader's position if events it does not carry passed since
    its last frame (with its queue drained, all it carries up to the bus's last is written),
    a keep-alive comment otherwise."""
    if stream.positions and drained and last_seq > stream.last_id:
        await stream.send([], last_seq)
    else:
        await stream.write(KEEPALIVE)
