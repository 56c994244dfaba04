"""Page-range ready signals (chunked prefill): the checks one signal must pass before the
prefill pipeline (`pipeline.py`, `PrefillPipeline.ready`) records it.

A stage signalled by page range receives the request's pages range by range, each ready for
every layer of the stage, in order without gaps or overlaps, the slots and aux row only with
the last. Each
check costs in proportion to the range: its own pages against the stage's pools, its position
against the stage's ranges so far, its end against the decode's page count when the destination
is known (otherwise the landed sender checks it when the destination comes, failing the stage
naming the same field: `StagePacker.make_pages_ready`).
"""

from __future__ import annotations

from collections.abc import Collection

import numpy as np

from kvhandoff.pipelines.errors import InvalidInput
from kvhandoff.pipelines.messages import DestinationMsg
from kvhandoff.pipelines.planning import validate_pages_for_layout
from kvhandoff.pipelines.prefill.handoff import I64, HostedStage, StageInput, request_pages
from kvhandoff.pipelines.slots import RequestSlots


def check_range(
    handoff_id: str,
    pp_rank: int,
    stage: HostedStage,
    current: StageInput | None,
    dest: DestinationMsg | None,
    src_pages: Collection[int] | I64 | None,
    src_slots: RequestSlots,
    layers: Collection[int] | None,
    pages_from: int | None,
    last_pages: bool | None,
) -> tuple[I64, int, int, bool]:
    """The range's pages, its start and end positions and whether it is the last; raises
    InvalidInput (PlanError for a page outside the pool) naming the field."""

    def refuse(field: str, why: str) -> InvalidInput:
        return InvalidInput(
            f"stage {pp_rank} of handoff {handoff_id!r}: {why}", field=field, pp_rank=pp_rank
        )

    problem = _signal_problem(src_pages, src_slots, layers, pages_from, last_pages)
    if problem is None:
        problem = _order_problem(current, pages_from)
    if problem is not None:
        raise refuse(*problem)
    assert src_pages is not None and pages_from is not None and last_pages is not None
    pages = validate_pages_for_layout(
        stage.layout,
        np.asarray(src_pages),
        src_slots,
        side="source",
        unique=False,
        with_slot=last_pages,
    )
    end = pages_from + int(pages.shape[0])
    if dest is not None and pp_rank in dest.pp_ranks:
        problem = _fit_problem(dest, end, last_pages)
        if problem is not None:
            raise refuse(*problem)
    return pages, pages_from, end, last_pages


def _signal_problem(
    src_pages: Collection[int] | I64 | None,
    src_slots: RequestSlots,
    layers: Collection[int] | None,
    pages_from: int | None,
    last_pages: bool | None,
) -> tuple[str, str] | None:
    """(field, why) when the signal itself is not a page range's: what it must and must not
    carry."""
    if pages_from is None:
        return "pages_from", "last_pages belongs to a page-range signal: give pages_from"
    if last_pages is None:
        return "last_pages", "a page-range signal says whether it is the last"
    if pages_from < 0:
        return "pages_from", f"pages_from = {pages_from} is negative"
    if layers is not None:
        return "layers", "a page range is ready for every layer: leave layers out"
    if src_pages is None:
        return "src_pages", "a page-range signal carries its pages (the last may be [])"
    if not src_slots.empty and not last_pages:
        field = "src_aux" if src_slots.aux is not None else "src_slot"
        if src_slots.by_component:
            field = f"src_slots.{sorted(src_slots.by_component)[0]}"
        return field, "the slots and the aux row come with the last page range only"
    return None


def _order_problem(current: StageInput | None, pages_from: int | None) -> tuple[str, str] | None:
    """(field, why) when the range does not follow the stage's ranges so far."""
    if current is not None and not current.ranged:
        return "pages_from", "it is signalled by layer, not by page range"
    if current is not None and current.ended:
        return "pages_from", "its last page range was already signalled"
    at = 0 if current is None else int(current.src_pages.shape[0])
    if pages_from != at:
        return (
            "pages_from",
            f"pages_from = {pages_from}, but the next range starts at request position {at} "
            "(ranges come in order, without gaps or overlaps)",
        )
    return None


def _fit_problem(dest: DestinationMsg, end: int, last: bool) -> tuple[str, str] | None:
    """(field, why) when a range ending at request position `end` does not fit the decode's
    pages. The decode's pages follow the prefix it holds: the request has that many more."""
    n = dest.prefix_pages + len(dest.dst_pages)
    has = f"the decode has {n} pages"
    if dest.prefix_pages:
        has = request_pages(dest.prefix_pages, len(dest.dst_pages))
    if end > n:
        return "src_pages", f"the range ends at position {end}; {has}"
    if last and end != n:
        return "last_pages", f"the last range ends at position {end}; {has}"
    return None
