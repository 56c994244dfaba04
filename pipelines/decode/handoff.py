"""One handoff as the decode side holds it: its stages, its states and bounds, and its view.

Built by `pipeline.py` (the lifecycle: create, arrivals, outcome) and read and changed by
`release.py` (the quiesce that stops its writers, the release of its lease). Plain data and
the view a router reads; every state change goes through `states.advance` in those two modules.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from pipelines.decode.views import ErrorView, HandoffRequest, HandoffView, StageView
from pipelines.events import Event, EventBus
from pipelines.layout import StageLayout
from pipelines.states import HandoffState, ReleaseState, StageState

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
    delivered: bool = False  # its prefill service accepted the destination
    # No write of this stage can land any more: it arrived, reported its own failure, or its
    # prefill acknowledged an abort (or no longer has the handoff).
    stopped: bool = False
    # Its prefill acknowledged an abort while a destination to it was still on its way: the
    # destination may have reached it after the ack (then it is live there again), so the
    # quiesce asks once more after the delivery ended before it trusts `stopped`.
    acked_before_delivery: bool = False
    # The latest its prefill's own deadline can be, on this decode's monotonic clock: the
    # remaining duration the destination carried, counted from when the delivery call ended (the
    # prefill counts it from its receipt, which came no later). None: never sent.
    writable_until: float | None = None


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
