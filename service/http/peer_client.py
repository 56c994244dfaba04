"""Typed service-to-service HTTP calls over one shared `aiohttp.ClientSession`.

Used by the handoff pipeline's peer protocol (layout exchange, destinations, arrivals,
heartbeats, aborts). Bodies are msgspec-encoded; a non-2xx problem+json answer is raised as the
same error class the peer raised (a remote 409 is a `ConflictError` here, with the remote's
detail and `peer` set); connection failures raise `PeerUnreachable` and timeouts `PeerTimeout`,
both naming the peer URL. Every call is signed with the peer secret when one is configured
(`kvhandoff.service.http.peer_signing`), addressed to the peer's URL (and to its incarnation once an
authenticated answer named it), so the peer can verify who sent it and that it was meant for
it; then every answer must prove it came from that peer for that request, or the call raises
`UnauthenticatedAnswer` and nothing in the answer is used — including a body's `incarnation`
or `url` that disagree with what the answer's signature vouches for. Redirects are never
followed (a 3xx is an error: it would carry the signed headers and body elsewhere).

The calls a peer channel carries (`kvhandoff.pipelines.peer_calls`, `PeerCall.channel`) go on the
open channel to the peer's life (`kvhandoff.service.http.peer_channel`), whose session authenticates
every answer frame; until one is open, and when channels are off, they go over HTTP. Both answers
are read in one place (`_result`), so a caller cannot tell the transports apart. The app creates
one client per process (`kvhandoff.service.http.app.PEERS`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from functools import cache
from typing import Any, TypeVar, overload

import aiohttp
import msgspec
from yarl import URL

from kvhandoff.pipelines.errors import KVHandoffError, PeerUnreachable
from kvhandoff.pipelines.peer_calls import CHANNEL_PATHS
from kvhandoff.pipelines.peercache import MAX_PEERS, PeerCache
from kvhandoff.pipelines.urls import canonical_url
from kvhandoff.service.config import PeersConfig, ServerConfig
from kvhandoff.service.http.egress import Egress
from kvhandoff.service.http.peer_channel import PeerChannels
from kvhandoff.service.http.peer_signing import NONCE_HEADER, AnswerRejected, Signer
from kvhandoff.service.http.problems import (
    PeerError,
    PeerTimeout,
    StaleIncarnation,
    error_from_problem,
)

T = TypeVar("T")

# Errors in the HTTP conversation itself (auth, routing, framing): not the peer's domain
# answer, so they surface as PeerError (502 here), never as e.g. our own 401 to our caller.
_PROTOCOL_CODES = {
    "unauthorized",
    "forbidden",
    "replayed",
    "route_not_found",
    "method_not_allowed",
    "malformed_body",
    "unsupported_media_type",
    "bad_request",
}

_encoder = msgspec.json.Encoder()


@cache
def _decoder(type_: Any) -> msgspec.json.Decoder[Any]:
    return msgspec.json.Decoder(type_)


#: The configuration's defaults are the client's (`peers.request_timeout_s`, `peers.channels`,
#: `server.max_body_bytes`), written once there.
_PEERS = PeersConfig()
_SERVER = ServerConfig()


class UnauthenticatedAnswer(PeerError):
    """An answer to a signed peer call that does not prove it came from the peer addressed, for
    this call (unsigned, signed by another service, altered, or claiming another life)."""

    code = "unauthenticated_answer"


class PeerClient:
    """Calls to other kvhandoff services; `url` is the peer's base URL (its `public_url`)."""

    def __init__(
        self,
        session: aiohttp.ClientSession,
        *,
        signer: Signer | None = None,
        timeout_s: float = _PEERS.request_timeout_s,
        egress: Egress | None = None,
        channels: bool = _PEERS.channels,
        max_body_bytes: int = _SERVER.max_body_bytes,
    ) -> None:
        self._session = session
        self._signer = signer
        self._egress = egress
        self.timeout_s = timeout_s
        # The calls of `kvhandoff.pipelines.peer_calls` that a channel carries go on one, once it is
        # open.
        self._channels = (
            PeerChannels(session, signer, max_body_bytes=max_body_bytes) if channels else None
        )
        # Each peer's incarnation, as its last authenticated answer named it (bounded).
        self._incarnations: PeerCache[str] = PeerCache(MAX_PEERS)

    async def close(self) -> None:
        """Close the open channels (their waiting calls fail as `PeerUnreachable`)."""
        if self._channels is not None:
            await self._channels.close()

    def incarnation_of(self, url: str) -> str | None:
        """The peer's incarnation as its last authenticated answer named it."""
        return self._incarnations.get(canonical_url(url))

    async def get(
        self, url: str, path: str, response_type: type[T], *, timeout_s: float | None = None
    ) -> T:
        result: T = await self.request(
            "GET", url, path, response_type=response_type, timeout_s=timeout_s
        )
        return result

    @overload
    async def post(
        self,
        url: str,
        path: str,
        body: Any,
        response_type: type[T],
        *,
        timeout_s: float | None = None,
    ) -> T: ...

    @overload
    async def post(
        self,
        url: str,
        path: str,
        body: Any,
        response_type: None = None,
        *,
        timeout_s: float | None = None,
    ) -> None: ...

    async def post(
        self,
        url: str,
        path: str,
        body: Any,
        response_type: type[T] | None = None,
        *,
        timeout_s: float | None = None,
    ) -> T | None:
        result: T | None = await self.request(
            "POST", url, path, body=body, response_type=response_type, timeout_s=timeout_s
        )
        return result

    async def request(
        self,
        method: str,
        url: str,
        path: str,
        *,
        body: Any = None,
        response_type: Any = None,
        timeout_s: float | None = None,
    ) -> Any:
        """One call; returns the decoded body (None when `response_type` is None). A call the
        peer refuses as addressed to an earlier life of it is signed again, once, for the life
        its authenticated refusal named."""
        try:
            return await self._request_once(method, url, path, body, response_type, timeout_s)
        except StaleIncarnation:
            return await self._request_once(method, url, path, body, response_type, timeout_s)

    async def _request_once(
        self,
        method: str,
        url: str,
        path: str,
        body: Any,
        response_type: Any,
        timeout_s: float | None,
    ) -> Any:
        peer = url.rstrip("/")
        # Bytes are a body already encoded (a batch of notices joined by the coalescer).
        data = b"" if body is None else body if isinstance(body, bytes) else _encoder.encode(body)
        timeout = self.timeout_s if timeout_s is None else timeout_s
        channel = None
        if method == "POST" and path in CHANNEL_PATHS and self._channels is not None:
            channel = self._channels.ready(peer, self.incarnation_of(peer))
        if self._egress is not None:
            await self._egress.before()  # what this request may tell of is on disk first
        if channel is not None:
            # The channel's session vouches for every answer frame: its peer, in its life.
            status, raw = await channel.call(path, data, timeout)
            incarnation: str | None = channel.incarnation or None
        else:
            status, raw, incarnation = await self._over_http(method, peer, path, data, timeout)
        return _result(f"{method} {peer}{path}", peer, status, raw, response_type, incarnation)

    async def _over_http(
        self, method: str, peer: str, path: str, data: bytes, timeout_s: float
    ) -> tuple[int, bytes, str | None]:
        """(status, body, the incarnation the answer's signature vouches for) of one HTTP call."""
        try:
            # encoded=True: the path is sent exactly as signed, never re-quoted by yarl.
            target = URL(peer + path, encoded=True)
        except ValueError as exc:
            raise PeerUnreachable(f"{method} {peer}{path}: bad URL: {exc}", peer=peer) from None
        headers = {"Content-Type": "application/json"} if data else {}
        if self._signer is not None:
            incarnation = self.incarnation_of(peer) or ""
            headers.update(
                self._signer.headers(
                    method,
                    target.raw_path_qs,
                    data,
                    recipient=peer,
                    recipient_incarnation=incarnation,
                )
            )
        try:
            async with self._session.request(
                method,
                target,
                data=data or None,
                headers=headers,
                timeout=aiohttp.ClientTimeout(total=timeout_s),
                allow_redirects=False,
            ) as response:
                raw = await response.read()
                status, answer_headers = response.status, response.headers
        except TimeoutError:  # aiohttp's timeouts subclass it (asyncio.TimeoutError on 3.11+)
            raise PeerTimeout(
                f"{method} {peer}{path} got no answer within {timeout_s} s", peer=peer
            ) from None
        except aiohttp.ClientError as exc:
            # ClientConnectorError, ServerDisconnectedError, ClientPayloadError, InvalidURL, ...
            raise PeerUnreachable(f"{method} {peer}{path} failed: {exc}", peer=peer) from None
        if self._signer is None:
            return status, raw, None
        try:
            incarnation = self._signer.check_answer(
                headers[NONCE_HEADER], peer, status, answer_headers, raw
            )
        except AnswerRejected as exc:
            # What the body says is not evidence of anything; its code and detail are kept
            # only to tell an operator why (a secret or URL that differs between services).
            hint = error_from_problem(status, raw, peer=peer) if status >= 400 else None
            raise UnauthenticatedAnswer(
                f"{method} {peer}{path}: {exc}"
                + (f" ({hint.code}: {hint.message})" if hint is not None else ""),
                peer=peer,
                status=status,
                remote_code=hint.code if hint is not None else None,
            ) from None
        self._incarnations.put(canonical_url(peer), incarnation)
        return status, raw, incarnation

    async def hold(
        self,
        session: aiohttp.ClientSession,
        url: str,
        path: str,
        *,
        idle_timeout_s: float,
        opened: Callable[[], None] | None = None,
    ) -> None:
        """Open a streaming GET on `session` and read it until the peer ends it. Raises
        PeerUnreachable when the connection breaks or is refused, PeerTimeout when nothing
        arrives for `idle_timeout_s` (the peer streams a byte more often than that), the peer's
        error for a non-2xx answer. `opened()` is called once the peer accepted the stream."""
        peer = url.rstrip("/")
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=idle_timeout_s)
        try:
            target = URL(peer + path, encoded=True)
        except ValueError as exc:
            raise PeerUnreachable(f"GET {peer}{path}: bad URL: {exc}", peer=peer) from None
        headers = (
            {}
            if self._signer is None
            else self._signer.headers(
                "GET",
                target.raw_path_qs,
                b"",
                recipient=peer,
                recipient_incarnation=self.incarnation_of(peer) or "",
            )
        )
        try:
            async with session.get(
                target, headers=headers, timeout=timeout, allow_redirects=False
            ) as response:
                if response.status >= 300:
                    raise _remote_error(response.status, await response.read(), peer)
                if opened is not None:
                    opened()
                while True:
                    async with asyncio.timeout(idle_timeout_s):
                        chunk = await response.content.readany()
                    if not chunk:
                        raise PeerUnreachable(f"{peer}{path} closed the connection", peer=peer)
        except TimeoutError:
            raise PeerTimeout(
                f"GET {peer}{path} sent nothing for {idle_timeout_s} s", peer=peer
            ) from None
        except aiohttp.ClientError as exc:
            raise PeerUnreachable(f"GET {peer}{path} failed: {exc}", peer=peer) from None


