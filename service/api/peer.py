"""Peer-facing routes: the other side of `kvhandoff.service.peers.protocol`.

`GET /v1/layout` on both roles (what a peer must know to pair with and write to this process);
destinations and aborts on prefill services; arrivals and stage failures on decode services;
heartbeats, the watch stream and the peer channel on both. The calls a channel carries
(`PeerCall.channel`) are written once, as handlers of what was asked (`Asked`: the app, the
verified sender, the path) and the body's bytes: the HTTP route and the channel
(`kvhandoff.service.http.peer_channel`) both call the same handler. Every route takes a signed peer
request (kvhandoff.service.http.auth) when a peer secret is configured; then whoever a message
implies as its sender — a destination's `decode_url`, a heartbeat's `sender_url`, the prefill
service assigned to the stage an arrival or failure reports on, the decode service an aborted
handoff got its destination from — must be the service that signed it, or the message is refused
with 403 before the pipeline sees it (on a channel: the sender of its verified handshake). Each
message's protocol version is checked before it is acted on.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import re
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import msgspec
from aiohttp import web

from kvhandoff.pipelines.decode import DecodePipeline
from kvhandoff.pipelines.decode.views import HANDOFF_ID_PATTERN
from kvhandoff.pipelines.errors import InvalidInput, KVHandoffError, NotFoundError
from kvhandoff.pipelines.messages import (
    AbortAck,
    AbortMsg,
    ArrivalMsg,
    DestinationMsg,
    HeartbeatMsg,
    Outcome,
    SegmentMsg,
    SegmentOutcome,
    StageFailedMsg,
    WindowAnswer,
    WindowRequest,
    check_version,
)
from kvhandoff.pipelines.peer_calls import (
    ABORTS,
    ARRIVALS,
    CHANNEL,
    DESTINATIONS,
    HEARTBEATS,
    LAYOUT,
    SEGMENTS,
    STAGE_FAILURES,
    WATCH,
    WINDOWS,
    PeerCall,
)
from kvhandoff.pipelines.urls import canonical_url
from kvhandoff.service.http.app import (
    CONFIG,
    ROUTES,
    answers_of,
    decode_body,
    decode_items,
    decode_json,
    json_response,
    read_json_body,
)
from kvhandoff.service.http.auth import SIGNED_WITH, signed_sender
from kvhandoff.service.http.egress import EGRESS
from kvhandoff.service.http.peer_channel import Accepted, serve
from kvhandoff.service.http.peer_signing import NONCE_HEADER
from kvhandoff.service.http.problems import Forbidden, encode_problem, error_problem, problem_body
from kvhandoff.service.http.routing import Handler, RouteTable
from kvhandoff.service.runtime.roles import DECODE, PREFILL, RUNTIME

common_routes = RouteTable()
decode_peer_routes = RouteTable()
prefill_peer_routes = RouteTable()


def _serves(table: RouteTable, call: PeerCall, **contract: Any) -> Callable[[Handler], Handler]:
    """Declare the route that receives `call`: its method, path and wire types are the table's
    (`kvhandoff.pipelines.peer_calls`), so a route cannot drift from what its senders send."""
    if call.request is not None:
        contract["request"] = call.body
    if call.answer is not None:
        contract["response"] = call.reply
    return table.route(call.method, call.path, tags=("peer",), role="peer", **contract)


@dataclass(frozen=True, slots=True)
class Asked:
    """A peer call as its handler sees it, over HTTP or a channel: this service's app, the
    verified sender (None when peer auth is off) and the call's path (a problem's instance)."""

    app: web.Application
    sender: str | None
    path: str

    def heard(self) -> None:
        """A verified peer call proves its sender alive as a heartbeat would: under load its
        heartbeat answers may come late, while its notices keep coming, and a busy peer must
        not be judged silent (`kvhandoff.service.peers.heartbeat`). Unsigned (peer auth off),
        nothing proves who sent it, and only heartbeats count."""
        if self.sender is not None:
            self.app[RUNTIME].heartbeats.heard(canonical_url(self.sender))


#: Handles one call a channel carries: what was asked and the body's bytes; its answer body.
Carried = Callable[[Asked, bytes], Awaitable[Any]]
#: The handler of each such call, by the route that serves it over HTTP.
CARRIED: dict[Handler, Carried] = {}


def carries(table: RouteTable, call: PeerCall, **contract: Any) -> Callable[[Carried], Carried]:
    """Declare `call`'s route (as `_serves`) over a handler that a channel calls too."""
    assert call.channel and call.method == "POST", call.name

    def declare(handle: Carried) -> Carried:
        @functools.wraps(handle)
        async def route(request: web.Request) -> web.StreamResponse:
            raw = await read_json_body(request)
            asked = Asked(request.app, signed_sender(request), request.path)
            return json_response(await handle(asked, raw))

        _serves(table, call, **contract)(route)
        CARRIED[route] = handle
        return handle

    return declare


_NO_CONTENT = 204
_encoder = msgspec.json.Encoder()
M = TypeVar("M", DestinationMsg, ArrivalMsg, StageFailedMsg)

