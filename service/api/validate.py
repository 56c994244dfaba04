"""`POST /v1/validate`: the dry-run pairing report for a PP prefill and a decode layout.

Routers and operators call it before deploying a prefill/decode pair: it pairs every prefill
stage with the decode layout by global layer id and lists every problem (missing or duplicated
layers, item-length and slot-size mismatches, page size/dtype, uncovered decode entries) without
moving a byte. Each side is given by its layouts (as `GET /v1/layout` publishes them) or by the
addresses of its services, whose layouts this service then fetches; on a decode service the
decode side defaults to this service itself.
"""

from __future__ import annotations

from typing import Annotated

from aiohttp import web
from msgspec import Meta, Struct

from kvhandoff.pipelines.errors import InvalidInput, KVHandoffError
from kvhandoff.pipelines.layout import StageLayout
from kvhandoff.pipelines.messages import LayoutInfo
from kvhandoff.pipelines.pairing_report import PairingReport, pairing_report
from kvhandoff.pipelines.peer_calls import LAYOUT
from kvhandoff.service.http.app import PEERS, ROUTES, decode_body, json_response
from kvhandoff.service.http.routing import RouteTable
from kvhandoff.service.runtime import inputs
from kvhandoff.service.runtime.roles import DECODE

Url = Annotated[str, Meta(pattern=r"^https?://")]

#: Most distinct prefill services or stage layouts one report covers (PP sizes are far smaller);
#: repeated URLs are fetched once, so a long list of one URL costs one fetch.
MAX_PREFILL = 64


class ValidateRequest(Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    #: The prefill side: its stage layouts (one per PP stage) ...
    prefill: list[StageLayout] = []
    #: ... or the URLs of its services (every stage they host is validated).
    prefill_urls: list[Url] = []
    #: The decode side: its layout, or its service's URL; neither: this (decode) service.
    decode: StageLayout | None = None
    decode_url: Url | None = None


routes = RouteTable()


@routes.post(
    "/v1/validate",
    request=ValidateRequest,
    response=PairingReport,
    status=200,
    errors=(400, 422, 502, 504),
    summary="Pair prefill stage layouts with a decode layout and report every problem",
    description="Give each side by layouts (`prefill`, `decode`) or by service URLs "
    "(`prefill_urls`, `decode_url`); on a decode service the decode side defaults to itself. "
    f"Repeated URLs are fetched once; at most {MAX_PREFILL} distinct URLs or layouts.",
    tags=("validation",),
)
async def validate(request: web.Request) -> web.StreamResponse:
    body = await decode_body(request, ValidateRequest)
    if bool(body.prefill) == bool(body.prefill_urls):
        raise InvalidInput(
            "give the prefill side either as `prefill` layouts or as `prefill_urls`",
            field="prefill",
        )
    if body.decode is not None and body.decode_url is not None:
        raise InvalidInput("give either `decode` or `decode_url`, not both", field="decode")
    if len(body.prefill) > MAX_PREFILL:
        raise InvalidInput(
            f"{len(body.prefill)} prefill layouts; at most {MAX_PREFILL}", field="prefill"
        )
    urls: dict[str, int] = {}  # each distinct URL once, first index kept for error messages
    for i, url in enumerate(body.prefill_urls):
        urls.setdefault(inputs.peer_url(url, f"prefill_urls[{i}]"), i)
    if len(urls) > MAX_PREFILL:
        raise InvalidInput(
            f"{len(urls)} distinct prefill_urls; at most {MAX_PREFILL}", field="prefill_urls"
        )
    if body.decode_url is not None:
        inputs.peer_url(body.decode_url, "decode_url")
    prefill = list(body.prefill)
    for url, i in urls.items():
        info = await _layout_of(request, url, f"prefill_urls[{i}]")
        prefill.extend(stage.layout for stage in info.stages)
    decode = body.decode
    if decode is None:
        decode = await _decode_side(request, body.decode_url)
    return json_response(pairing_report(prefill, decode))


async def _decode_side(request: web.Request, url: str | None) -> StageLayout:
    if url is None:
        runtime = request.app.get(DECODE)
        if runtime is None:
            raise InvalidInput(
                "give the decode side as `decode` or `decode_url` (this is not a decode service)",
                field="decode",
            )
        return runtime.hosted[0].layout
    info = await _layout_of(request, url, "decode_url")
    if info.role != "decode" or not info.stages:
        raise InvalidInput(f"{url} is a {info.role} service", field="decode_url")
    return info.stages[0].layout


async def _layout_of(request: web.Request, url: str, field: str) -> LayoutInfo:
    try:
        return await request.app[PEERS].get(url, LAYOUT.path, LayoutInfo)
    except KVHandoffError as exc:
        exc.context.setdefault("field", field)
        raise


def install_validate(app: web.Application) -> None:
    app[ROUTES].include(routes)
