"""The peer protocol over HTTP: `decode.PrefillPeer` and `prefill.DecodePeer` as REST calls.

Each call's path and wire types come from the one table of peer calls
(`kvhandoff.pipelines.peer_calls`); `kvhandoff.service.api.peer` serves them. Errors a
peer answers with come back as the same classes (`PeerClient`), so a pipeline cannot tell an
HTTP peer from an in-process one (`kvhandoff.pipelines.inprocess`).
"""

from __future__ import annotations

from collections.abc import Callable

import aiohttp
import msgspec

from kvhandoff.pipelines.errors import KVHandoffError
from kvhandoff.pipelines.messages import (
    AbortAck,
    AbortMsg,
    ArrivalMsg,
    DestinationMsg,
    HeartbeatAck,
    HeartbeatMsg,
    LayoutInfo,
    Outcome,
    SegmentAck,
    SegmentMsg,
    SegmentOutcome,
    StageFailedMsg,
    WindowAnswer,
    WindowRequest,
)
from kvhandoff.pipelines.peer_calls import (
    ABORTS,
    ARRIVALS,
    DESTINATIONS,
    HEARTBEATS,
    LAYOUT,
    SEGMENTS,
    STAGE_FAILURES,
    WATCH,
    WINDOWS,
    PeerCall,
)
from kvhandoff.service.http.peer_client import PeerClient
from kvhandoff.service.http.problems import PeerError, encode_problem, error_from_problem
from kvhandoff.service.peers.coalesce import Coalescer, SendBatch

#: A segment notice of at most this many bytes travels in a batch with the others queued for
#: its decode (one request for many one-page handoffs); a larger one's commit takes long
#: enough (a scatter out of its window and a digest of the pages: in a thread) that it goes
#: alone, so small notices do not queue behind it.
COALESCED_SEGMENT_BYTES = 256 * 1024


class HttpPeers:
    """Both directions of the peer protocol over one `PeerClient`."""

    def __init__(
        self, client: PeerClient, *, abort_timeout_s: float = 30.0, watch_idle_s: float = 3.0
    ) -> None:
        self._client = client
        # An abort answers only once the peer's in-flight writes drained: allow a transfer's time.
        self._abort_timeout_s = abort_timeout_s
        self._watch_idle_s = watch_idle_s
        # Watches hold one idle connection per live peer: their own session, so they never take
        # the pool slots of the calls that move handoffs along.
        self._watch_session: aiohttp.ClientSession | None = None
        # Destinations, arrivals and failures are coalesced per peer (see
        # kvhandoff.service.peers.coalesce).
        self._destinations = Coalescer(self._batch_sender(DESTINATIONS))
        self._arrivals = Coalescer(self._batch_sender(ARRIVALS))
        self._failures = Coalescer(self._batch_sender(STAGE_FAILURES))
        self._segments = Coalescer(self._send_segments)

    def _batch_sender(self, call: PeerCall) -> SendBatch:
        path = call.path

        async def send(peer: str, notices: list[msgspec.Raw]) -> list[KVHandoffError | None]:
            outcomes: list[Outcome] = await self._client.post(
                peer, path, _joined(notices), call.reply
            )
            if len(outcomes) != len(notices):
                raise PeerError(
                    f"{peer}{path} answered {len(outcomes)} outcomes for {len(notices)} notices",
                    peer=peer,
                )
            return [
                None
                if o.problem is None
                else error_from_problem(o.status, encode_problem(o.problem), peer=peer)
                for o in outcomes
            ]

        return send

    async def _send_segments(
        self, peer: str, notices: list[msgspec.Raw]
    ) -> list[SegmentAck | KVHandoffError]:
        # A commit copies a segment out of its window and digests it: allow a transfer's time.
        outcomes: list[SegmentOutcome] = await self._client.post(
            peer, SEGMENTS.path, _joined(notices), SEGMENTS.reply, timeout_s=self._abort_timeout_s
        )
        if len(outcomes) != len(notices):
            raise PeerError(
                f"{peer}{SEGMENTS.path} answered {len(outcomes)} outcomes for {len(notices)} "
                "segments",
                peer=peer,
            )
        results: list[SegmentAck | KVHandoffError] = []
        for o in outcomes:
            if o.ack is not None:
                results.append(o.ack)
            else:
                problem = o.problem or {"detail": f"status {o.status} without an ack"}
                results.append(error_from_problem(o.status, encode_problem(problem), peer=peer))
        return results

    async def close(self) -> None:
        for coalescer in (self._destinations, self._arrivals, self._failures, self._segments):
            await coalescer.close()
        if self._watch_session is not None:
            await self._watch_session.close()

    # decode -> prefill
    async def layout(self, url: str) -> LayoutInfo:
        return await self._client.get(url, LAYOUT.path, LayoutInfo)

    async def deliver(self, url: str, msg: DestinationMsg) -> None:
        await self._destinations.submit(url, msg)

    async def abort(self, url: str, msg: AbortMsg) -> AbortAck:
        return await self._client.post(
            url, ABORTS.path, msg, AbortAck, timeout_s=self._abort_timeout_s
        )

    # prefill -> decode
    async def arrived(self, decode_url: str, msg: ArrivalMsg) -> None:
        await self._arrivals.submit(decode_url, msg)

    async def stage_failed(self, decode_url: str, msg: StageFailedMsg) -> None:
        await self._failures.submit(decode_url, msg)

    async def window(self, decode_url: str, msg: WindowRequest) -> WindowAnswer:
        return await self._client.post(decode_url, WINDOWS.path, msg, WindowAnswer)

    async def segment(self, decode_url: str, msg: SegmentMsg) -> SegmentAck:
        if msg.bytes <= COALESCED_SEGMENT_BYTES:
            ack: SegmentAck = await self._segments.submit(decode_url, msg)
            return ack
        [result] = await self._send_segments(decode_url, [msgspec.Raw(_encode(msg))])
        if isinstance(result, KVHandoffError):
            raise result
        return result

    # either direction
    async def watch(self, url: str, opened: Callable[[], None] | None = None) -> None:
        """Hold the watch path open until the peer ends it (see `kvhandoff.service.peers.watch`);
        `opened()` is called once the peer accepted the stream."""
        if self._watch_session is None:
            self._watch_session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
        await self._client.hold(
            self._watch_session, url, WATCH.path, idle_timeout_s=self._watch_idle_s, opened=opened
        )

    async def heartbeat(self, url: str, msg: HeartbeatMsg, timeout_s: float) -> HeartbeatAck:
        return await self._client.post(url, HEARTBEATS.path, msg, HeartbeatAck, timeout_s=timeout_s)


_encode = msgspec.json.Encoder().encode


def _joined(notices: list[msgspec.Raw]) -> bytes:
    """The JSON array of notices already encoded, without encoding them again."""
    return b"[" + b",".join(bytes(n) for n in notices) + b"]"
