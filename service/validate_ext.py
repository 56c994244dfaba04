"""`POST /v1/validate`: the dry-run pairing report for a PP prefill and a decode layout.

Routers and operators call it before deploying a prefill/decode pair: it pairs every prefill
stage with the decode layout by global layer id and lists every problem (missing or duplicated
layers, item-length and slot-size mismatches, page size/dtype, uncovered decode entries) without
moving a byte. Layouts come in the body (as `GET /v1/layout` publishes them).
"""

from __future__ import annotations

from typing import Annotated

from aiohttp import web
from msgspec import Meta, Struct

from pipelines.layout import StageLayout
from pipelines.pairing import PairingReport, pairing_report
from service.app import ROUTES, decode_body, json_response
from service.routing import RouteTable


class ValidateRequest(Struct, frozen=True, forbid_unknown_fields=True):
    prefill: Annotated[list[StageLayout], Meta(min_length=1)]  # one layout per PP stage
    decode: StageLayout


routes = RouteTable()


@routes.post(
    "/v1/validate",
    request=ValidateRequest,
    response=PairingReport,
    status=200,
    errors=(400, 422),
    summary="Pair prefill stage layouts with a decode layout and report every problem",
    tags=("validation",),
)
async def validate(request: web.Request) -> web.StreamResponse:
    body = await decode_body(request, ValidateRequest)
    return json_response(pairing_report(body.prefill, body.decode))


def install_validate(app: web.Application) -> None:
    app[ROUTES].include(routes)
