"""The one table of peer calls: every message two kvhandoff services exchange, with its path,
what it carries and answers, which way it travels, whether it travels in batches and whether a
peer channel carries it.

The HTTP client (`kvhandoff.service.peers.protocol.HttpPeers`), the routes that receive the calls
(`kvhandoff.service.api.peer`), the peer channel's both ends (`kvhandoff.service.http.peer_channel`:
a channel carries a call by its path to the same handler as its route) and the in-process link
(`kvhandoff.pipelines.inprocess.InProcessLink`) are driven by it: paths and wire types come from
here, and `tests/unit/pipelines/test_peer_calls.py` fails when an entry lacks its sender (a method
named `name` on the client, the in-process link and the sender's peer protocol) or its receiver
(a route of that method and path taking `body` and answering `reply`; a channel handler for a
call the channel carries), or when a peer route has no entry.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import GenericAlias
from typing import Any, Literal

from kvhandoff.pipelines.messages import (
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
    the watch are between separate services only). `channel`: it travels on a peer channel
    once one is open to its recipient (`CHANNEL`), over HTTP otherwise."""

    name: str  # the method that sends it (client, in-process link, the sender's peer protocol)
    method: Literal["GET", "POST"]
    path: str
    request: Any  # None: no body
    answer: Any  # None: no JSON answer (a stream)
    direction: Direction
    batched: bool = False
    in_process: bool = True
    channel: bool = False

    @property
    def body(self) -> Any:
        """The wire type of the request body."""
        return GenericAlias(list, (self.request,)) if self.batched else self.request

    @property
    def reply(self) -> Any:
        """The wire type of the answer body."""
        return GenericAlias(list, (self.answer,)) if self.batched else self.answer


# The layout is what a sender learns a peer's life from, so it never waits for a channel.
LAYOUT = PeerCall("layout", "GET", "/v1/layout", None, LayoutInfo, "decode->prefill")
DESTINATIONS = PeerCall(
    "deliver",
    "POST",
    "/v1/peer/destinations",
    DestinationMsg,
    Outcome,
    "decode->prefill",
    batched=True,
    channel=True,
)
ABORTS = PeerCall(
    "abort", "POST", "/v1/peer/aborts", AbortMsg, AbortAck, "decode->prefill", channel=True
)
ARRIVALS = PeerCall(
    "arrived",
    "POST",
    "/v1/peer/arrivals",
    ArrivalMsg,
    Outcome,
    "prefill->decode",
    batched=True,
    channel=True,
)
STAGE_FAILURES = PeerCall(
    "stage_failed",
    "POST",
    "/v1/peer/stage-failures",
    StageFailedMsg,
    Outcome,
    "prefill->decode",
    batched=True,
    channel=True,
)
WINDOWS = PeerCall(
    "window",
    "POST",
    "/v1/peer/windows",
    WindowRequest,
    WindowAnswer,
    "prefill->decode",
    channel=True,
)
SEGMENTS = PeerCall(
    "segment",
    "POST",
    "/v1/peer/segments",
    SegmentMsg,
    SegmentOutcome,
    "prefill->decode",
    batched=True,
    channel=True,
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
# Heartbeats stay on HTTP: they prove a peer answers by a path of its own.
WATCH = PeerCall("watch", "GET", "/v1/peer/watch", None, None, "either", in_process=False)
#: The channel itself: its handshake is a signed GET, upgraded to a WebSocket
#: (`kvhandoff.service.http.peer_channel`). Opened by whichever end sends calls (`PeerClient`).
CHANNEL = PeerCall("channel", "GET", "/v1/peer/channel", None, None, "either", in_process=False)

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
    CHANNEL,
)

#: The paths of the calls a channel carries.
CHANNEL_PATHS = frozenset(c.path for c in PEER_CALLS if c.channel)
