"""The webhook API's answers: endpoints, deliveries and their attempts, as msgspec Structs.

Built by the outbox (`kvhandoff.service.webhooks.outbox`) from its rows and served by the webhook
routes (`kvhandoff.service.api.webhooks`), whose OpenAPI document describes them from these types.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from msgspec import Meta, Struct

DeliveryState = Literal["pending", "delivered", "failed", "cancelled"]

#: Event type prefixes in an endpoint's `types`.
TypePrefix = Annotated[str, Meta(min_length=1, max_length=64, pattern=r"^[a-z_.]+$")]


class EndpointView(Struct, frozen=True, omit_defaults=True, kw_only=True):
    id: str
    url: str
    #: Event type prefixes delivered ("handoff.", "stage.arrived"); empty: every event.
    types: list[str]
    description: str = ""
    #: Set for a handoff's `callback_url`: only that handoff's events.
    handoff_id: str | None = None
    created_at: float
    disabled_at: float | None = None
    disabled_reason: str | None = None


class EndpointCreated(EndpointView, frozen=True, kw_only=True):
    #: The signing secret; shown here once, never again.
    secret: str


class AttemptView(Struct, frozen=True, omit_defaults=True):
    n: int
    at: float  # when it started (unix seconds)
    latency_s: float
    status: int | None = None  # the HTTP status; None when no response came
    error: str | None = None


class DeliveryView(Struct, frozen=True, omit_defaults=True, kw_only=True):
    id: int
    webhook_id: str
    type: str
    handoff_id: str
    state: DeliveryState
    attempts: int
    created_at: float
    next_at: float | None = None
    finished_at: float | None = None
    last_status: int | None = None
    last_error: str | None = None
    history: list[AttemptView] = []


class DeliveryPage(Struct, frozen=True):
    items: list[DeliveryView]
    next_cursor: int | None


def delivery_view(row: tuple[Any, ...], msg_id: str, history: list[AttemptView]) -> DeliveryView:
    did, _, tag, hid, state, attempts, created, next_at, finished, last_status, last_error = row
    return DeliveryView(
        id=did,
        webhook_id=msg_id,
        type=tag,
        handoff_id=hid,
        state=state,
        attempts=attempts,
        created_at=created,
        next_at=next_at if state == "pending" else None,
        finished_at=finished,
        last_status=last_status,
        last_error=last_error,
        history=history,
    )


def endpoint_view(row: tuple[Any, ...]) -> EndpointView:
    eid, url, types, description, handoff_id, created_at, disabled_at, reason = row
    return EndpointView(
        id=eid,
        url=url,
        types=json.loads(types),
        description=description,
        handoff_id=handoff_id,
        created_at=created_at,
        disabled_at=disabled_at,
        disabled_reason=reason,
    )
