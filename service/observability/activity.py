"""Recent activity for the dashboard: the last handoffs, throughput and latency over minutes, and
the landed transfer's memory in use.

`Activity` is an event-bus listener (`EventBus.add_listener`) that keeps, bounded in count and
age, what the dashboard page (`kvhandoff.service.api.dashboard`) shows on load: the most recent
handoffs with per-stage progress, completions per time bucket, and latency percentiles. The page
then applies the live SSE events to the same model, so this snapshot and the stream agree.
"""

from __future__ import annotations

import time
from collections import OrderedDict, deque
from collections.abc import Callable, Collection
from typing import Any

from msgspec import Struct

from kvhandoff.pipelines.decode.views import HandoffView
from kvhandoff.pipelines.events import (
    ChunksEmitted,
    Event,
    HandoffAborted,
    HandoffCompleted,
    HandoffCreated,
    HandoffFailed,
    SegmentCommitted,
    StageArrived,
    StageReady,
    StageTransferred,
)
from kvhandoff.pipelines.states import StageState

#: Handoffs kept for the page; older ones are in `GET /v1/handoffs`.
RECENT = 200
#: Width of one throughput bucket, and how far back the chart and percentiles look.
BUCKET_S = 5.0
WINDOW_S = 300.0


class StageProgress(Struct):
    pp_rank: int
    bytes: int = 0  # moved so far: sent (prefill), committed or arrived (decode)
    layers: int = 0  # layers sent so far (prefill side)
    done: bool = False  # arrived (decode) or sent its last layer (prefill)
    failed: bool = False
    segments: int = 0  # landed segments committed so far (decode, landed mode)
    expected: int = 0  # bytes the stage moves in all, once a segment said so; 0: not known


class HandoffActivity(Struct):
    id: str
    #: pending, transferring, completed, failed, aborted; on a prefill service also "sent": its
    #: stages here are done (the decode service decides the outcome).
    state: str
    started_at: float
    updated_at: float = 0.0  # the last event's time
    pp_size: int = 0
    bytes: int = 0
    finished_at: float | None = None
    seconds: float | None = None
    code: str | None = None
    reason: str | None = None
    pp_rank: int | None = None  # the failing stage
    stages: list[StageProgress] = []
    #: Read from the records at start-up (an earlier life's, or one this life did not see).
    recorded: bool = False


class Bucket(Struct, frozen=True):
    at: float  # bucket start, unix seconds
    bytes: int
    handoffs: int


class Latency(Struct, frozen=True):
    count: int
    p50_s: float | None
    p90_s: float | None
    p99_s: float | None