def _result(
    call: str, peer: str, status: int, raw: bytes, response_type: Any, incarnation: str | None
) -> Any:
    """The decoded answer of an authenticated exchange (or of any, with peer auth off); the
    peer's error for a non-2xx one."""
    if 300 <= status < 400:
        raise PeerError(
            f"{call} answered {status}: peer calls follow no redirect", peer=peer, status=status
        )
    if status >= 400:
        raise _remote_error(status, raw, peer)
    if response_type is None:
        return None
    try:
        result = _decoder(response_type).decode(raw)
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        raise PeerError(f"{call} answered with an unexpected body: {exc}", peer=peer) from None
    if incarnation is not None:
        _check_identity(result, peer, incarnation, call)
    return result


def _check_identity(result: Any, peer: str, incarnation: str, call: str) -> None:
    """A body that says whose answer it is (a layout, an abort or heartbeat ack) must say what
    the answer's signature vouches for: the peer addressed, in the life that signed."""
    claimed = getattr(result, "incarnation", None)
    if isinstance(claimed, str) and claimed != incarnation:
        raise UnauthenticatedAnswer(
            f"{call}: the answer names incarnation {claimed} but was signed by {incarnation}",
            peer=peer,
        )
    url = getattr(result, "url", None)
    if isinstance(url, str) and canonical_url(url) != canonical_url(peer):
        raise UnauthenticatedAnswer(f"{call}: the answer names {url}, not {peer}", peer=peer)


def _remote_error(status: int, raw: bytes, peer: str) -> KVHandoffError:
    error = error_from_problem(status, raw, peer=peer)
    if error.code in _PROTOCOL_CODES:
        return PeerError(
            f"peer {peer} rejected the call ({error.code}): {error.message}",
            peer=peer,
            status=status,
            remote_code=error.code,
        )
    return error
