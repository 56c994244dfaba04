"""One handoff as the decode side holds it: its stages, its states and bounds, and its view.

Built by `pipeline.py` (the lifecycle: create, arrivals, outcome) and read and changed by
`release.py` (the quiesce that stops its writers, the release of its lease). Plain data and
the view a router reads; every state change goes through `states.advance` — a stage's delivery
and writer states only through the `DecodeStage` methods below.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from kvhandoff.pipelines.decode.views import ErrorView, HandoffRequest, HandoffView, StageView
from kvhandoff.pipelines.events import Event, EventBus
from kvhandoff.pipelines.layout import StageLayout
from kvhandoff.pipelines.states import (
    DeliveryState,
    HandoffState,
    ReleaseState,
    StageState,
    WriterState,
    advance,
)

I64 = npt.NDArray[np.int64]
ROLE = "decode"


@dataclass
class DecodeStage:
    """One PP stage of a handoff, as its decode sees it."""

    peer: str
    incarnation: str  # the prefill life this stage is bound to (from its layout)
    layout: StageLayout
    max_call_s: float  # the longest engine call its prefill declared
    state: StageState = StageState.WAITING
    bytes: int = 0
    digests: dict[str, str] | None = None
    delivery: DeliveryState = DeliveryState.UNSENT
    writers: WriterState = WriterState.MAY_WRITE
    # The latest its prefill's own deadline can be, on this decode's monotonic clock: the
    # remaining duration the destination carried, counted from when the delivery call ended (the
    # prefill counts it from its receipt, which came no later). None: never sent.
    writable_until: float | None = None

    # The only code that changes `delivery`, `writers` and `writable_until` (SAFETY.md I4, I5),
    # each change through the transition table (`states.TRANSITIONS`).

    def sending(self, what: str) -> None:
        self.delivery = advance(self.delivery, DeliveryState.SENDING, what)

    def delivery_ended(self, *, accepted: bool, writable_until: float, what: str) -> None:
        """The delivery call ended: accepted, or failed / cancelled (it may have arrived)."""
        new = DeliveryState.DELIVERED if accepted else DeliveryState.UNCERTAIN
        self.delivery = advance(self.delivery, new, what)
        self.writable_until = writable_until

    def confirm_stopped(self, *, overtaking: bool, what: str) -> bool:
        """Its own prefill life said no write can land any more (`overtaking`: in an abort ack
        while the destination was on its way). True when that stops it now."""
        if self.writers == WriterState.STOPPED:
            return False
        was = self.writers
        new = WriterState.STOPPED_OVERTAKEN if overtaking else WriterState.STOPPED
        if was == WriterState.STOPPED_OVERTAKEN and overtaking:
            return False  # a second overtaking ack says no more than the first
        self.writers = advance(was, new, what)
        return was == WriterState.MAY_WRITE

    def doubt_overtaken(self, what: str) -> bool:
        """The delivery ended: an ack that overtook it says nothing of it. True when this
        stage must be asked again."""
        if self.writers != WriterState.STOPPED_OVERTAKEN:
            return False
        self.writers = advance(self.writers, WriterState.MAY_WRITE, what)
        return True

    @property
    def stopped(self) -> bool:
        """No write of this stage can land any more (or, overtaken, so said until the delivery
        ended): it arrived, reported its own failure, or its prefill acknowledged an abort (or
        no longer has the handoff)."""
        return self.writers.stopped

    @property
    def delivered(self) -> bool:
        return self.delivery == DeliveryState.DELIVERED


@dataclass
class DecodeHandoff:
    request: HandoffRequest
    seq: int
    dst_pages: I64
    created_at: float
    deadline_at: float  # unix seconds, for views and records
    verify: bool
    stages: dict[int, DecodeStage]
    # The same deadline on the monotonic clock: every bound is measured on it, so a step of the
    # wall clock (NTP) cannot shorten how long pages stay fenced.
    deadline_mono: float = 0.0
    # When it was created and got its outcome on the same clock: the durations events report
    # (latency metrics) must not jump with the wall clock either.
    created_mono: float = 0.0
    finished_mono: float | None = None
    state: HandoffState = HandoffState.PENDING
    release: ReleaseState = ReleaseState.HELD
    finished_at: float | None = None
    released_at: float | None = None
    verification: str | None = None
    error: ErrorView | None = None
    timeline: list[Event] = field(default_factory=list)
    timer: asyncio.TimerHandle | None = None
    delivery: asyncio.Task[None] | None = None  # sends the destinations; sets writable_until
    quiesce: asyncio.Task[None] | None = None  # the one task that stops writers and releases
    done: asyncio.Event = field(default_factory=asyncio.Event)  # the outcome is known
    released: asyncio.Event = field(default_factory=asyncio.Event)  # the pages are free
    progress: asyncio.Event = field(default_factory=asyncio.Event)  # a stage stopped / hurry up

    @classmethod
    def admitted(
        cls,
        req: HandoffRequest,
        seq: int,
        dst_pages: I64,
        stages: dict[int, DecodeStage],
        *,
        now: float,
        mono: float,
        deadline_s: float,
        verify: bool,
        host_readable: bool,
    ) -> DecodeHandoff:
        """A handoff just admitted at unix time `now` (monotonic `mono`), due in `deadline_s`."""
        return cls(
            request=req,
            seq=seq,
            dst_pages=dst_pages,
            created_at=now,
            deadline_at=now + deadline_s,
            deadline_mono=mono + deadline_s,
            created_mono=mono,
            verify=verify,
            stages=stages,
            verification=(
                "skipped: the decode pool is not host-readable"
                if verify and not host_readable
                else None
            ),
        )

    @property
    def id(self) -> str:
        return self.request.id

    @property
    def peers(self) -> list[str]:
        return sorted({s.peer for s in self.stages.values()})

    def view(self, *, timeline: bool = True) -> HandoffView:
        return HandoffView(
            id=self.id,
            state=self.state,
            created_at=self.created_at,
            deadline_at=self.deadline_at,
            num_pages=int(self.dst_pages.shape[0]),
            dst_slot=self.request.dst_slot,
            dst_slots=dict(self.request.dst_slots),
            dst_aux=self.request.dst_aux,
            prefix_pages=self.request.prefix_pages,
            prefill=list(self.request.prefill),
            verify=self.verify,
            bytes=sum(s.bytes for s in self.stages.values()),
            stages=[
                StageView(rank, s.peer, s.state, s.bytes) for rank, s in sorted(self.stages.items())
            ],
            released=self.release == ReleaseState.RELEASED,
            finished_at=self.finished_at,
            released_at=self.released_at,
            verification=self.verification,
            error=self.error,
            metadata=self.request.metadata,
            timeline=list(self.timeline) if timeline else [],
        )


def publish(bus: EventBus, h: DecodeHandoff, event: Event) -> None:
    """Publish `event` of `h` and keep it in its timeline (what its view and record show)."""
    h.timeline.append(bus.publish(event))
