"""What routers and engines exchange with the decode side about one handoff: the request that
creates it, the views that answer for it, and what an earlier life of the service recorded.

Built by `kvhandoff.pipelines.decode` (views), decoded by the service's routes (requests), and kept
by the service's records (`HandoffArchive`, `FencedPages`). Nothing here acts; these are the shapes.
"""

from __future__ import annotations

from typing import Annotated, Any, Protocol

from msgspec import Meta, Struct

from kvhandoff.pipelines.events import Event
from kvhandoff.pipelines.slots import RequestSlots
from kvhandoff.pipelines.states import HandoffState, StageState

#: A handoff id is a URL path segment (`/v1/handoffs/{id}`): no "/", and not "." or "..",
#: which standard clients resolve away (RFC 3986 dot-segments). No lookahead: JSON Schema users.
HANDOFF_ID_PATTERN = (
    r"^(?:[A-Za-z0-9._:@-]{3,256}|[A-Za-z0-9_:@-][A-Za-z0-9._:@-]?|\.[A-Za-z0-9_:@-])$"
)
HandoffId = Annotated[str, Meta(min_length=1, max_length=256, pattern=HANDOFF_ID_PATTERN)]
#: A state component's name (`StateEntry.component`), as a key of `dst_slots` / `src_slots`.
Component = Annotated[str, Meta(min_length=1, max_length=64)]


class HandoffRequest(Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Router → decode: move one request's KV cache and state into these decode pages."""

    id: HandoffId  # the router's request id
    # Base URLs of the prefill services hosting the request's PP stages (together, every stage
    # once); empty: the decode service's configured `peers.prefill`.
    prefill: list[Annotated[str, Meta(pattern=r"^https?://")]] = []
    dst_pages: list[Annotated[int, Meta(ge=0)]]
    prefix_pages: Annotated[
        int,
        Meta(
            ge=0,
            description="The request's first pages, which this decode holds already (a prefix "
            "it cached): `dst_pages` are for the request's positions after them, and the "
            "prefill sends those only. 0: every page.",
        ),
    ] = 0
    fan_out: Annotated[
        int,
        Meta(
            ge=1,
            le=256,
            description="How many decode handoffs receive these same bytes from the same prefill "
            "stages, this one included (an engine whose decode ranks each hold a whole copy, "
            "as an MLA model's decode of larger TP does). Carried to the prefill with the "
            "destination, so its engine releases the source pages only once every copy has "
            "them. 1: this handoff alone.",
        ),
    ] = 1
    # The state slot of every component `dst_slots` leaves out (a model of one component: its
    # slot); `dst_slots` per component (`StateEntry.component`); `dst_aux` the request's aux row.
    dst_slot: (
        Annotated[
            int,
            Meta(
                ge=0,
                description="The state slot of every state component `dst_slots` does not name "
                "(a model with one component: its slot).",
            ),
        ]
        | None
    ) = None
    dst_slots: Annotated[
        dict[Component, Annotated[int, Meta(ge=0)]],
        Meta(
            description="The slot of each named state component (`StateEntry.component` of the "
            "decode layout, e.g. an engine's `mamba` pool); an unknown component is refused "
            "(422 naming `dst_slots.<component>`)."
        ),
    ] = {}
    dst_aux: (
        Annotated[
            int,
            Meta(
                ge=0,
                description="The request's aux row: required when the decode layout has aux "
                "entries (per-request metadata rows, sent by the last PP stage).",
            ),
        ]
        | None
    ) = None
    deadline_s: Annotated[float, Meta(gt=0, le=3600)] | None = None
    verify: bool | None = None
    metadata: dict[str, Any] = {}
    #: Receives this handoff's lifecycle events as signed webhooks (the service checks the host).
    callback_url: Annotated[str, Meta(pattern=r"^https?://", max_length=2048)] | None = None

    @property
    def slots(self) -> RequestSlots:
        return RequestSlots(self.dst_slot, self.dst_slots, self.dst_aux)


class StageView(Struct, frozen=True):
    pp_rank: int
    peer: str
    state: StageState
    bytes: int


class ErrorView(Struct, frozen=True, omit_defaults=True):
    code: str
    reason: str
    pp_rank: int | None = None
    context: dict[str, Any] = {}


class HandoffView(Struct, frozen=True, omit_defaults=True):
    """A handoff as a router sees it. `state` is its outcome once terminal; `released` says
    whether its destination pages and slot are free again (a router reschedules on the outcome,
    an engine reuses the pages only once released)."""

    id: str
    state: HandoffState
    created_at: float
    deadline_at: float
    num_pages: int
    dst_slot: int | None
    prefill: list[str]
    verify: bool
    bytes: int
    stages: list[StageView]
    released: bool
    dst_slots: dict[str, int] = {}
    dst_aux: int | None = None
    prefix_pages: int = 0  # the request's first pages, which the decode held already
    finished_at: float | None = None
    released_at: float | None = None
    # "passed", or "skipped: <why>" when verification was asked for and could not run.
    verification: str | None = None
    error: ErrorView | None = None
    metadata: dict[str, Any] = {}
    timeline: list[Event] = []


class HandoffPage(Struct, frozen=True):
    """One page of `GET /v1/handoffs`, in creation order (views without their timelines).
    `next_cursor` is the `cursor` of the next page (opaque), null on the last page."""

    items: list[HandoffView]
    next_cursor: int | None


class HeldHandoff(Struct, frozen=True):
    """A handoff this process holds, as admitted (`DecodePipeline.find`, `.held`): what its
    record is keyed and ordered by. `seq` numbers this life's handoffs in creation order."""

    request: HandoffRequest
    seq: int
    state: HandoffState
    created_at: float
    deadline_at: float


class FencedUse(Struct, frozen=True):
    """A handoff whose outcome is known but whose pages are still leased: its writers are not
    confirmed stopped yet, or (`restored`) an earlier life's, fenced until its bound passes."""

    handoff_id: str
    pages: int
    restored: bool


class PageUse(Struct, frozen=True):
    """The decode pool's pages now (`DecodePipeline.pages`): how many are leased, to live
    handoffs and as fences; the fenced ones by handoff (at most `MAX_FENCED_SHOWN`)."""

    total: int
    leased: int
    live: int
    fenced: int
    fenced_handoffs: list[FencedUse]


MAX_FENCED_SHOWN = 50


class ArchivedHandoff(Struct, frozen=True):
    """A handoff this process does not hold (an earlier process's, or evicted), as recorded."""

    request: HandoffRequest
    view: HandoffView


class HandoffArchive(Protocol):
    """Where the service keeps finished handoffs (`kvhandoff.service.records.handoffs`)."""

    def find(self, handoff_id: str) -> ArchivedHandoff | None: ...


class FencedPages(Struct, frozen=True):
    """Pages and slot an earlier process leased to `handoff_id`, writable by its prefill stages
    until `release_at` (unix seconds): its deadline plus the engine's timeout. `arena`: the
    landing arena (base, bytes) its prefills wrote into, in landed mode (None: direct): its
    pages then changed only by that process's own commits, which died with it (SAFETY.md S1)."""

    handoff_id: str
    dst_pages: list[int]
    dst_slot: int | None
    release_at: float
    dst_slots: dict[str, int] = {}
    dst_aux: int | None = None
    arena: tuple[int, int] | None = None

    @property
    def slots(self) -> RequestSlots:
        return RequestSlots(self.dst_slot, self.dst_slots, self.dst_aux)
