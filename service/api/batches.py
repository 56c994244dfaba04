"""Batch routes: many creates (decode, router-facing) or many stage readies (prefill,
engine-facing) in one request, as a router admits many requests per tick and an engine finishes
a whole forward batch at once.

Each item is what its single route takes (`POST /v1/handoffs`, `POST .../stages/{r}/ready`),
checked and applied by the same code with the same rules (admission, idempotency, bounds; the
route takes the single route's credential), and answered on its own: its status and body, or
its problem+json whose `field` starts with `items[<index>]` and whose `index` is the item's. An
item's bad input changes nothing and fails no other item; an item whose handling raises outside
the error tree (a bug) is logged and answered 500 alone, the others keep their answers. At most
`MAX_BATCH_ITEMS` items.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Annotated, Any

import msgspec
from aiohttp import web
from msgspec import Meta, Struct

from kvhandoff.pipelines.decode.views import HandoffId, HandoffRequest, HandoffView
from kvhandoff.pipelines.errors import InvalidInput, KVHandoffError
from kvhandoff.service.api.handoffs import NonNeg, StageReady, StageReadyAck, signal_ready
from kvhandoff.service.http.app import CONFIG, ROUTES, decode_body, decode_items, json_response
from kvhandoff.service.http.problems import error_problem, problem_body
from kvhandoff.service.http.routing import RouteTable
from kvhandoff.service.runtime.roles import DECODE, prefill_of

log = logging.getLogger("kvhandoff.service")

#: Items of one batch, at most (a 422 naming `items` past it).
MAX_BATCH_ITEMS = 256

_Items = Annotated[
    list[msgspec.Raw],
    Meta(min_length=1, max_length=MAX_BATCH_ITEMS, description="1..256 items"),
]

decode_batch_routes = RouteTable()
prefill_batch_routes = RouteTable()


def install_batches(app: web.Application) -> None:
    """Serve the configured role's batch routes (an `Extension`)."""
    role = app[CONFIG].role
    app[ROUTES].include(decode_batch_routes if role == "decode" else prefill_batch_routes)


class _RawBatch(Struct, frozen=True, forbid_unknown_fields=True):
    items: _Items


# The documented bodies: each item an object checked on its own against its single route's
# schema, so an item that breaks it is one item's 422, not a request the API refuses whole.
_CreateItem = Annotated[
    dict[str, Any],
    Meta(
        description="One handoff as `POST /v1/handoffs` takes it (schema `HandoffRequest`), "
        "checked on its own: an item that breaks that schema is answered 422 alone."
    ),
]
_ReadyItem = Annotated[
    dict[str, Any],
    Meta(
        description="One stage's ready signal as `POST /v1/handoffs/{id}/stages/{pp_rank}/"
        "ready` takes it (schema `StageReady`) plus `handoff_id` and `pp_rank` (schema "
        "`StageReadyItem`), checked on its own: an item that breaks that schema is answered "
        "422 alone."
    ),
]


class HandoffBatch(Struct, frozen=True, forbid_unknown_fields=True):
    """Router → decode: handoffs to create, each as `POST /v1/handoffs` takes it."""

    items: Annotated[list[_CreateItem], Meta(min_length=1, max_length=MAX_BATCH_ITEMS)]


class CreateResult(Struct, frozen=True, omit_defaults=True):
    """One item's answer: `status` 201 (created) or 200 (this very request was already
    accepted) with its `view`, or an error status with its `problem`."""

    status: int
    view: HandoffView | None = None
    problem: dict[str, Any] | None = None


class HandoffBatchResult(Struct, frozen=True):
    items: list[CreateResult]


