"""Fencing: destination pages, slots and aux rows are leased to one live handoff at a time.

Called by the decode pipeline when a handoff is created (acquire) and once no write of it can
still land (release). A second handoff naming a leased page, a leased slot of the same state
component or a leased aux row is rejected with a conflict that names it and its holder, so two
transfers never land on the same memory.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from kvhandoff.pipelines.errors import ConflictError
from kvhandoff.pipelines.layout import StageLayout
from kvhandoff.pipelines.slots import AUX, SlotsLike, Space, as_slots

I64 = npt.NDArray[np.int64]
_FREE = -1
#: One index a handoff leases beside its pages: (its space, the index, the field naming it).
Claim = tuple[Space, int, str]


def slot_claims(layout: StageLayout, slots: SlotsLike) -> list[Claim]:
    """The indices a destination on `layout` leases: each state component's slot and the aux
    row (validated against the layout before)."""
    given = as_slots(slots)
    spaces: list[Space] = [*layout.components, *([AUX] if layout.aux else [])]
    out: list[Claim] = []
    for space in spaces:
        index = given.of(space)
        if index is not None:
            out.append((space, index, given.field_of(space, "dst")))
    return out


class Leases:
    def __init__(self, num_pages: int, num_slots: int) -> None:
        self.num_pages = num_pages
        self._page_owner = np.full(num_pages, _FREE, dtype=np.int64)
        self._slot_owner: dict[tuple[Space, int], str] = {}
        self._handles: dict[str, tuple[int, I64, list[Claim]]] = {}
        self._names: dict[int, str] = {}
        self._next = 0

    def acquire(self, handoff_id: str, pages: I64, claims: list[Claim]) -> None:
        """Lease `pages` and the indices of `claims` (`slot_claims`) to `handoff_id`, or raise
        ConflictError changing nothing."""
        if handoff_id in self._handles:
            raise ConflictError(f"handoff {handoff_id!r} already holds a lease", field="id")
        owners = self._page_owner[pages]
        taken = np.flatnonzero(owners != _FREE)
        if taken.size:
            i = int(taken[0])
            holder = self._names[int(owners[i])]
            raise ConflictError(
                f"dst_pages[{i}] = {int(pages[i])} is leased to live handoff {holder!r}",
                field=f"dst_pages[{i}]",
                holder=holder,
            )
        for space, index, field in claims:
            owner = self._slot_owner.get((space, index))
            if owner is not None:
                raise ConflictError(
                    f"{field} = {index} is leased to live handoff {owner!r}",
                    field=field,
                    holder=owner,
                )
        handle = self._next
        self._next += 1
        self._page_owner[pages] = handle
        for space, index, _ in claims:
            self._slot_owner[(space, index)] = handoff_id
        self._handles[handoff_id] = (handle, pages, list(claims))
        self._names[handle] = handoff_id

    def release(self, handoff_id: str) -> None:
        """Give the lease back; releasing twice (or never acquired) is harmless."""
        found = self._handles.pop(handoff_id, None)
        if found is None:
            return
        handle, pages, claims = found
        self._page_owner[pages] = _FREE
        for space, index, _ in claims:
            self._slot_owner.pop((space, index), None)
        del self._names[handle]

    def holders(self) -> dict[str, int]:
        """Each lease holder and how many pages it holds."""
        return {hid: int(pages.shape[0]) for hid, (_, pages, _) in self._handles.items()}

    def holds(self, handoff_id: str) -> bool:
        return handoff_id in self._handles

    @property
    def leased_pages(self) -> int:
        return int(np.count_nonzero(self._page_owner != _FREE))

    def __len__(self) -> int:
        return len(self._handles)
