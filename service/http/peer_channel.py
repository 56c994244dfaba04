"""Persistent peer channels: one WebSocket from a sender to one life of a peer, carrying the
peer calls that travel on it (`kvhandoff.pipelines.peer_calls`, `PeerCall.channel`) as framed
messages.

The sender (`PeerChannels`, used by `kvhandoff.service.http.peer_client.PeerClient`) opens it with
`GET /v1/peer/channel`, signed like every peer call (`kvhandoff.service.http.peer_signing`: bound to
the sender, the recipient's URL and its life), which the recipient's auth middleware verifies before
the route (`kvhandoff.service.api.peer`) accepts the upgrade. The recipient's first frame is its
hello: a fresh nonce of its own, signed as the answer to the handshake's nonce, so the sender knows
who answered and in which life before it sends a call. Both ends then derive the session key
(`peer_signing.channel_key`) from the handshake's secret, both nonces, both URLs and that life.

A frame is one binary WebSocket message: a MAC (32 bytes; absent when peer auth is off) and a
JSON payload. The MAC is HMAC-SHA256 under the session key over the frame's direction, its
sequence number and the payload; each direction counts its frames from 0 and a receiver takes
only the next one. So a frame cannot be replayed (in this session or another), reordered,
dropped, reflected back to its sender, moved to another recipient or to another life: a frame
that fails closes the channel, and every call waiting on it fails as `PeerUnreachable`.

A frame's payload is a JSON array of calls (sender to recipient) or of answers (back). A call
carries an id, its path and the body its HTTP route takes; an answer the id, the status and the
body the route answers. A call therefore means the same on both transports (`PeerClient` reads
both answers in one place). Each direction has one writer: what is queued while a frame is
being written leaves in the next one, so under load many calls (a coalesced batch of notices,
`kvhandoff.service.peers.coalesce`, is one call) or answers share a frame and a system call, and an
idle channel adds no wait. Many calls are in flight at once; each is served in its own task.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import logging
import secrets
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import aiohttp
import msgspec
from aiohttp import web
from yarl import URL

from kvhandoff.pipelines.errors import PeerUnreachable
from kvhandoff.pipelines.peer_calls import CHANNEL
from kvhandoff.pipelines.peercache import MAX_PEERS, PeerCache
from kvhandoff.pipelines.urls import canonical_url
from kvhandoff.service.http.peer_signing import (
    NONCE_HEADER,
    AnswerRejected,
    AnswerSigner,
    Signer,
    channel_key,
)
from kvhandoff.service.http.problems import PeerTimeout
from kvhandoff.service.tasks import TaskOwner

log = logging.getLogger("kvhandoff.channel")

_MAC_BYTES = 32
_TO_RECIPIENT = b"kvhandoff-channel-request"
_TO_SENDER = b"kvhandoff-channel-answer"
#: The status of the hello: the handshake's answer, as the WebSocket upgrade (101).
HELLO_STATUS = 101
#: A frame holds the parts queued while the last one was written up to this size (one larger
#: part goes alone), as a coalesced batch of notices does (`kvhandoff.service.peers.coalesce`).
FRAME_BYTES = 1 << 20
#: What a frame adds to the largest part it may hold: the MAC, the array, one call's envelope.
_ENVELOPE_BYTES = 4096
#: The recipient's hello comes at once after the upgrade; a sender waits this long for it.
_HELLO_S = 10.0
#: After a channel to a peer failed to open, its calls go over HTTP this long before a retry.
_RETRY_S = 5.0


class ChannelBroken(Exception):
    """A frame failed its MAC or its sequence, or the channel's protocol was not followed."""


class Hello(msgspec.Struct, frozen=True):
    """The recipient's first frame: its nonce for this session and the answer signature
    headers (`AnswerSigner`) over it, bound to the handshake's nonce."""

    nonce: str
    signed: dict[str, str]


class CallFrame(msgspec.Struct, frozen=True):
    id: int
    path: str
    body: msgspec.Raw


