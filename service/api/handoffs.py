"""Router- and engine-facing handoff routes.

On the decode service (the router's side): create, read, list and abort handoffs. On the prefill
service (the engine's side): "stage k of this request is ready", optionally layer by layer. Every
handler is a thin translation: decode the body or query, call the pipeline, encode its answer;
the pipelines raise the error tree, which the app turns into problem+json.
"""

from __future__ import annotations

import re
from typing import Annotated

from aiohttp import web
from msgspec import Meta, Struct

from kvhandoff.pipelines.decode.views import (
    HANDOFF_ID_PATTERN,
    Component,
    HandoffPage,
    HandoffRequest,
    HandoffView,
)
from kvhandoff.pipelines.errors import CapacityExceeded, InvalidInput
from kvhandoff.pipelines.prefill import PrefillPipeline
from kvhandoff.pipelines.slots import RequestSlots
from kvhandoff.pipelines.states import HandoffState
from kvhandoff.pipelines.urls import ServiceUrl
from kvhandoff.service.api.peer import common_routes, decode_peer_routes, prefill_peer_routes
from kvhandoff.service.http.app import CONFIG, ROUTES, decode_body, json_response
from kvhandoff.service.http.routing import RouteTable
from kvhandoff.service.records.listing import handoff_page
from kvhandoff.service.runtime import inputs
from kvhandoff.service.runtime.persistence import PERSISTENCE
from kvhandoff.service.runtime.roles import DECODE, decode_of, prefill_of

_ID = re.compile(HANDOFF_ID_PATTERN)
_ID_SCHEMA = {"type": "string", "pattern": HANDOFF_ID_PATTERN, "maxLength": 256}

#: Longest a `GET /v1/handoffs/{id}?wait_s=` long poll may hold a connection.
MAX_WAIT_S = 60.0
#: Items of one `GET /v1/handoffs` page: by default, and at most.
DEFAULT_LIMIT = 100
MAX_LIMIT = 1000
#: Cursors are `seq`s (`kvhandoff.service.storage.LIFE_SHIFT`), below this.
MAX_CURSOR = 2**62
#: Handoffs a prefill holds that were signalled ready and have no destination yet (README).
MAX_AWAITING_DESTINATION = 4096

decode_routes = RouteTable()
prefill_routes = RouteTable()


def install_handoffs(app: web.Application) -> None:
    """Serve the configured role's handoff and peer routes over its runtime (an `Extension`)."""
    app[ROUTES].include(common_routes)
    if app[CONFIG].role == "decode":
        app[ROUTES].include(decode_routes)
        app[ROUTES].include(decode_peer_routes)
    else:
        app[ROUTES].include(prefill_routes)
        app[ROUTES].include(prefill_peer_routes)


def _handoff_id(request: web.Request) -> str:
    value = request.match_info["id"]
    if not _ID.match(value):
        raise InvalidInput(f"{value!r} is not a valid handoff id", field="id")
    return value


# ------------------------------------------------------------------------ decode (router-facing)


@decode_routes.post(
    "/v1/handoffs",
    request=HandoffRequest,
    response=HandoffView,
    status=201,
    also=(200,),
    errors=(404, 409, 422, 429, 502, 503, 504),
    summary="Create a handoff (idempotent for an identical body; 409 for another body)",
    description="Admits the request as every door does (`kvhandoff.service.runtime.admission`: "
    "URLs, bounds, the metadata size, records writable, the callback policy), checks the "
    "destination pages, slots (`dst_slot`, `dst_slots` per state component) and aux row "
    "(`dst_aux`), fences them, fetches and pairs the "
    "prefill layouts, then sends the destination to every prefill service. Answers 201 for a new "
    "handoff and 200 when the same body was already accepted.",
    tags=("handoffs",),
)
async def create_handoff(request: web.Request) -> web.StreamResponse:
    body = await decode_body(request, HandoffRequest)
    view, created = await request.app[DECODE].create(body)
    return json_response(
        view,
        status=201 if created else 200,
        headers={"Location": f"/v1/handoffs/{view.id}"},
    )


