"""The one table of peer calls: every message two kvhandoff services exchange, with its path,
what it carries and answers, which way it travels, and whether it travels in batches.

The HTTP client (`service.peers.protocol.HttpPeers`), the routes that receive the calls
(`service.api.peer`) and the in-process link (`pipelines.inprocess.InProcessLink`) are driven by
it: paths and wire types come from here, and `tests/unit/pipelines/test_peer_calls.py` fails
when an entry lacks its sender (a method named `name` on the client, the in-process link and
the sender's peer protocol) or its receiver (a route of that method and path taking `body` and
answering `reply`), or when a peer route has no entry.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import GenericAlias
from typing import Any, Literal

from pipelines.messages import (
    AbortAck,
    AbortMsg,
    ArrivalMsg,
    DestinationMsg,
    HeartbeatAck,
    HeartbeatMsg,
    LayoutInfo,
    Outcome,
    SegmentMsg,
    SegmentOutcome,
    StageFailedMsg,
    WindowAnswer,
    WindowRequest,
)

#: Who sends a call to whom (`either`: both roles send it and both serve it).
Direction = Literal["decode->prefill", "prefill->decode", "either"]


@dataclass(frozen=True, slots=True)
class PeerCall:
    """One peer call. `request`/`answer` are the types of one message and of its answer; a
    batched call carries a list of messages and answers a list, one answer per message, in
    order (`body`, `reply`). `in_process`: the in-process link carries it too (heartbeats and
    the watch are between separate services only)."""

    name: str  # the method that sends it (client, in-process link, the sender's peer protocol)
    method: Literal["GET", "POST"]
    path: str
    request: Any  # None: no body
    answer: Any  # None: no JSON answer (a stream)
    direction: Direction
    batched: bool = False
    in_process: bool = True

    @property
    def body(self) -> Any:
        """The wire type of the request body."""
        return GenericAlias(list, (self.request,)) if self.batched else self.request

    @property
    def reply(self) -> Any:
        """The wire type of the answer body."""
        return GenericAlias(list, (self.answer,)) if self.batched else self.answer


LAYOUT = PeerCall("layout", "GET", "/v1/layout", None, LayoutInfo, "decode->prefill")
DESTINATIONS = PeerCall(
    "deliver", "POST", "/v1/peer/destinations", DestinationMsg, Outcome, "decode->prefill", True
)
ABORTS = PeerCall("abort", "POST", "/v1/peer/aborts", AbortMsg, AbortAck, "decode->prefill")
ARRIVALS = PeerCall(
    "arrived", "POST", "/v1/peer/arrivals", ArrivalMsg, Outcome, "prefill->decode", True
)
STAGE_FAILURES = PeerCall(
    "stage_failed",
    "POST",
    "/v1/peer/stage-failures",
    StageFailedMsg,
    Outcome,
    "prefill->decode",
    True,
)
WINDOWS = PeerCall(
    "window", "POST", "/v1/peer/windows", WindowRequest, WindowAnswer, "prefill->decode"
)
SEGMENTS = PeerCall(
    "segment", "POST", "/v1/peer/segments", SegmentMsg, SegmentOutcome, "prefill->decode", True
)
HEARTBEATS = PeerCall(
    "heartbeat",
    "POST",
    "/v1/peer/heartbeats",
    HeartbeatMsg,
    HeartbeatAck,
    "either",
    in_process=False,
)
WATCH = PeerCall("watch", "GET", "/v1/peer/watch", None, None, "either", in_process=False)

PEER_CALLS: tuple[PeerCall, ...] = (
    LAYOUT,
    DESTINATIONS,
    ABORTS,
    ARRIVALS,
    STAGE_FAILURES,
    WINDOWS,
    SEGMENTS,
    HEARTBEATS,
    WATCH,
)