class AnswerFrame(msgspec.Struct, frozen=True):
    id: int
    status: int
    body: msgspec.Raw


_encoder = msgspec.json.Encoder()
_hello = msgspec.json.Decoder(Hello)
_calls = msgspec.json.Decoder(list[CallFrame])
_answers = msgspec.json.Decoder(list[AnswerFrame])
_EMPTY = b"null"  # the body of a call without one


def _call_part(ident: int, path: str, body: bytes) -> bytes:
    """A `CallFrame` around a body already encoded, without encoding it again (`path` is one
    of the table's, which JSON writes as is)."""
    return b'{"id":%d,"path":"%s","body":%s}' % (ident, path.encode(), body)


def _answer_part(ident: int, status: int, body: bytes) -> bytes:
    """An `AnswerFrame` around a body already encoded."""
    return b'{"id":%d,"status":%d,"body":%s}' % (ident, status, body)


class Sealer:
    """One direction of one session: seals (or opens) its frames in sequence."""

    def __init__(self, key: bytes | None, direction: bytes) -> None:
        self._key = key
        self._direction = direction
        self._seq = 0

    def _mac(self, payload: bytes) -> bytes:
        assert self._key is not None
        head = self._direction + self._seq.to_bytes(8, "big")
        return hmac.new(self._key, head + payload, hashlib.sha256).digest()

    def seal(self, payload: bytes) -> bytes:
        frame = payload if self._key is None else self._mac(payload) + payload
        self._seq += 1
        return frame

    def open(self, frame: bytes) -> bytes:
        """The payload of the next frame; ChannelBroken when it is not that frame."""
        if self._key is None:
            self._seq += 1
            return frame
        mac, payload = frame[:_MAC_BYTES], frame[_MAC_BYTES:]
        if not hmac.compare_digest(mac, self._mac(payload)):
            raise ChannelBroken(f"frame {self._seq} does not verify (replayed, moved or altered)")
        self._seq += 1
        return payload


def session(key: bytes | None) -> tuple[Sealer, Sealer]:
    """The sender's (out, in) sealers of a session; the recipient's are the other way round."""
    return Sealer(key, _TO_RECIPIENT), Sealer(key, _TO_SENDER)


class Writer:
    """The one writer of a channel's direction: the parts (encoded calls or answers) queued
    while a frame is being written leave together in the next frame, sealed in sequence."""

    def __init__(self, sealer: Sealer, send: Callable[[bytes], Awaitable[None]]) -> None:
        self._sealer = sealer
        self._send = send
        self._parts: list[bytes] = []
        self._wake = asyncio.Event()

    def put(self, part: bytes) -> None:
        self._parts.append(part)
        self._wake.set()

    async def run(self) -> None:
        """Write until cancelled; a failed write raises (the channel is down)."""
        while True:
            await self._wake.wait()
            self._wake.clear()
            while self._parts:
                parts = self._take()
                await self._send(self._sealer.seal(b"[" + b",".join(parts) + b"]"))

    def _take(self) -> list[bytes]:
        """The oldest parts that fit in `FRAME_BYTES` (always at least one)."""
        size, n = 0, 0
        for part in self._parts:
            size += len(part) + 1
            if n and size > FRAME_BYTES:
                break
            n += 1
        taken, self._parts = self._parts[:n], self._parts[n:]
        return taken


# ---------------------------------------------------------------------------------------------
# The sender's end