@decode_routes.get(
    "/v1/handoffs/{id}",
    response=HandoffView,
    errors=(404, 422),
    summary="One handoff: state, per-stage progress, bytes, error and event timeline",
    description="With `?wait_s=S` (at most 60), answers as soon as the handoff has its outcome "
    "(`state` completed, failed or aborted: what a router reschedules on), or after S seconds "
    "with its current state: a router's long poll. With `&until=released` it waits instead for "
    "`released` (the destination pages and slot are free: what an engine must see before it "
    "reuses them).",
    tags=("handoffs",),
    path_schemas={"id": _ID_SCHEMA},
    query=(
        ("wait_s", {"type": "number", "minimum": 0, "maximum": MAX_WAIT_S}),
        ("until", {"type": "string", "enum": ["outcome", "released"]}),
    ),
)
async def get_handoff(request: web.Request) -> web.StreamResponse:
    handoff_id = _handoff_id(request)
    wait_s = inputs.query_number(request.query, "wait_s", 0.0, 0.0, MAX_WAIT_S, float)
    until = request.query.get("until", "outcome")
    if until not in ("outcome", "released"):
        raise InvalidInput(f"until={until!r} is not one of outcome, released", field="until")
    pipeline = decode_of(request)
    view = (
        await pipeline.wait(handoff_id, wait_s, released=until == "released")
        if wait_s
        else pipeline.get(handoff_id)
    )
    return json_response(view)


@decode_routes.get(
    "/v1/handoffs",
    response=HandoffPage,
    errors=(422,),
    summary="Handoffs in creation order, optionally of one state; paginated by cursor",
    description="Every handoff `GET /v1/handoffs/{id}` answers for, once each: those this "
    "process holds and, where records persist, those its records keep from earlier lives of "
    "the service (each as the single GET answers, without the timeline). Query: `state` "
    "(pending, transferring, completed, failed, aborted), `limit` (1..1000, default 100), "
    "`cursor` (the previous page's `next_cursor`, opaque; null on the last page). The order "
    "is creation order and stays put across restarts: a later life's handoffs come after an "
    "earlier one's, so paging goes on where it was after a restart.",
    tags=("handoffs",),
    query=(
        ("state", {"type": "string", "enum": [s.value for s in HandoffState]}),
        ("limit", {"type": "integer", "minimum": 1, "maximum": MAX_LIMIT}),
        ("cursor", {"type": "integer", "minimum": 0, "maximum": MAX_CURSOR}),
    ),
)
async def list_handoffs(request: web.Request) -> web.StreamResponse:
    raw_state = request.query.get("state")
    state = None
    if raw_state is not None:
        try:
            state = HandoffState(raw_state)
        except ValueError:
            choices = ", ".join(s.value for s in HandoffState)
            raise InvalidInput(
                f"state={raw_state!r} is not one of {choices}", field="state"
            ) from None
    limit = int(inputs.query_number(request.query, "limit", DEFAULT_LIMIT, 1, MAX_LIMIT))
    cursor = int(inputs.query_number(request.query, "cursor", 0, 0, MAX_CURSOR))
    persistence = request.app.get(PERSISTENCE)
    if persistence is None:  # records off: this process's handoffs are all there is
        return json_response(decode_of(request).page(state, limit, cursor))
    page = handoff_page(decode_of(request), persistence.records, state, limit, cursor)
    return json_response(page)


@decode_routes.delete(
    "/v1/handoffs/{id}",
    response=HandoffView,
    errors=(404, 409, 422),
    summary="Abort a handoff; answers once its pages are released (no write of it can land)",
    description="The outcome `aborted` is announced at once (`handoff.aborted`), the answer "
    "comes after `handoff.released`. On a failed handoff whose pages are not released yet, it "
    "retries stopping the prefill stages now and answers once released, instead of 409. 409 for "
    "a completed handoff, or a failed one already released.",
    tags=("handoffs",),
    path_schemas={"id": _ID_SCHEMA},
)
async def abort_handoff(request: web.Request) -> web.StreamResponse:
    handoff_id = _handoff_id(request)
    return json_response(await decode_of(request).abort(handoff_id, "aborted by request"))


# ------------------------------------------------------------------------ prefill (engine-facing)

NonNeg = Annotated[int, Meta(ge=0)]


