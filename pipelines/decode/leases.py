"""Fencing: destination pages and slots are leased to one live handoff at a time.

Called by the decode pipeline when a handoff is created (acquire) and once no write of it can
still land (release). A second handoff naming a leased page or slot is rejected with a conflict
that names the page and its holder, so two transfers never land on the same memory.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from pipelines.errors import ConflictError

I64 = npt.NDArray[np.int64]
_FREE = -1


class Leases:
    def __init__(self, num_pages: int, num_slots: int) -> None:
        self.num_pages = num_pages
        self._page_owner = np.full(num_pages, _FREE, dtype=np.int64)
        self._slot_owner: dict[int, str] = {}
        self._handles: dict[str, tuple[int, I64, int | None]] = {}
        self._names: dict[int, str] = {}
        self._next = 0

    def acquire(self, handoff_id: str, pages: I64, slot: int | None) -> None:
        """Lease `pages` and `slot` to `handoff_id`, or raise ConflictError changing nothing."""
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
        if slot is not None and slot in self._slot_owner:
            holder = self._slot_owner[slot]
            raise ConflictError(
                f"dst_slot = {slot} is leased to live handoff {holder!r}",
                field="dst_slot",
                holder=holder,
            )
        handle = self._next
        self._next += 1
        self._page_owner[pages] = handle
        if slot is not None:
            self._slot_owner[slot] = handoff_id
        self._handles[handoff_id] = (handle, pages, slot)
        self._names[handle] = handoff_id

    def release(self, handoff_id: str) -> None:
        """Give the lease back; releasing twice (or never acquired) is harmless."""
        found = self._handles.pop(handoff_id, None)
        if found is None:
            return
        handle, pages, slot = found
        self._page_owner[pages] = _FREE
        if slot is not None:
            self._slot_owner.pop(slot, None)
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
