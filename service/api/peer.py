"""Peer-facing routes: the other side of `service.peers.protocol`.

`GET /v1/layout` on both roles (what a peer must know to pair with and write to this process);
destinations and aborts on prefill services; arrivals and stage failures on decode services;
heartbeats and the watch stream on both. Every route takes a signed peer request
(service.http.auth) when a peer secret is configured; then whoever a message implies as its
sender — a destination's `decode_url`, a heartbeat's `sender_url`, the prefill service assigned
to the stage an arrival or failure reports on, the decode service an aborted handoff got its
destination from — must be the service that signed it, or the message is refused with 403 before
the pipeline sees it. Each message's protocol version is checked before it is acted on.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
from collections.abc import Callable
from typing import Any, TypeVar

import msgspec
from aiohttp import web

from pipelines.decode.views import HANDOFF_ID_PATTERN
from pipelines.errors import InvalidInput, KVHandoffError
from pipelines.messages import (
    AbortMsg,
    ArrivalMsg,
    DestinationMsg,
    HeartbeatMsg,
    Outcome,
    SegmentMsg,
    SegmentOutcome,
    StageFailedMsg,
    WindowRequest,
    check_version,
)
from pipelines.peer_calls import (
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
from pipelines.urls import canonical_url
from service.http.app import decode_body, decode_items, json_response
from service.http.auth import signed_sender
from service.http.problems import Forbidden, error_problem
from service.http.routing import Handler, RouteTable
from service.runtime.roles import RUNTIME, decode_of, prefill_of

common_routes = RouteTable()
decode_peer_routes = RouteTable()
prefill_peer_routes = RouteTable()


def _serves(table: RouteTable, call: PeerCall, **contract: Any) -> Callable[[Handler], Handler]:
    """Declare the route that receives `call`: its method, path and wire types are the table's
    (`pipelines.peer_calls`), so a route cannot drift from what its senders send."""
    if call.request is not None:
        contract["request"] = call.body
    if call.answer is not None:
        contract["response"] = call.reply
    return table.route(call.method, call.path, tags=("peer",), role="peer", **contract)


_NO_CONTENT = 204
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


def _heard(request: web.Request, sender: str | None) -> None:
    """A verified peer request proves its sender alive as a heartbeat would: under load its
    heartbeat answers may come late, while its notices keep coming, and a busy peer must not be
    judged silent (`service.peers.heartbeat`). Unsigned (peer auth off), nothing proves who
    sent it, and only heartbeats count."""
    if sender is not None:
        request.app[RUNTIME].heartbeats.heard(canonical_url(sender))


def _same_service(claimed: str, sender: str, what: str, field: str) -> None:
    if canonical_url(claimed) != canonical_url(sender):
        raise Forbidden(f"{what} names {claimed} but was signed by {sender}", field=field)


async def _each(
    request: web.Request,
    type_: type[M],
    handle: Callable[[M], Any],
    check_sender: Callable[[M, str], None],
) -> web.Response:
    """Handle a batch of notices (see service.peers.coalesce): one outcome per notice, in order;
    `check_sender(msg, sender)` refuses a notice its signed sender may not send."""
    outcomes = []
    batch = decode_items(await decode_body(request, list[msgspec.Raw]), type_)
    sender = signed_sender(request)
    _heard(request, sender)
    for msg in batch:
        try:
            if isinstance(msg, InvalidInput):
                raise msg
            check_version(msg.version)
            if sender is not None:
                check_sender(msg, sender)
            handle(msg)
        except KVHandoffError as error:
            status, problem = error_problem(error, request.path)
            outcomes.append(Outcome(status, problem))
        else:
            outcomes.append(Outcome(_NO_CONTENT))
    return json_response(outcomes)


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
    prefill_peer_routes,
    DESTINATIONS,
    errors=(422,),
    summary="Decode → prefill: where handoffs' bytes go (a batch; one outcome per item)",
)
async def destinations(request: web.Request) -> web.StreamResponse:
    def from_decode(msg: DestinationMsg, sender: str) -> None:
        # Only the decode service that owns the pages may say where bytes go.
        _same_service(msg.decode_url, sender, "the destination", "decode_url")

    pipeline = prefill_of(request)

    def deliver(msg: DestinationMsg) -> Any:
        _handoff_id(msg.handoff_id)
        return pipeline.deliver(msg)

    return await _each(request, DestinationMsg, deliver, from_decode)


@_serves(
    prefill_peer_routes,
    ABORTS,
    errors=(422,),
    summary="Decode → prefill: stop a handoff; answers once no write of it can still land",
)
async def abort(request: web.Request) -> web.StreamResponse:
    msg = await decode_body(request, AbortMsg)
    check_version(msg.version)
    _handoff_id(msg.handoff_id)
    pipeline = prefill_of(request)
    # Ids are the decode's own: a signed abort stops its sender's handoff of that id (or one no
    # decode has sent a destination for yet: nothing can be written, and any peer may stop the
    # waiting), never another decode's.
    sender = signed_sender(request)
    return json_response(
        await pipeline.abort(msg.handoff_id, msg.reason, msg.decode_incarnation, decode_url=sender)
    )


@_serves(
    decode_peer_routes,
    ARRIVALS,
    errors=(422,),
    summary="Prefill → decode: every byte of these stages has landed (one outcome per item)",
)
async def arrivals(request: web.Request) -> web.StreamResponse:
    return await _each(
        request, ArrivalMsg, decode_of(request).arrived, _from_stage_peer(request, "arrival")
    )


@_serves(
    decode_peer_routes,
    STAGE_FAILURES,
    errors=(422,),
    summary="Prefill → decode: these stages failed; no write of them can still land",
)
async def stage_failures(request: web.Request) -> web.StreamResponse:
    return await _each(
        request,
        StageFailedMsg,
        decode_of(request).stage_failed,
        _from_stage_peer(request, "stage failure"),
    )


@_serves(
    decode_peer_routes,
    WINDOWS,
    errors=(404, 409, 422),
    summary="Prefill → decode: a landing window for a stage's next segment (landed mode)",
)
async def windows(request: web.Request) -> web.StreamResponse:
    msg = await decode_body(request, WindowRequest)
    check_version(msg.version)
    sender = signed_sender(request)
    _heard(request, sender)
    if sender is not None:
        _from_stage_peer(request, "window request")(msg, sender)
    return json_response(await decode_of(request).window(msg))


@_serves(
    decode_peer_routes,
    SEGMENTS,
    errors=(422,),
    summary="Prefill → decode: these segments landed in their windows; each committed once its "
    "digest matches (one outcome per item: its ack, or a problem)",
)
async def segments(request: web.Request) -> web.StreamResponse:
    batch = decode_items(await decode_body(request, list[msgspec.Raw]), SegmentMsg)
    sender = signed_sender(request)
    _heard(request, sender)
    pipeline = decode_of(request)
    check = _from_stage_peer(request, "segment")

    async def one(msg: SegmentMsg | InvalidInput) -> SegmentOutcome:
        try:
            if isinstance(msg, InvalidInput):
                raise msg  # this item's wrong field; the batch's others are answered
            check_version(msg.version)
            if sender is not None:
                check(msg, sender)
            return SegmentOutcome(200, await pipeline.segment(msg))
        except KVHandoffError as error:
            status, problem = error_problem(error, request.path)
            return SegmentOutcome(status, problem=problem)

    # Committed side by side, as separate requests would be; answered once all are.
    outcomes = [await one(batch[0])] if len(batch) == 1 else await asyncio.gather(*map(one, batch))
    return json_response(outcomes)


def _from_stage_peer(
    request: web.Request, what: str
) -> Callable[[ArrivalMsg | StageFailedMsg | WindowRequest | SegmentMsg, str], None]:
    """Only the prefill service a handoff's stage was assigned to may report on that stage."""
    pipeline = decode_of(request)

    def check(msg: ArrivalMsg | StageFailedMsg | WindowRequest | SegmentMsg, sender: str) -> None:
        # An unknown handoff: 404, as the pipeline says; an unknown stage: the pipeline's 422.
        peer = pipeline.query.stage_peer(msg.handoff_id, msg.pp_rank)
        if peer is not None:
            _same_service(peer, sender, f"the {what} of stage {msg.pp_rank}", "pp_rank")

    return check