class StageReady(Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Engine → prefill: stage `pp_rank` finished (some of) its layers, or (with `pages_from`)
    the next range of its pages, for this request."""

    #: Source pages of the request on this stage; required on the stage's first signal. With
    #: `pages_from`: the pages of this range only (the last range may be empty).
    src_pages: list[NonNeg] | None = None
    #: The request's linear-attention state slot (hybrid models): the slot of every state
    #: component `src_slots` leaves out; by page range, only with the last range.
    src_slot: NonNeg | None = None
    #: The slot of each named state component (a layout's `StateEntry.component`), where
    #: components have slots of their own; by page range, only with the last range.
    src_slots: Annotated[
        dict[Component, NonNeg],
        Meta(
            description="The slot of each named state component, where components have "
            "slots of their own (`src_slot` is the slot of the others); by page range, only "
            "with the last range."
        ),
    ] = {}
    #: The request's aux row (per-request metadata entries, the last PP stage only); by page
    #: range, only with the last range.
    src_aux: (
        Annotated[
            int,
            Meta(
                ge=0,
                description="The request's aux row, on the last PP stage of a layout with aux "
                "entries; by page range, only with the last range.",
            ),
        ]
        | None
    ) = None
    #: Global layer ids now ready; absent: every layer of the stage not signalled yet.
    layers: list[NonNeg] | None = None
    #: The decode service this request's handoff belongs to (its public URL, as its
    #: destination names it). Handoff ids are unique per decode only: with it, two decodes
    #: may use the same id; without it, the id must be unique across the decodes using this
    #: prefill (a ready whose id two of them use is refused with 409).
    decode_url: ServiceUrl | None = None
    #: Chunked prefill: `src_pages` are the request's pages from this position on, ready for
    #: every layer of the stage. Ranges come in order, without gaps or overlaps.
    pages_from: NonNeg | None = None
    #: With `pages_from`, required: this range is the stage's last (the slots come with it).
    last_pages: bool | None = None


class StageReadyAck(Struct, frozen=True, omit_defaults=True):
    handoff_id: str
    pp_rank: int
    layers: list[int] | None
    pages_from: int | None = None
    last_pages: bool | None = None


@prefill_routes.post(
    "/v1/handoffs/{id}/stages/{pp_rank}/ready",
    request=StageReady,
    response=StageReadyAck,
    status=202,
    errors=(404, 409, 422, 429),
    summary="Stage pp_rank has finished this request (all layers, those listed, or a page range)",
    description="The first signal of a stage carries its source pages (and its slots: `src_slot`, "
    "`src_slots` per state component, `src_aux` on the last stage of a layout with aux "
    "entries). Chunks of the listed layers are sent as soon as the decode destination is known. "
    "Chunked prefill: each signal with `pages_from` brings the next pages (`last_pages` on the "
    "last, with the slots), sent as it comes.",
    tags=("engine",),
    role="engine",
    path_schemas={
        "id": _ID_SCHEMA,
        "pp_rank": {"type": "string", "pattern": "^[0-9]{1,9}$"},
    },
)
async def stage_ready(request: web.Request) -> web.StreamResponse:
    handoff_id = _handoff_id(request)
    rank = inputs.ascii_int(request.match_info["pp_rank"], "pp_rank")
    body = await decode_body(request, StageReady)
    return json_response(signal_ready(prefill_of(request), handoff_id, rank, body), status=202)


def signal_ready(
    pipeline: PrefillPipeline,
    handoff_id: str,
    rank: int,
    body: StageReady,
    id_field: str = "id",
) -> StageReadyAck:
    """One stage's ready signal, checked as every door checks it (`POST .../ready` and each
    item of `POST /v1/stages/ready`); raises the error tree having changed nothing. `id_field`
    names the handoff id where the caller gave it (the path's `id`, a batch item's
    `handoff_id`)."""
    inputs.pages(body.src_pages or (), "src_pages")
    inputs.slots(body.src_slot, body.src_slots, body.src_aux, "src")
    if (
        not pipeline.query.holds(handoff_id)
        and pipeline.query.open_count() >= MAX_AWAITING_DESTINATION
    ):
        awaiting = pipeline.query.awaiting_destination()
        if awaiting >= MAX_AWAITING_DESTINATION:
            # A ready signal opens a handoff that waits for its destination until its deadline:
            # bounded, so an engine (or its credential) cannot grow the prefill without end.
            raise CapacityExceeded(
                f"{awaiting} handoffs signalled ready here wait for their destination, the most "
                "this service holds; retry once the decode service has sent theirs",
                field=id_field,
                limit=MAX_AWAITING_DESTINATION,
            )
    pipeline.ready(
        handoff_id,
        rank,
        body.src_pages,
        RequestSlots(body.src_slot, body.src_slots, body.src_aux),
        body.layers,
        decode_url=body.decode_url,
        pages_from=body.pages_from,
        last_pages=body.last_pages,
    )
    return StageReadyAck(handoff_id, rank, body.layers, body.pages_from, body.last_pages)
