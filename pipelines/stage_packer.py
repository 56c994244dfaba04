"""The prefill's plan of a stage's segments: which cells (pairing row x request page position)
are ready, which are packed, and what the next segment holds within a granted window.

Called by the landed sender (`kvhandoff.pipelines.prefill.landed`) as the engine signals layers or
page ranges, and by the benchmarks that size segments; the pieces it returns are gathered and
scattered by `kvhandoff.pipelines.packing`.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

from kvhandoff.pipelines.errors import InvalidInput
from kvhandoff.pipelines.packing import Pieces
from kvhandoff.pipelines.pairing import Pairing


@dataclass
class StagePacker:
    """What of one stage is still to be packed, cell by cell: each row's page positions
    `[0, ready_end)` are ready, `[0, next)` already packed. `next_segment(budget)` takes as much
    of the ready cells as fits, rows in the order they became ready.

    Readiness comes two ways, never mixed in one stage (the pipeline refuses it):

    - by layer (`make_ready`): a row becomes ready over all its pages at once;
    - by page range (`ranged=True`, `make_pages_ready`): the request's pages up to a position
      become ready for every KV row; the slot rows (state slots, aux rows) only with the last
      range.

    Aux rows belong to no layer: by layer, they become ready once every layer's rows are.

    Pieces stay (row, start, end) over request page positions either way, so the decode's
    checks and commits do not depend on how the stage was signalled.
    """

    pairing: Pairing
    num_pages: int
    has_slot: bool
    ranged: bool = False
    # Per row, as Python lists: a segment touches a few rows at a time, and numpy's per-element
    # access costs more than the arithmetic (61 one-layer segments measured 1.6x slower).
    _item: list[int] = field(init=False)
    _final_end: list[int] = field(init=False)  # the end of what the row sends (0: nothing)
    _ready_end: list[int] = field(init=False)
    _next: list[int] = field(init=False)
    _queued: list[bool] = field(init=False)
    _queue: deque[int] = field(init=False)  # rows with ready cells not packed, in ready order
    _rows_of_layer: dict[int, list[int]] = field(init=False)
    _ready_bytes: int = field(init=False, default=0)
    _unpacked: int = field(init=False, default=0)  # cells still to pack, ready or not
    _pages_ready: int = field(init=False, default=0)  # ranged: pages ready so far
    _ended: bool = field(init=False)  # every range was signalled (always, by layer)

    def __post_init__(self) -> None:
        p = self.pairing
        k = p.num_kv_pairs
        self._item = p.row_item_len.tolist()
        self._final_end = [self.num_pages] * k + [1 if self.has_slot else 0] * p.num_slot_rows
        rows = len(self._final_end)
        self._ready_end = [0] * rows
        self._next = [0] * rows
        self._queued = [False] * rows
        self._queue = deque()
        self._rows_of_layer = {}
        for r, layer in enumerate([*p.kv_layer.tolist(), *p.slot_layer.tolist()]):
            if r < k + p.num_state_pairs:  # aux rows (layer -1) follow the layers (`make_ready`)
                self._rows_of_layer.setdefault(int(layer), []).append(r)
        self._unpacked = sum(self._final_end)
        self._ended = not self.ranged

    @property
    def total_bytes(self) -> int:
        kv = int(self.pairing.kv_item_len.sum()) * self.num_pages
        return kv + (self.pairing.slot_bytes if self.has_slot else 0)

    @property
    def largest_item(self) -> int:
        return max(self._item, default=0)

    @property
    def done(self) -> bool:
        """Every cell was made ready and packed: by page range, only once the last range (and
        with it the state) was signalled."""
        return self._ended and self._unpacked == 0

    @property
    def ready_bytes(self) -> int:
        return self._ready_bytes

    def make_ready(self, layers: Iterable[int] | None) -> None:
        """Rows of `layers` (None: all) become packable over all their pages; KV rows before
        state rows; the aux rows once every layer's rows are."""
        if layers is None:
            rows = list(range(len(self._final_end)))
        else:
            rows = sorted(r for layer in set(layers) for r in self._rows_of_layer.get(layer, ()))
            first_aux = self.pairing.num_kv_pairs + self.pairing.num_state_pairs
            end, final = self._ready_end, self._final_end
            covered = set(rows)
            if all(r in covered or end[r] >= final[r] for r in range(first_aux)):
                rows += list(range(first_aux, len(final)))
        self._extend(rows, [self._final_end[r] for r in rows])

    def make_pages_ready(self, end: int, *, last: bool, pp_rank: int = 0) -> None:
        """Request pages `[pages ready so far, end)` become packable for every KV row; with
        `last`, the range is the request's last and the state rows become packable too. Raises
        InvalidInput (changing nothing) for a range past the destination's pages, a last range
        short of them, or a range after the last."""
        if not self.ranged:
            raise InvalidInput(
                "this stage is signalled by layer, not by page range",
                field="pages_from",
                pp_rank=pp_rank,
            )
        if self._ended:
            raise InvalidInput(
                "the stage's last page range was already signalled",
                field="pages_from",
                pp_rank=pp_rank,
            )
        if end < self._pages_ready or end > self.num_pages:
            raise InvalidInput(
                f"the page range ends at request position {end}; the decode has "
                f"{self.num_pages} pages for it and {self._pages_ready} are ready",
                field="src_pages",
                pp_rank=pp_rank,
            )
        if last and end != self.num_pages:
            raise InvalidInput(
                f"the last page range ends at request position {end}, but the decode has "
                f"{self.num_pages} pages for the request",
                field="last_pages",
                pp_rank=pp_rank,
            )
        k = self.pairing.num_kv_pairs
        self._pages_ready = end
        self._extend(list(range(k)), [end] * k)
        if last:
            state = list(range(k, len(self._final_end)))
            self._extend(state, [self._final_end[r] for r in state])
            self._ended = True

    def _extend(self, rows: list[int], ends: list[int]) -> None:
        ready_end, nxt, queued, item = self._ready_end, self._next, self._queued, self._item
        for r, e in zip(rows, ends):
            if e > ready_end[r]:
                self._ready_bytes += item[r] * (e - ready_end[r])
                ready_end[r] = e
            # A row already queued keeps its place and its piece grows: fewer, larger pieces.
            if not queued[r] and nxt[r] < ready_end[r]:
                queued[r] = True
                self._queue.append(r)

    def next_segment(self, budget_bytes: int) -> Pieces | None:
        """The next pieces that fit `budget_bytes`, or None when nothing ready fits."""
        rows: list[int] = []
        starts: list[int] = []
        ends: list[int] = []
        left = budget_bytes
        while self._queue:
            row = self._queue[0]
            start, end_all = self._next[row], self._ready_end[row]
            item = self._item[row]
            take = min(end_all - start, left // item)
            if take <= 0:
                break
            rows.append(row)
            starts.append(start)
            ends.append(start + take)
            left -= take * item
            self._next[row] = start + take
            self._ready_bytes -= take * item
            self._unpacked -= take
            if start + take == end_all:
                self._queue.popleft()
                self._queued[row] = False
        return Pieces.of(rows, starts, ends) if rows else None