log = logging.getLogger("kvhandoff.heartbeat")

_ID = re.compile(HANDOFF_ID_PATTERN)
_MAX_ID_CHARS = 256  # as the public routes (HandoffId)


def _handoff_id(handoff_id: str) -> None:
    """A peer message may name only a handoff id the public routes accept: a prefill must not
    open (and keep) a handoff no router or engine could name."""
    if not (0 < len(handoff_id) <= _MAX_ID_CHARS and _ID.fullmatch(handoff_id)):
        raise InvalidInput(
            f"handoff_id {handoff_id[:64]!r} is not a valid handoff id (letters, digits, "
            f"._:@-, 1..{_MAX_ID_CHARS} characters, not . or ..)",
            field="handoff_id",
        )


def _same_service(claimed: str, sender: str, what: str, field: str) -> None:
    if canonical_url(claimed) != canonical_url(sender):
        raise Forbidden(f"{what} names {claimed} but was signed by {sender}", field=field)


def _each(
    asked: Asked,
    raw: bytes,
    type_: type[M],
    handle: Callable[[M], Any],
    check_sender: Callable[[M, str], None],
) -> list[Outcome]:
    """Handle a batch of notices (see kvhandoff.service.peers.coalesce): one outcome per notice, in
    order; `check_sender(msg, sender)` refuses a notice its signed sender may not send."""
    outcomes = []
    batch = decode_items(decode_json(raw, list[msgspec.Raw]), type_)
    sender = asked.sender
    asked.heard()
    for msg in batch:
        try:
            if isinstance(msg, InvalidInput):
                raise msg
            check_version(msg.version)
            if sender is not None:
                check_sender(msg, sender)
            handle(msg)
        except KVHandoffError as error:
            status, problem = error_problem(error, asked.path)
            outcomes.append(Outcome(status, problem))
        else:
            outcomes.append(Outcome(_NO_CONTENT))
    return outcomes


@_serves(
    common_routes,
    LAYOUT,
    summary="The stages hosted here: placed layouts, fingerprints, transport target, shm offsets",
)
async def layout(request: web.Request) -> web.StreamResponse:
    return json_response(request.app[RUNTIME].layout_info())


@_serves(
    common_routes,
    HEARTBEATS,
    errors=(422,),
    summary="A peer sharing live handoffs with this service is alive",
)
async def heartbeat(request: web.Request) -> web.StreamResponse:
    msg = await decode_body(request, HeartbeatMsg)
    check_version(msg.version)
    sender = signed_sender(request)
    if sender is not None:
        _same_service(msg.sender_url, sender, "the heartbeat", "sender_url")
    return json_response(request.app[RUNTIME].heartbeats.receive(msg))


@_serves(
    common_routes,
    WATCH,
    content_type="text/plain",
    summary="A peer holds this open to learn at once when this process ends (a byte a second)",
)
async def watch(request: web.Request) -> web.StreamResponse:
    runtime = request.app[RUNTIME]
    response = web.StreamResponse(headers={"Content-Type": "text/plain"})
    await response.prepare(request)
    try:
        while not runtime.closing.is_set():
            await response.write(b"\n")
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(runtime.heartbeats.interval_s):
                    await runtime.closing.wait()
    except ConnectionResetError:  # aiohttp's reset error subclasses it
        # The watcher left: its handoffs with us ended, or it stopped. That is how every watch
        # ends, not an error.
        log.debug("watch from %s ended: the peer closed it", request.remote)
    return response


@_serves(
    common_routes,
    CHANNEL,
    status=101,
    errors=(422,),
    content_type="application/octet-stream",
    summary="A peer's persistent channel: a signed handshake upgraded to a WebSocket of "
    "authenticated frames carrying the calls of the other peer routes (peer_channel)",
)
async def channel(request: web.Request) -> web.StreamResponse:
    app = request.app
    if not web.WebSocketResponse().can_prepare(request).ok:
        raise InvalidInput(
            "the peer channel is a WebSocket: ask with `Upgrade: websocket`", field="Upgrade"
        )
    sender = signed_sender(request)
    accepted = Accepted(
        sender=sender,
        nonce=request.headers.get(NONCE_HEADER, ""),
        secret=request.get(SIGNED_WITH),
        answers=answers_of(app),
    )
    # The calls this service serves over HTTP, and nothing else: a decode's channel carries no
    # destination, a prefill's no arrival.
    served = {r.path: CARRIED[r.handler] for r in app[ROUTES] if r.handler in CARRIED}

    async def dispatch(path: str, raw: bytes) -> tuple[int, bytes]:
        handle = served.get(path)
        try:
            if handle is None:
                raise NotFoundError(f"no peer call {path[:100]!r} on this channel", field="path")
            return 200, _encoder.encode(await handle(Asked(app, sender, path), raw))
        except KVHandoffError as error:
            status, problem = error_problem(error, path)
            return status, encode_problem(problem)
        except Exception:  # the channel's error_middleware: a call's bug is its own 500
            log.exception("unhandled error in peer call %s on a channel", path)
            return 500, encode_problem(
                problem_body(
                    status=500,
                    code="internal_error",
                    detail="an unexpected error occurred; see the service log",
                    instance=path,
                )
            )

    return await serve(
        request,
        accepted,
        dispatch,
        max_body_bytes=app[CONFIG].server.max_body_bytes,
        before_answer=app[EGRESS].before,
        closing=app[RUNTIME].closing,
    )


