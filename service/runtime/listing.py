"""The handoff list across restarts: this process's handoffs merged with the records of all.

Called by `GET /v1/handoffs` (`service.api.handoffs`) on a decode service whose records persist.
It answers the set a router would get by asking `GET /v1/handoffs/{id}` for every id: each
handoff this process holds (its live view wins over its record), and each finished record, of
this life or an earlier one, that it does not hold — once each, in creation order across lives
(`seq`, `service.runtime.database.LIFE_SHIFT`), a page at a time. A record's item is the view the
single GET answers (`DecodePipeline.get`), without its timeline, like a live one's.

The cursor is the last item's `seq`: stable across pages and restarts (a later life's handoffs
come after every earlier one's), so a router paging through keeps its place when the service
restarts in between.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Iterator

import msgspec

from pipelines.decode import DecodePipeline
from pipelines.decode_views import HandoffPage, HandoffView
from pipelines.states import HandoffState
from service.runtime.records import HandoffRecords


def handoff_page(
    decode: DecodePipeline,
    records: HandoffRecords,
    state: HandoffState | None,
    limit: int,
    cursor: int,
) -> HandoffPage:
    """At most `limit` handoffs (of `state`) after `cursor`; `next_cursor` None on the last page.

    Reads at most a few of `limit + 1` record rows per page (more only where records of handoffs
    this process holds are skipped), never the whole table."""
    merged = heapq.merge(
        _live(decode, records, state, cursor),
        _recorded(decode, records, state, cursor, limit + 1),
        key=lambda item: item[0],
    )
    taken = list(itertools.islice(merged, limit + 1))
    items = [view for _, view in taken[:limit]]
    more = len(taken) > limit
    return HandoffPage(items=items, next_cursor=taken[limit - 1][0] if more else None)


def _live(
    decode: DecodePipeline, records: HandoffRecords, state: HandoffState | None, cursor: int
) -> Iterator[tuple[int, HandoffView]]:
    # The pipeline's dict is in creation order, and so are the seqs this life gives its records.
    for h in decode.handoffs.values():
        seq = records.seq_of(h.seq)
        if seq > cursor and (state is None or h.state == state):
            yield seq, h.view(timeline=False)


def _recorded(
    decode: DecodePipeline,
    records: HandoffRecords,
    state: HandoffState | None,
    cursor: int,
    batch: int,
) -> Iterator[tuple[int, HandoffView]]:
    after = cursor
    while True:
        rows = records.listed(after, state, batch)
        for seq, hid in rows:
            if hid not in decode.handoffs:  # held here: `_live` answers for it
                yield seq, msgspec.structs.replace(decode.get(hid), timeline=[])
        if len(rows) < batch:
            return
        after = rows[-1][0]