class Activity:
    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        self._clock = clock
        self.handoffs: OrderedDict[str, HandoffActivity] = OrderedDict()
        self._done: deque[tuple[float, int, float]] = deque()  # (at, bytes, seconds)
        self._moved: deque[tuple[float, int]] = deque()  # (at, bytes): stage bytes sent/arrived

    def observe(self, event: Event) -> None:
        h = self._handoff(event)
        match event:
            case HandoffCreated():
                h.pp_size = event.pp_size
            case StageReady() | ChunksEmitted():
                h.state = "transferring"
                self._stage(h, event.pp_rank)
            case StageTransferred():
                h.state = "transferring"
                s = self._stage(h, event.pp_rank)
                s.bytes += event.bytes
                s.layers += 1
                s.done = s.done or event.final
                h.bytes += event.bytes
                self._add(self._moved, (event.at, event.bytes))
            case SegmentCommitted():
                h.state = "transferring"
                s = self._stage(h, event.pp_rank)
                s.segments += 1
                s.bytes, s.expected = event.committed, event.expected
                h.bytes = sum(x.bytes for x in h.stages)
            case StageArrived():
                h.state = "transferring"
                s = self._stage(h, event.pp_rank)
                s.bytes, s.done = event.bytes, True
                h.bytes = sum(x.bytes for x in h.stages)
                h.pp_size = max(h.pp_size, event.expected)
                self._add(self._moved, (event.at, event.bytes))
            case HandoffCompleted():
                self._finish(h, "completed", event.at)
                h.seconds, h.bytes = event.seconds, event.bytes
                self._add(self._done, (event.at, event.bytes, event.seconds))
            case HandoffFailed():
                self._finish(h, "failed", event.at)
                h.code, h.reason, h.pp_rank = event.code, event.reason, event.pp_rank
                if event.pp_rank is not None:
                    self._stage(h, event.pp_rank).failed = True
            case HandoffAborted():
                self._finish(h, "aborted", event.at)
                h.reason = event.reason
            case _:
                pass

    def _handoff(self, event: Event) -> HandoffActivity:
        h = self.handoffs.get(event.handoff_id)
        if h is None:
            h = self.handoffs[event.handoff_id] = HandoffActivity(
                id=event.handoff_id, state="pending", started_at=event.at
            )
            while len(self.handoffs) > RECENT:
                self.handoffs.popitem(last=False)
        h.updated_at = event.at
        return h

    def seed(self, views: list[HandoffView]) -> None:
        """Show `views` (finished handoffs from the records, oldest first) before anything this
        life observed, so a restarted decode's page keeps the failure being investigated."""
        seeded: OrderedDict[str, HandoffActivity] = OrderedDict(
            (v.id, _recorded(v)) for v in views[-RECENT:] if v.id not in self.handoffs
        )
        seeded.update(self.handoffs)
        while len(seeded) > RECENT:
            seeded.popitem(last=False)
        self.handoffs = seeded

    def settle(self, live: Collection[str]) -> None:
        """Mark "sent" what a prefill pipeline no longer runs (`live`: the ids it does): it
        publishes no terminal event for a handoff whose stages all arrived."""
        for h in self.handoffs.values():
            if h.finished_at is None and h.id not in live and h.state == "transferring":
                self._finish(h, "sent", h.updated_at)
                for s in h.stages:
                    s.done = not s.failed

    @staticmethod
    def _stage(h: HandoffActivity, rank: int) -> StageProgress:
        for s in h.stages:
            if s.pp_rank == rank:
                return s
        s = StageProgress(rank)
        h.stages = sorted([*h.stages, s], key=lambda x: x.pp_rank)
        return s

    @staticmethod
    def _finish(h: HandoffActivity, state: str, at: float) -> None:
        h.state, h.finished_at = state, at
        h.seconds = at - h.started_at

    def _add(self, q: deque[Any], item: tuple[Any, ...]) -> None:
        """Append to a windowed queue, dropping what fell out of the window (only a queue that
        grows needs trimming: readers trim to their own now)."""
        q.append(item)
        self._trim(item[0])

    def _trim(self, now: float) -> None:
        for q in (self._done, self._moved):
            while q and q[0][0] < now - WINDOW_S:
                q.popleft()

    def buckets(self) -> list[Bucket]:
        """Bytes moved and handoffs completed per `BUCKET_S` over the last `WINDOW_S`."""
        now = self._clock()
        self._trim(now)
        first = (now - WINDOW_S) // BUCKET_S * BUCKET_S
        n = int(WINDOW_S // BUCKET_S) + 1
        moved, done = [0] * n, [0] * n
        for at, size in self._moved:
            moved[min(max(int((at - first) // BUCKET_S), 0), n - 1)] += size
        for at, _, _ in self._done:
            done[min(max(int((at - first) // BUCKET_S), 0), n - 1)] += 1
        return [Bucket(first + i * BUCKET_S, moved[i], done[i]) for i in range(n)]

    def latency(self) -> Latency:
        self._trim(self._clock())
        seconds = sorted(s for _, _, s in self._done)
        if not seconds:
            return Latency(0, None, None, None)

        def pick(q: float) -> float:
            return seconds[min(int(q * len(seconds)), len(seconds) - 1)]

        return Latency(len(seconds), pick(0.5), pick(0.9), pick(0.99))


def _recorded(v: HandoffView) -> HandoffActivity:
    """A finished handoff's record as the page shows one it watched."""
    finished, error = v.finished_at, v.error
    return HandoffActivity(
        id=v.id,
        state=v.state.value,
        started_at=v.created_at,
        updated_at=finished or v.created_at,
        pp_size=len(v.stages),
        bytes=v.bytes,
        finished_at=finished,
        seconds=None if finished is None else finished - v.created_at,
        code=None if error is None else error.code,
        reason=None if error is None else error.reason,
        pp_rank=None if error is None else error.pp_rank,
        stages=[
            StageProgress(
                s.pp_rank,
                s.bytes,
                done=s.state == StageState.ARRIVED,
                failed=s.state == StageState.FAILED,
            )
            for s in v.stages
        ],
        recorded=True,
    )