class StageReadyItem(StageReady, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """One stage's ready signal, as `POST /v1/handoffs/{id}/stages/{pp_rank}/ready` takes it,
    with the path's handoff id and stage."""

    handoff_id: HandoffId
    pp_rank: NonNeg


class StageReadyBatch(Struct, frozen=True, forbid_unknown_fields=True):
    """Engine → prefill: stages ready, in the order the engine signals them."""

    items: Annotated[list[_ReadyItem], Meta(min_length=1, max_length=MAX_BATCH_ITEMS)]


class ReadyResult(Struct, frozen=True, omit_defaults=True):
    """One item's answer: `status` 202 with its `ack`, or an error status with its `problem`."""

    status: int
    ack: StageReadyAck | None = None
    problem: dict[str, Any] | None = None


class StageReadyBatchResult(Struct, frozen=True):
    items: list[ReadyResult]


def objects(items: list[msgspec.Raw]) -> list[msgspec.Raw]:
    """The batch's items, each a JSON object (kept undecoded until its own check,
    `decode_items`): anything else is no route's item, and the batch is refused whole (422
    naming the item), as its schema says."""
    for index, raw in enumerate(items):
        if bytes(raw).lstrip()[:1] != b"{":
            raise InvalidInput(f"items[{index}] is not an object", field=f"items[{index}]")
    return items


def item_problem(error: KVHandoffError, index: int, instance: str) -> tuple[int, dict[str, Any]]:
    """The problem of item `index`: its `field` prefixed with `items[index]`, and `index`."""
    status, problem = error_problem(error, instance)
    field = problem.get("field")
    prefix = f"items[{index}]"
    problem["field"] = f"{prefix}.{field}" if field and field != "$" else prefix
    problem["index"] = index
    return status, problem


def item_crash(index: int, instance: str) -> tuple[int, dict[str, Any]]:
    """The 500 problem of item `index` whose handling raised outside the error tree (a bug,
    logged by the caller): answered alone, so the items done beside it keep their answers."""
    prefix = f"items[{index}]"
    detail = "an unexpected error occurred; see the service log"
    extra = {"field": prefix, "index": index}
    return 500, problem_body(
        status=500, code="internal_error", detail=detail, instance=instance, extra=extra
    )


@decode_batch_routes.post(
    "/v1/handoff-batches",
    request=HandoffBatch,
    response=HandoffBatchResult,
    errors=(422,),
    summary="Create many handoffs at once (one answer per item, in order)",
    description="Each item is created as `POST /v1/handoffs` creates it (admission, bounds, "
    "idempotency: 201 created, 200 already accepted with the same body, 409 another body), "
    "side by side, and answered on its own: `status` and `view`, or `status` and `problem` "
    "(problem+json whose `field` starts with `items[<index>]`). A bad item changes nothing "
    "and fails no other. 200 once every item is answered; 422 for a body that is not a batch "
    "of 1..256 items.",
    tags=("handoffs",),
)
async def create_handoffs(request: web.Request) -> web.StreamResponse:
    batch = await decode_body(request, _RawBatch)
    runtime = request.app[DECODE]
    path = request.path

    async def one(index: int, item: HandoffRequest | InvalidInput) -> CreateResult:
        try:
            if isinstance(item, InvalidInput):
                raise item
            view, created = await runtime.create(item)
        except KVHandoffError as error:
            status, problem = item_problem(error, index, path)
            return CreateResult(status, problem=problem)
        except Exception:
            log.exception("unhandled error in item %d of %s", index, path)
            status, problem = item_crash(index, path)
            return CreateResult(status, problem=problem)
        return CreateResult(201 if created else 200, view)

    items = decode_items(objects(batch.items), HandoffRequest)
    results = await asyncio.gather(*(one(i, item) for i, item in enumerate(items)))
    return json_response(HandoffBatchResult(list(results)))


@prefill_batch_routes.post(
    "/v1/stages/ready",
    request=StageReadyBatch,
    response=StageReadyBatchResult,
    errors=(422,),
    summary="Many stages ready at once: a forward batch's requests (one answer per item)",
    description="Each item is a `POST /v1/handoffs/{id}/stages/{pp_rank}/ready` with its "
    "`handoff_id` and `pp_rank` in the body, applied in order with the same rules (the bound "
    "on handoffs awaiting their destination included) and answered on its own: `status` 202 "
    "and `ack`, or `status` and `problem` (problem+json whose `field` starts with "
    "`items[<index>]`). A bad item changes nothing and fails no other. 422 for a body that "
    "is not a batch of 1..256 items.",
    tags=("engine",),
    role="engine",
)
async def stages_ready(request: web.Request) -> web.StreamResponse:
    batch = await decode_body(request, _RawBatch)
    pipeline = prefill_of(request)
    results = []
    for index, item in enumerate(decode_items(objects(batch.items), StageReadyItem)):
        try:
            if isinstance(item, InvalidInput):
                raise item
            ack = signal_ready(pipeline, item.handoff_id, item.pp_rank, item, "handoff_id")
        except KVHandoffError as error:
            status, problem = item_problem(error, index, request.path)
            results.append(ReadyResult(status, problem=problem))
        except Exception:
            log.exception("unhandled error in item %d of %s", index, request.path)
            status, problem = item_crash(index, request.path)
            results.append(ReadyResult(status, problem=problem))
        else:
            results.append(ReadyResult(202, ack))
    return json_response(StageReadyBatchResult(results))
