"""Who is reading the event stream: SSE subscriber counts and drops, and the stream-only events.

`kvhandoff.service.api.events` (the SSE routes) updates one `StreamStats` per app;
`kvhandoff.service.observability.metrics` reads it at scrape time. `StreamGap`,
`StreamOverflow` and `StreamPosition` are what the SSE stream says about itself. They are not
part of the event union in `kvhandoff.pipelines.events` on purpose: they describe one
connection, not a handoff, are never published on the bus, and so never reach webhooks,
metrics or a handoff's timeline.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

import msgspec
from aiohttp import web
from msgspec import Struct

from kvhandoff.pipelines.events import Subscription


@dataclass
class StreamStats:
    opened_total: int = 0
    gaps_total: int = 0  # resumes that asked for events no longer in the replay buffer
    closed_dropped: int = 0  # streams that ended dropped
    #: The open streams' bus subscriptions, and their handlers (cancelled on shutdown).
    open: dict[Subscription, asyncio.Task[Any] | None] = field(default_factory=dict)

    @property
    def subscribers(self) -> int:
        return len(self.open)

    @property
    def dropped_total(self) -> int:
        """Readers the bus dropped for falling behind: counted the moment the bus drops them,
        though a reader that is stuck only receives its `stream.overflow` once it reads again."""
        return self.closed_dropped + sum(1 for sub in self.open if sub.lagged)

    def opened(self, sub: Subscription, task: asyncio.Task[Any] | None) -> None:
        self.open[sub] = task
        self.opened_total += 1

    def closed(self, sub: Subscription) -> None:
        self.open.pop(sub, None)
        if sub.lagged:
            self.closed_dropped += 1


STREAMS = web.AppKey("sse_stream_stats", StreamStats)


class StreamGap(Struct, frozen=True, kw_only=True, tag="stream.gap"):
    """Events `first_id`..`last_id` of this stream are gone from the replay buffer (none when
    `last_id < first_id`). `reason` is "expired" (the reader resumed too late) or "restarted"
    (its Last-Event-ID, `resumed_from`, is an earlier life's: below this life's first id, or
    above any id this process issued, as after a restart on a clock that stepped back; what the
    old process sent after it is lost, and this life's events follow)."""

    first_id: int
    last_id: int
    reason: str
    resumed_from: int


class StreamOverflow(Struct, frozen=True, kw_only=True, tag="stream.overflow"):
    """The reader fell `queue` events behind and is disconnected; resume from `last_id`."""

    last_id: int
    queue: int


class StreamPosition(Struct, frozen=True, kw_only=True, tag="stream.position"):
    """A filtered stream has sent every event it carries up to `last_id` (also the frame's
    `id:`, so a reader's Last-Event-ID advances past the events it does not carry and stays
    inside the replay buffer). A resume point, never an event of a handoff."""

    last_id: int


stream_encoder = msgspec.json.Encoder()