class Channel:
    """An open channel to one life of a peer: `call` queues a call and waits for its answer;
    `run` writes the calls and reads the answers until the channel ends."""

    def __init__(
        self, ws: aiohttp.ClientWebSocketResponse, key: bytes | None, peer: str, incarnation: str
    ) -> None:
        self.peer = peer
        self.incarnation = incarnation  # "" when peer auth is off: no life is vouched for
        self._ws = ws
        out, self._in = session(key)
        self._writer = Writer(out, ws.send_bytes)
        self._next_id = 0
        self._waiting: dict[int, asyncio.Future[tuple[int, bytes]]] = {}
        self._broken: str | None = None

    @property
    def alive(self) -> bool:
        return self._broken is None and not self._ws.closed

    async def call(self, path: str, body: bytes, timeout_s: float) -> tuple[int, bytes]:
        """The (status, body) the peer answered; PeerUnreachable when the channel is or goes
        down first, PeerTimeout after `timeout_s`."""
        what = f"POST {self.peer}{path} (channel)"
        if self._broken is not None:
            raise PeerUnreachable(f"{what}: {self._broken}", peer=self.peer)
        self._next_id += 1
        ident = self._next_id
        done: asyncio.Future[tuple[int, bytes]] = asyncio.get_running_loop().create_future()
        self._waiting[ident] = done
        self._writer.put(_call_part(ident, path, body or _EMPTY))
        try:
            async with asyncio.timeout(timeout_s):
                return await done
        except TimeoutError:
            raise PeerTimeout(
                f"{what} got no answer within {timeout_s} s", peer=self.peer
            ) from None
        finally:
            self._waiting.pop(ident, None)

    async def run(self) -> None:
        """Write calls and resolve them with their answers until the channel ends; then fail
        every call still waiting (PeerUnreachable), so none is left without an outcome."""
        reason = "the peer closed the channel"
        try:
            async with asyncio.TaskGroup() as group:
                writing = group.create_task(self._writer.run())
                reason = await self._read()
                writing.cancel()
        except* (aiohttp.ClientError, ConnectionError) as failed:
            reason = f"writing failed: {failed.exceptions[0]}"
        finally:
            self.broken(reason)
            await self._ws.close()

    async def _read(self) -> str:
        """Resolve calls until the channel ends; why it ended."""
        try:
            async for message in self._ws:
                if message.type != aiohttp.WSMsgType.BINARY:
                    return f"the channel ended ({message.type.name})"
                for answer in _answers.decode(self._in.open(message.data)):
                    waiter = self._waiting.get(answer.id)
                    if waiter is not None and not waiter.done():
                        waiter.set_result((answer.status, bytes(answer.body)))
        except (ChannelBroken, msgspec.DecodeError, msgspec.ValidationError) as exc:
            log.warning("channel to %s: the peer broke its protocol: %s", self.peer, exc)
            return f"the peer broke the channel's protocol: {exc}"
        return "the peer closed the channel"

    def broken(self, reason: str) -> None:
        if self._broken is None:
            self._broken = reason
        for ident, waiter in list(self._waiting.items()):
            if not waiter.done():
                waiter.set_exception(
                    PeerUnreachable(
                        f"{self.peer}: call {ident} lost with the channel: {reason}",
                        peer=self.peer,
                    )
                )

    async def close(self) -> None:
        self.broken("the channel was closed")
        await self._ws.close()


