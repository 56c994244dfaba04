"""The one event union, and the bus that numbers and fans it out.

Every observable step of a handoff is one of these frozen Structs. The same values feed the logs,
the API timeline of a handoff, the SSE stream (`seq` is the SSE id), webhooks and metrics, so their
tags are stable dotted strings that clients may switch on. Published by the prefill and decode
pipelines; consumed by the service through `EventBus.subscribe` and `EventBus.since`.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from typing import Any

import msgspec
from msgspec import Struct

#: Bump when an event's fields change incompatibly; carried in SSE and webhook payloads.
EVENT_SCHEMA_VERSION = 1


class _Event(Struct, frozen=True, kw_only=True, tag_field="type", omit_defaults=True):
    handoff_id: str
    role: str  # "prefill" or "decode": which side emitted it
    at: float = 0.0  # unix seconds, set by the bus
    seq: int = 0  # bus-wide sequence number, set by the bus (the SSE event id)


class HandoffCreated(_Event, frozen=True, tag="handoff.created"):
    num_pages: int
    pp_size: int
    metadata: dict[str, Any] = {}


class StageReady(_Event, frozen=True, tag="stage.ready"):
    pp_rank: int
    num_pages: int
    layers: list[int] | None = None  # None: every layer of the stage
    # A page-range signal: `num_pages` pages from this request position are ready for every
    # layer (None: a layer signal); `last_pages` it is the last range.
    pages_from: int | None = None
    last_pages: bool | None = None


class DestinationReceived(_Event, frozen=True, tag="stage.destination"):
    """Prefill: a decode service said where stages `pp_ranks` of this handoff go. `fan_out`:
    how many decode handoffs take the same bytes from these stages (an engine keeps its source
    pages until every one has them)."""

    pp_ranks: list[int]
    decode_url: str
    num_pages: int
    prefix_pages: int = 0
    fan_out: int = 1


class ChunksEmitted(_Event, frozen=True, tag="stage.chunks_emitted"):
    pp_rank: int
    kv_layers: list[int]
    state_layers: list[int]


class StagePaired(_Event, frozen=True, tag="stage.paired"):
    pp_rank: int
    kv_pairs: int
    state_pairs: int
    blocks: int
    bytes: int


class StageTransferred(_Event, frozen=True, tag="stage.transferred"):
    pp_rank: int
    blocks: int
    bytes: int
    batches: int
    seconds: float
    final: bool  # True once every layer of the stage has been sent


class StageArrived(_Event, frozen=True, tag="stage.arrived"):
    pp_rank: int
    bytes: int
    arrived: int  # stages arrived so far
    expected: int


class HandoffCompleted(_Event, frozen=True, tag="handoff.completed"):
    bytes: int
    seconds: float
    verified: bool
    metadata: dict[str, Any] = {}


class HandoffFailed(_Event, frozen=True, tag="handoff.failed"):
    code: str
    reason: str
    pp_rank: int | None = None
    context: dict[str, Any] = {}
    metadata: dict[str, Any] = {}


class HandoffAborted(_Event, frozen=True, tag="handoff.aborted"):
    reason: str
    metadata: dict[str, Any] = {}


class HandoffReleased(_Event, frozen=True, tag="handoff.released"):
    """The destination pages and slot are free: no write of this handoff can land any more.
    Follows every terminal event; an engine reuses the pages only after this."""

    outcome: str  # the terminal state it follows
    # True: every writer confirmed it stopped; False: the proven bound (deadline plus the
    # longest engine call the prefill declared) passed without a confirmation.
    confirmed: bool
    seconds_after_outcome: float
    metadata: dict[str, Any] = {}


class SegmentCommitted(_Event, frozen=True, tag="stage.segment_committed"):
    """Decode: one landed segment of a stage matched its digest and is now in the handoff's
    pages and slot (landed mode)."""

    pp_rank: int
    bytes: int
    committed: int  # bytes of the stage committed so far
    expected: int  # bytes the stage moves in all
    commit_s: float  # the scatter out of the window and the digest of the pages written


class SegmentRejected(_Event, frozen=True, tag="stage.segment_rejected"):
    """Decode: a landed segment did not hash to its digest (a stale or corrupted write into its
    window); nothing of it was committed. It is sent again once, or the handoff fails."""

    pp_rank: int
    bytes: int
    layers: str  # the layer range the segment held
    resend: bool


Event = (
    HandoffCreated
    | StageReady
    | DestinationReceived
    | ChunksEmitted
    | StagePaired
    | StageTransferred
    | StageArrived
    | HandoffCompleted
    | HandoffFailed
    | HandoffAborted
    | HandoffReleased
    | SegmentCommitted
    | SegmentRejected
)
TERMINAL_EVENTS = (HandoffCompleted, HandoffFailed, HandoffAborted)

event_encoder = msgspec.json.Encoder()
event_decoder: msgspec.json.Decoder[Event] = msgspec.json.Decoder(Event)


def event_tag(event: Event) -> str:
    return type(event).__struct_config__.tag  # type: ignore[return-value]


class Subscription:
    """A bounded queue of events for one consumer. A consumer that falls `maxsize` events behind
    is marked `lagged` and dropped from the bus rather than slowing every producer; an SSE client
    then reconnects with Last-Event-ID and resumes from the replay buffer."""

    def __init__(
        self, bus: EventBus, maxsize: int, keep: Callable[[Event], bool] | None = None
    ) -> None:
        self._bus = bus
        self.queue: asyncio.Queue[Event] = asyncio.Queue(maxsize)
        self.keep = keep
        self.lagged = False

    def __aiter__(self) -> AsyncIterator[Event]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[Event]:
        while not (self.lagged and self.queue.empty()):
            yield await self.queue.get()

    def close(self) -> None:
        self._bus.unsubscribe(self)


#: Events a bus keeps for resuming readers, by default (`handoff.sse_buffer` takes it).
REPLAY = 4096


def life_first_seq(clock: Callable[[], float] = time.time) -> int:
    """Where one service life's event numbers start: its start time in microseconds since the
    epoch (below 2**53, so JavaScript readers keep them exact). A life that publishes fewer
    events than the microseconds it lives leaves the next life's numbers above its own, so an
    SSE id or a stored event's `seq` names one event across restarts (as long as the wall clock
    does not step back across the restart)."""
    return int(clock() * 1_000_000)


class EventBus:
    """Numbers events, keeps the last `replay` of them, and fans them out to subscribers."""

    def __init__(
        self, replay: int = REPLAY, clock: Callable[[], float] = time.time, *, first_seq: int = 1
    ) -> None:
        # Numbers start at `first_seq` (see `life_first_seq`), so they never repeat an earlier
        # life's: stored timelines and resuming readers carry those.
        self._seq = first_seq - 1
        self._first = first_seq
        self._replay: deque[Event] = deque(maxlen=replay)
        self._subscribers: set[Subscription] = set()
        self._listeners: list[Callable[[Event], None]] = []
        self._clock = clock

    @property
    def last_seq(self) -> int:
        return self._seq

    @property
    def first_seq(self) -> int:
        """The first number this bus gives: anything below is an earlier life's."""
        return self._first

    def publish(self, event: Event) -> Event:
        """Stamp `seq` and `at`, remember, fan out. Never blocks; returns the stamped event."""
        self._seq += 1
        stamped = msgspec.structs.replace(event, seq=self._seq, at=self._clock())
        self._replay.append(stamped)
        for listener in self._listeners:
            listener(stamped)
        for sub in list(self._subscribers):
            if sub.keep is not None and not sub.keep(stamped):
                continue
            try:
                sub.queue.put_nowait(stamped)
            except asyncio.QueueFull:
                sub.lagged = True
                self._subscribers.discard(sub)
        return stamped

    def add_listener(self, listener: Callable[[Event], None]) -> None:
        """A synchronous callback for every event (logs, metrics, the webhook outbox)."""
        self._listeners.append(listener)

    def subscribe(
        self, maxsize: int = 1024, keep: Callable[[Event], bool] | None = None
    ) -> Subscription:
        """A queue of the events `keep` accepts (all without it): a reader of a few kinds of
        event is neither woken for the others nor counted behind by them."""
        sub = Subscription(self, maxsize, keep)
        self._subscribers.add(sub)
        return sub

    def unsubscribe(self, sub: Subscription) -> None:
        self._subscribers.discard(sub)

    def since(self, seq: int) -> tuple[list[Event], bool]:
        """Events after `seq` still in the replay buffer, and whether none were lost."""
        events = [e for e in self._replay if e.seq > seq]
        complete = not self._replay or self._replay[0].seq <= seq + 1 or seq >= self._seq
        return events, complete