@carries(
    prefill_peer_routes,
    DESTINATIONS,
    errors=(422,),
    summary="Decode → prefill: where handoffs' bytes go (a batch; one outcome per item)",
)
async def destinations(asked: Asked, raw: bytes) -> list[Outcome]:
    def from_decode(msg: DestinationMsg, sender: str) -> None:
        # Only the decode service that owns the pages may say where bytes go.
        _same_service(msg.decode_url, sender, "the destination", "decode_url")

    pipeline = asked.app[PREFILL].pipeline

    def deliver(msg: DestinationMsg) -> Any:
        _handoff_id(msg.handoff_id)
        return pipeline.deliver(msg)

    return _each(asked, raw, DestinationMsg, deliver, from_decode)


@carries(
    prefill_peer_routes,
    ABORTS,
    errors=(422,),
    summary="Decode → prefill: stop a handoff; answers once no write of it can still land",
)
async def abort(asked: Asked, raw: bytes) -> AbortAck:
    msg = decode_json(raw, AbortMsg)
    check_version(msg.version)
    _handoff_id(msg.handoff_id)
    pipeline = asked.app[PREFILL].pipeline
    # Ids are the decode's own: a signed abort stops its sender's handoff of that id (or one no
    # decode has sent a destination for yet: nothing can be written, and any peer may stop the
    # waiting), never another decode's.
    return await pipeline.abort(
        msg.handoff_id, msg.reason, msg.decode_incarnation, decode_url=asked.sender
    )


@carries(
    decode_peer_routes,
    ARRIVALS,
    errors=(422,),
    summary="Prefill → decode: every byte of these stages has landed (one outcome per item)",
)
async def arrivals(asked: Asked, raw: bytes) -> list[Outcome]:
    pipeline = asked.app[DECODE].pipeline
    return _each(asked, raw, ArrivalMsg, pipeline.arrived, _from_stage_peer(pipeline, "arrival"))


@carries(
    decode_peer_routes,
    STAGE_FAILURES,
    errors=(422,),
    summary="Prefill → decode: these stages failed; no write of them can still land",
)
async def stage_failures(asked: Asked, raw: bytes) -> list[Outcome]:
    pipeline = asked.app[DECODE].pipeline
    check = _from_stage_peer(pipeline, "stage failure")
    return _each(asked, raw, StageFailedMsg, pipeline.stage_failed, check)


@carries(
    decode_peer_routes,
    WINDOWS,
    errors=(404, 409, 422),
    summary="Prefill → decode: a landing window for a stage's next segment (landed mode)",
)
async def windows(asked: Asked, raw: bytes) -> WindowAnswer:
    msg = decode_json(raw, WindowRequest)
    check_version(msg.version)
    asked.heard()
    pipeline = asked.app[DECODE].pipeline
    if asked.sender is not None:
        _from_stage_peer(pipeline, "window request")(msg, asked.sender)
    return await pipeline.window(msg)


@carries(
    decode_peer_routes,
    SEGMENTS,
    errors=(422,),
    summary="Prefill → decode: these segments landed in their windows; each committed once its "
    "digest matches (one outcome per item: its ack, or a problem)",
)
async def segments(asked: Asked, raw: bytes) -> list[SegmentOutcome]:
    batch = decode_items(decode_json(raw, list[msgspec.Raw]), SegmentMsg)
    sender = asked.sender
    asked.heard()
    pipeline = asked.app[DECODE].pipeline
    check = _from_stage_peer(pipeline, "segment")

    async def one(msg: SegmentMsg | InvalidInput) -> SegmentOutcome:
        try:
            if isinstance(msg, InvalidInput):
                raise msg  # this item's wrong field; the batch's others are answered
            check_version(msg.version)
            if sender is not None:
                check(msg, sender)
            return SegmentOutcome(200, await pipeline.segment(msg))
        except KVHandoffError as error:
            status, problem = error_problem(error, asked.path)
            return SegmentOutcome(status, problem=problem)

    # Committed side by side, as separate requests would be; answered once all are.
    return [await one(batch[0])] if len(batch) == 1 else await asyncio.gather(*map(one, batch))


def _from_stage_peer(
    pipeline: DecodePipeline, what: str
) -> Callable[[ArrivalMsg | StageFailedMsg | WindowRequest | SegmentMsg, str], None]:
    """Only the prefill service a handoff's stage was assigned to may report on that stage."""

    def check(msg: ArrivalMsg | StageFailedMsg | WindowRequest | SegmentMsg, sender: str) -> None:
        # An unknown handoff: 404, as the pipeline says; an unknown stage: the pipeline's 422.
        peer = pipeline.query.stage_peer(msg.handoff_id, msg.pp_rank)
        if peer is not None:
            _same_service(peer, sender, f"the {what} of stage {msg.pp_rank}", "pp_rank")

    return check