class PeerChannels:
    """The open channels of one service to its peers, one per (peer, its life). `ready` hands
    out an open one or starts opening one and answers None meanwhile (the call goes over
    HTTP); a channel is replaced when the peer's life changes and dropped when it ends."""

    def __init__(
        self, session: aiohttp.ClientSession, signer: Signer | None, *, max_body_bytes: int
    ) -> None:
        self._session = session
        self._signer = signer
        self._max_body_bytes = max_body_bytes
        self._open: dict[str, Channel] = {}
        self._opening: set[str] = set()
        # peer -> (the life a channel failed to open to, when to try that life again)
        self._retry_at: PeerCache[tuple[str, float]] = PeerCache(MAX_PEERS)
        self._tasks = TaskOwner("peer-channels")

    def ready(self, peer: str, incarnation: str | None) -> Channel | None:
        """The open channel to `peer` in life `incarnation` (None: unknown, peer auth off)."""
        key = canonical_url(peer)
        channel = self._open.get(key)
        if channel is not None and channel.alive and channel.incarnation == (incarnation or ""):
            return channel
        if channel is not None:  # ended, or the peer's life changed: a new life, a new channel
            del self._open[key]
            self._tasks.spawn(channel.close(), f"channel-close:{key}")
        if self._signer is not None and incarnation is None:
            return None  # bound to a life once an authenticated answer names it
        life = incarnation or ""
        failed, retry_at = self._retry_at.get(key) or (life, 0.0)
        if key in self._opening or (
            failed == life and asyncio.get_running_loop().time() < retry_at
        ):
            return None
        if self._tasks.closing or len(self._open) + len(self._opening) >= MAX_PEERS:
            return None
        self._opening.add(key)
        self._tasks.spawn(self.channel(peer, key, life), f"channel:{key}")
        return None

    async def close(self) -> None:
        for channel in list(self._open.values()):
            channel.broken("the service is shutting down")
        await self._tasks.close(timeout_s=5.0)
        for channel in list(self._open.values()):
            await channel.close()
        self._open.clear()

    async def channel(self, peer: str, key: str, incarnation: str) -> None:
        """Open the channel to `peer` (canonical URL `key`) in life `incarnation` and read its
        answers until it ends (`CHANNEL` of `kvhandoff.pipelines.peer_calls`); a channel that cannot
        be opened leaves `peer`'s calls on HTTP for a while."""
        try:
            channel = await self._connect(peer, incarnation)
        except (aiohttp.ClientError, TimeoutError, ChannelBroken, AnswerRejected) as exc:
            # HTTP keeps serving this peer; an older service without the route lands here too.
            log.info("no channel to %s (calls go over HTTP): %s", peer, exc)
            self._retry_at.put(key, (incarnation, asyncio.get_running_loop().time() + _RETRY_S))
            return
        finally:
            self._opening.discard(key)
        self._retry_at.pop(key)
        self._open[key] = channel
        try:
            await channel.run()
        finally:
            if self._open.get(key) is channel:
                del self._open[key]

    async def _connect(self, peer: str, incarnation: str) -> Channel:
        base = peer.rstrip("/")
        target = URL(base + CHANNEL.path, encoded=True)
        headers: dict[str, str] = {}
        if self._signer is not None:
            headers = self._signer.headers(
                "GET", target.raw_path_qs, b"", recipient=base, recipient_incarnation=incarnation
            )
        ws = await self._session.ws_connect(
            target,
            headers=headers,
            max_msg_size=max(self._max_body_bytes, FRAME_BYTES) + _ENVELOPE_BYTES,
            autoping=True,
            compress=0,
            timeout=aiohttp.ClientWSTimeout(ws_close=2.0),
        )
        try:
            async with asyncio.timeout(_HELLO_S):
                first = await ws.receive()
            if first.type != aiohttp.WSMsgType.BINARY:
                raise ChannelBroken(f"no hello from {base} ({first.type.name})")
            hello = _hello.decode(first.data)
            key: bytes | None = None
            if self._signer is not None:
                nonce = headers[NONCE_HEADER]
                body = hello.nonce.encode()
                life = self._signer.check_answer(nonce, base, HELLO_STATUS, hello.signed, body)
                if life != incarnation:
                    raise ChannelBroken(f"{base} answered as life {life}, not {incarnation}")
                key = self._signer.channel_key(nonce, hello.nonce, base, incarnation)
        except BaseException:
            await ws.close()
            raise
        return Channel(ws, key, base, incarnation)


# ---------------------------------------------------------------------------------------------
# The recipient's end

#: Serves one call that arrived on a channel: (status, body) as its HTTP route would answer.
Serve = Callable[[str, bytes], Awaitable[tuple[int, bytes]]]


@dataclass(frozen=True, slots=True)
class Accepted:
    """A verified handshake: who opened the channel, and what its key derives from (None when
    peer auth is off)."""

    sender: str | None
    nonce: str
    secret: str | None
    answers: AnswerSigner | None


