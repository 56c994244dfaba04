"""The handoff list across restarts: this process's handoffs merged with the records of all.

Called by `GET /v1/handoffs` (`kvhandoff.service.api.handoffs`) on a decode service whose records
persist. It answers the set a router would get by asking `GET /v1/handoffs/{id}` for every id: each
handoff this process holds (its live view wins over its record), and each finished record, of
this life or an earlier one, that it does not hold — once each, in creation order across lives
(`seq`, `kvhandoff.service.storage.LIFE_SHIFT`), a page at a time. A record's item is the view the
single GET answers (`DecodePipeline.get`), without its timeline, like a live one's.

The cursor is the last item's `seq`: stable across pages and restarts (a later life's handoffs
come after every earlier one's), so a router paging through keeps its place when the service
restarts in between.
"""

from __future__ import annotations

import functools
import heapq
import itertools
from collections.abc import Callable, Iterator

from kvhandoff.pipelines.decode import DecodePipeline
from kvhandoff.pipelines.decode.views import HandoffPage, HandoffView
from kvhandoff.pipelines.states import HandoffState
from kvhandoff.service.records.handoffs import HandoffRecords


def handoff_page(
    decode: DecodePipeline,
    records: HandoffRecords,
    state: HandoffState | None,
    limit: int,
    cursor: int,
) -> HandoffPage:
    """At most `limit` handoffs (of `state`) after `cursor`; `next_cursor` None on the last page.

    Asks the records for at most `2 * (limit + 1)` rows, once: the page's `limit + 1` candidates
    among the live handoffs bound the records worth reading (none beyond the last of them), and
    each record in that range that is not a candidate's own is one the page needs."""
    wanted = limit + 1
    live = list(itertools.islice(_live(decode, records, state, cursor), wanted))
    before = live[-1][0] if len(live) == wanted else None
    merged = heapq.merge(
        live, _recorded(decode, records, state, cursor, before, 2 * wanted), key=_seq
    )
    taken = list(itertools.islice(merged, wanted))
    items = [view() for _, view in taken[:limit]]
    return HandoffPage(items=items, next_cursor=taken[limit - 1][0] if len(taken) > limit else None)


def _seq(item: tuple[int, Callable[[], HandoffView]]) -> int:
    return item[0]


def _live(
    decode: DecodePipeline, records: HandoffRecords, state: HandoffState | None, cursor: int
) -> Iterator[tuple[int, Callable[[], HandoffView]]]:
    # The pipeline holds them in creation order, and so are the seqs this life gives its records.
    for h in decode.query.held(state):
        seq = records.seq_of(h.seq)
        if seq > cursor:
            yield seq, functools.partial(decode.get, h.request.id, timeline=False)


def _recorded(
    decode: DecodePipeline,
    records: HandoffRecords,
    state: HandoffState | None,
    cursor: int,
    before: int | None,
    batch: int,
) -> Iterator[tuple[int, Callable[[], HandoffView]]]:
    """Records after `cursor` (and before `before`) of handoffs this process does not hold."""
    after = cursor
    while True:
        rows = records.listed(after, state, batch, before=before)
        for seq, hid in rows:
            if not decode.query.holds(hid):  # held here: `_live` answers for it
                yield seq, functools.partial(decode.get, hid, timeline=False)
        if len(rows) < batch:
            return
        after = rows[-1][0]
