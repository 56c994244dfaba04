"""Router-facing webhook routes (decode role): endpoints, their deliveries, manual retries.

`install_webhooks(app)` (an `Extension`) serves these routes over the decode runtime's records
and outbox (`kvhandoff.service.runtime.persistence`). Handlers decode,
call the outbox or dispatcher, and encode; the delivery machinery lives in
`kvhandoff.service.runtime`.
"""

from __future__ import annotations

from typing import Annotated, get_args

from aiohttp import web
from msgspec import Meta, Struct

from kvhandoff.pipelines.errors import ConflictError, InvalidInput
from kvhandoff.service.http.app import CONFIG, ROUTES, decode_body, json_response
from kvhandoff.service.http.routing import RouteTable
from kvhandoff.service.runtime import inputs
from kvhandoff.service.runtime.persistence import persistence_of
from kvhandoff.service.webhooks.signatures import secret_key
from kvhandoff.service.webhooks.views import (
    DeliveryPage,
    DeliveryState,
    DeliveryView,
    EndpointCreated,
    EndpointView,
    TypePrefix,
)

routes = RouteTable()

#: Registered endpoints one decode service keeps (README, "Webhooks"); a create beyond is a 409.
MAX_ENDPOINTS = 1000


def install_webhooks(app: web.Application) -> None:
    """On the decode role: the webhook routes (the records and outbox behind them are the decode
    runtime's, `kvhandoff.service.runtime.roles`)."""
    if app[CONFIG].role == "decode":
        app[ROUTES].include(routes)


class EndpointRequest(Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Router → decode: deliver events to this URL."""

    url: Annotated[str, Meta(pattern=r"^https?://", max_length=2048)]
    #: Event type prefixes ("handoff.", "handoff.completed", "stage."); empty: every event.
    types: list[TypePrefix] = []
    #: "whsec_" + base64 of at least 16 bytes; generated (and returned once) when absent.
    secret: str | None = None
    description: Annotated[str, Meta(max_length=512)] = ""


class EndpointList(Struct, frozen=True):
    items: list[EndpointView]


_STATES: tuple[str, ...] = get_args(DeliveryState)


@routes.post(
    "/v1/webhooks",
    request=EndpointRequest,
    response=EndpointCreated,
    status=201,
    errors=(409,),
    summary="Register a webhook endpoint; the answer holds its signing secret, shown once",
    description="Deliveries follow the Standard Webhooks specification (`webhook-id`, "
    "`webhook-timestamp`, `webhook-signature: v1,<base64 HMAC-SHA256>`), at least once, from a "
    "persistent outbox. Loopback and private targets are refused unless "
    "`webhooks.allow_private` is set; `webhooks.allow_hosts` restricts hosts.",
    tags=("webhooks",),
)
async def create_endpoint(request: web.Request) -> web.StreamResponse:
    body = await decode_body(request, EndpointRequest)
    p = persistence_of(request)
    if p.outbox.registered_count >= MAX_ENDPOINTS:
        # Each endpoint is a delivery lane fed every event it selects: bounded, like all else.
        raise ConflictError(
            f"{MAX_ENDPOINTS} webhook endpoints are registered, the most this service keeps; "
            "delete one first",
            field="url",
            limit=MAX_ENDPOINTS,
        )
    if body.secret is not None:
        try:
            secret_key(body.secret)
        except ValueError as exc:
            raise InvalidInput(str(exc), field="secret") from None
    await p.dispatcher.policy.check(body.url, "url")
    created = p.outbox.create_endpoint(
        body.url, list(body.types), body.secret, body.description, p.clock()
    )
    return json_response(created, status=201, headers={"Location": f"/v1/webhooks/{created.id}"})


@routes.get(
    "/v1/webhooks",
    response=EndpointList,
    errors=(409,),
    summary="Registered webhook endpoints (without their secrets)",
    tags=("webhooks",),
)
async def list_endpoints(request: web.Request) -> web.StreamResponse:
    return json_response(EndpointList(persistence_of(request).outbox.list_endpoints()))


@routes.get(
    "/v1/webhooks/{id}",
    response=EndpointView,
    errors=(404, 409),
    summary="One webhook endpoint (a `callback_url`'s too), with why it was disabled",
    tags=("webhooks",),
)
async def get_endpoint(request: web.Request) -> web.StreamResponse:
    return json_response(persistence_of(request).outbox.endpoint(request.match_info["id"]))


@routes.delete(
    "/v1/webhooks/{id}",
    response=None,
    status=204,
    errors=(404, 409),
    summary="Delete a webhook endpoint and its deliveries (pending ones are not sent)",
    tags=("webhooks",),
)
async def delete_endpoint(request: web.Request) -> web.StreamResponse:
    p = persistence_of(request)
    endpoint_id = request.match_info["id"]
    p.outbox.delete_endpoint(endpoint_id)
    p.dispatcher.drop(endpoint_id)
    return web.Response(status=204)


@routes.get(
    "/v1/webhooks/{id}/deliveries",
    response=DeliveryPage,
    errors=(404, 409, 422),
    summary="Deliveries to one endpoint, newest first, each with its attempts",
    description="Query: `state` (pending, delivered, failed, cancelled), `limit` (1..1000, "
    "default 100), `cursor` (the previous page's `next_cursor`). Each attempt lists its HTTP "
    "status (absent when no response came), latency and error.",
    tags=("webhooks",),
)
async def list_deliveries(request: web.Request) -> web.StreamResponse:
    raw_state = request.query.get("state")
    if raw_state is not None and raw_state not in _STATES:
        raise InvalidInput(f"state={raw_state!r} is not one of {', '.join(_STATES)}", field="state")
    limit = int(inputs.query_number(request.query, "limit", 100, 1, 1000))
    cursor = int(inputs.query_number(request.query, "cursor", 0, 0, 2**62))
    page = persistence_of(request).outbox.deliveries(
        request.match_info["id"],
        raw_state,  # type: ignore[arg-type]  # checked against DeliveryState above
        limit,
        cursor,
    )
    return json_response(page)


@routes.post(
    "/v1/webhooks/{id}/deliveries/{delivery_id}/retry",
    response=DeliveryView,
    status=202,
    errors=(404, 409, 422),
    summary="Send one delivery again now (with fresh attempt and age ceilings)",
    tags=("webhooks",),
)
async def retry_delivery(request: web.Request) -> web.StreamResponse:
    raw = request.match_info["delivery_id"]
    # ASCII digits below SQLite's 2**63: `isdigit()` takes "²" (which int() refuses) and a
    # larger number overflows the query; both were a 500.
    if not (raw.isascii() and raw.isdigit() and len(raw) <= 19 and int(raw) < 2**63):
        raise InvalidInput(
            f"delivery_id {raw!r} is not a positive integer below 2**63", field="delivery_id"
        )
    p = persistence_of(request)
    endpoint_id = request.match_info["id"]
    delivery = p.outbox.retry(endpoint_id, int(raw), p.clock())
    p.dispatcher.add([delivery])
    page = p.outbox.deliveries(endpoint_id, None, 1, delivery.id + 1)
    return json_response(page.items[0], status=202)