async def serve(
    request: web.Request,
    accepted: Accepted,
    dispatch: Serve,
    *,
    max_body_bytes: int,
    before_answer: Callable[[], Awaitable[None]],
    closing: asyncio.Event,
) -> web.WebSocketResponse:
    """Accept the channel, send the hello and serve its calls until it ends or `closing` is
    set (the service stops). `max_body_bytes` bounds one call's body, as over HTTP;
    `before_answer()` before each answer leaves (what it tells of is on disk first)."""
    ws = web.WebSocketResponse(
        max_msg_size=max(max_body_bytes, FRAME_BYTES) + _ENVELOPE_BYTES,
        compress=False,
        autoping=True,
    )
    await ws.prepare(request)
    channel_nonce = secrets.token_hex(16)
    key, signed = _recipient_hello(accepted, channel_nonce)
    await ws.send_bytes(_encoder.encode(Hello(channel_nonce, signed)))
    inbound, outbound = session(key)  # the sender's out is this end's in
    writer = Writer(outbound, ws.send_bytes)
    helpers, calls = TaskOwner("channel"), TaskOwner("channel-calls")

    async def answer(call: CallFrame) -> None:
        status, body = await dispatch(call.path, bytes(call.body))
        await before_answer()
        writer.put(_answer_part(call.id, status, body))

    async def close_when(closing: asyncio.Event) -> None:
        await closing.wait()  # the service stops: the sender's calls fail now, not at timeout
        await ws.close(code=aiohttp.WSCloseCode.GOING_AWAY, message=b"shutting down")

    sender = accepted.sender or request.remote
    writing = helpers.spawn(answer_until_closed(writer, sender), "channel-writer")
    helpers.spawn(close_when(closing), "channel-closing")
    try:
        async for message in ws:
            if message.type != aiohttp.WSMsgType.BINARY or writing.done():
                break
            try:
                frame = _calls.decode(inbound.open(message.data))
            except (ChannelBroken, msgspec.DecodeError, msgspec.ValidationError) as exc:
                log.warning("channel from %s closed: %s", accepted.sender or request.remote, exc)
                await ws.close(code=aiohttp.WSCloseCode.POLICY_VIOLATION, message=b"bad frame")
                break
            for call in frame:
                calls.spawn(answer(call), f"channel-call:{call.path}")
    finally:
        await helpers.close()
        await ws.close()
        await _finish(calls)
    return ws


async def answer_until_closed(writer: Writer, sender: str | None) -> None:
    """The recipient's writer: its answers until the channel is down. A write that finds the
    connection closing (the service stops, or the sender left, while answers were queued) ends
    the writing without an error: the channel is down, and its answers are dropped as a dropped
    HTTP connection drops its answer (the sender fails those calls as unreachable)."""
    try:
        await writer.run()
    except (aiohttp.ClientError, ConnectionError) as exc:
        log.info("channel from %s: answers not sent, the connection is closing (%s)", sender, exc)


async def _finish(calls: TaskOwner) -> None:
    """Calls already taken finish (a commit half done is not abandoned), their answers
    dropped, as a dropped HTTP connection drops its answer; when the service stops, they are
    cancelled with it, as its HTTP handlers are."""
    try:
        if calls.tasks:
            await asyncio.wait(calls.tasks)
    finally:
        await calls.close()


def _recipient_hello(accepted: Accepted, channel_nonce: str) -> tuple[bytes | None, dict[str, str]]:
    """The session key and the hello's signature headers (none when peer auth is off)."""
    if accepted.answers is None or accepted.secret is None:
        return None, {}
    signed = accepted.answers.headers(accepted.nonce, HELLO_STATUS, channel_nonce.encode())
    return _recipient_key(accepted, channel_nonce), signed


def _recipient_key(accepted: Accepted, channel_nonce: str) -> bytes:
    assert accepted.answers is not None and accepted.secret is not None
    assert accepted.sender is not None
    return channel_key(
        accepted.secret,
        accepted.nonce,
        channel_nonce,
        accepted.sender,
        accepted.answers.url,
        accepted.answers.incarnation,
    )
