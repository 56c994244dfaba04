"""Peer-facing routes: the other side of `service.http_peers`.

`GET /v1/layout` on both roles (what a peer must know to pair with and write to this process);
destinations and aborts on prefill services; arrivals and stage failures on decode services;
heartbeats on both. Each message's protocol version is checked before it is acted on.
"""

from __future__ import annotations

from aiohttp import web

from pipelines.messages import (
    AbortAck,
    AbortMsg,
    ArrivalMsg,
    DestinationMsg,
    HeartbeatAck,
    HeartbeatMsg,
    LayoutInfo,
    StageFailedMsg,
)
from service.app import decode_body, json_response
from service.http_peers import (
    ABORTS_PATH,
    ARRIVALS_PATH,
    DESTINATIONS_PATH,
    HEARTBEATS_PATH,
    LAYOUT_PATH,
    STAGE_FAILURES_PATH,
)
from service.routing import RouteTable
from service.runtime import RUNTIME, check_version, decode_of, prefill_of

common_routes = RouteTable()
decode_peer_routes = RouteTable()
prefill_peer_routes = RouteTable()

_NO_CONTENT = 204


@common_routes.get(
    LAYOUT_PATH,
    response=LayoutInfo,
    summary="The stages hosted here: placed layouts, fingerprints, transport target, shm offsets",
    tags=("peer",),
)
async def layout(request: web.Request) -> web.StreamResponse:
    return json_response(request.app[RUNTIME].layout_info())


@common_routes.post(
    HEARTBEATS_PATH,
    request=HeartbeatMsg,
    response=HeartbeatAck,
    errors=(422,),
    summary="A peer sharing live handoffs with this service is alive",
    tags=("peer",),
)
async def heartbeat(request: web.Request) -> web.StreamResponse:
    msg = await decode_body(request, HeartbeatMsg)
    check_version(msg.version)
    runtime = request.app[RUNTIME]
    runtime.heartbeats.heard(msg.sender_url)
    return json_response(HeartbeatAck(role=runtime.role, url=runtime.url))


@prefill_peer_routes.post(
    DESTINATIONS_PATH,
    request=DestinationMsg,
    status=_NO_CONTENT,
    errors=(404, 409, 422),
    summary="Decode → prefill: where one handoff's bytes go",
    tags=("peer",),
)
async def destination(request: web.Request) -> web.StreamResponse:
    msg = await decode_body(request, DestinationMsg)
    check_version(msg.version)
    prefill_of(request).deliver(msg)
    return web.Response(status=_NO_CONTENT)


@prefill_peer_routes.post(
    ABORTS_PATH,
    request=AbortMsg,
    response=AbortAck,
    errors=(422,),
    summary="Decode → prefill: stop a handoff; answers once no write of it can still land",
    tags=("peer",),
)
async def abort(request: web.Request) -> web.StreamResponse:
    msg = await decode_body(request, AbortMsg)
    check_version(msg.version)
    return json_response(await prefill_of(request).abort(msg.handoff_id, msg.reason))


@decode_peer_routes.post(
    ARRIVALS_PATH,
    request=ArrivalMsg,
    status=_NO_CONTENT,
    errors=(404, 422),
    summary="Prefill → decode: every byte of one stage has landed",
    tags=("peer",),
)
async def arrival(request: web.Request) -> web.StreamResponse:
    msg = await decode_body(request, ArrivalMsg)
    check_version(msg.version)
    decode_of(request).arrived(msg)
    return web.Response(status=_NO_CONTENT)


@decode_peer_routes.post(
    STAGE_FAILURES_PATH,
    request=StageFailedMsg,
    status=_NO_CONTENT,
    errors=(404, 422),
    summary="Prefill → decode: one stage failed; no write of it can still land",
    tags=("peer",),
)
async def stage_failed(request: web.Request) -> web.StreamResponse:
    msg = await decode_body(request, StageFailedMsg)
    check_version(msg.version)
    decode_of(request).stage_failed(msg)
    return web.Response(status=_NO_CONTENT)
