"""The handoffs a decode answers for: those it holds, and after a restart an earlier life's.

Used by `DecodePipeline`: a repeated create is answered from here (or refused when its body
differs), a read of a handoff this process no longer holds is answered from the archive, and
the oldest released handoffs are forgotten beyond the history limit (held only in the archive
then).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from collections.abc import Iterator

import msgspec

from kvhandoff.pipelines.decode.handoff import DecodeHandoff
from kvhandoff.pipelines.decode.release import Releases
from kvhandoff.pipelines.decode.views import (
    ArchivedHandoff,
    HandoffArchive,
    HandoffPage,
    HandoffRequest,
    HandoffView,
)
from kvhandoff.pipelines.errors import ConflictError, NotFoundError
from kvhandoff.pipelines.states import HandoffState, ReleaseState


class HandoffHistory:
    """Looks handoffs up in `handoffs` (creation order) and the archive; forgets the oldest."""

    def __init__(self, handoffs: dict[str, DecodeHandoff], releases: Releases) -> None:
        self._handoffs = handoffs
        self._releases = releases
        self.archive: HandoffArchive | None = None
        self.evicted = 0  # handoffs forgotten so far: held only in the archive now

    def existing(self, req: HandoffRequest, *, archive: bool = True) -> HandoffView | None:
        """The handoff of `req`'s id (None: there is none), if `req` is the request it was
        created with; `archive`: look in the archive too."""
        h = self._handoffs.get(req.id)
        if h is not None:
            found: ArchivedHandoff | None = ArchivedHandoff(h.request, h.view())
        elif archive and self.archive is not None:
            found = self.archive.find(req.id)
        else:
            found = None
        if found is None:
            return None
        if found.request != req:
            raise ConflictError(
                f"handoff {req.id!r} exists with a different request body", field="id"
            )
        return found.view

    def archived(self, handoff_id: str) -> HandoffView:
        """A handoff this process does not hold, as the archive recorded it."""
        old = self.archive.find(handoff_id) if self.archive is not None else None
        if old is None:
            raise NotFoundError(f"no handoff {handoff_id!r}", field="id")
        return self._releases.restored_view(old.view)

    def get(self, handoff_id: str, *, timeline: bool = True) -> HandoffView:
        h = self._handoffs.get(handoff_id)
        if h is not None:
            return h.view(timeline=timeline)
        view = self.archived(handoff_id)
        return view if timeline else msgspec.structs.replace(view, timeline=[])

    async def wait(
        self, handoff_id: str, timeout_s: float, *, released: bool = False
    ) -> HandoffView:
        """The handoff once it has an outcome (or, with `released`, once its pages are free),
        or as it is after `timeout_s` (a router's long poll). A handoff of an earlier life of
        this service is answered from the archive as it was recorded."""
        if handoff_id not in self._handoffs:
            view = self.archived(handoff_id)
            if released and not view.released:  # its restored fence: wait for it to lift
                await self._releases.wait_restored(handoff_id, timeout_s)
                view = self.archived(handoff_id)
            return view
        h = self._handoffs[handoff_id]
        event = h.released if released else h.done
        if not event.is_set() and timeout_s > 0:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(timeout_s):
                    await event.wait()
        return h.view()

    def page(
        self, state: HandoffState | None = None, limit: int = 100, cursor: int = 0
    ) -> HandoffPage:
        """Handoffs in creation order after `cursor`, optionally of one state."""
        items: list[HandoffView] = []
        next_cursor = None
        for h in self._handoffs.values():
            if h.seq <= cursor or (state is not None and h.state != state):
                continue
            if len(items) == limit:
                next_cursor = self._handoffs[items[-1].id].seq
                break
            items.append(h.view(timeline=False))
        return HandoffPage(items=items, next_cursor=next_cursor)

    def evict(self, limit: int) -> None:
        """Forget the oldest released handoffs beyond `limit`."""
        excess = len(self._handoffs) - limit
        if excess > 0:
            # islice: stop at the few needed (dicts keep creation order, oldest first).
            for handoff_id in list(itertools.islice(self._oldest_released(), excess)):
                del self._handoffs[handoff_id]
                self.evicted += 1

    def _oldest_released(self) -> Iterator[str]:
        for h in self._handoffs.values():
            if h.release == ReleaseState.RELEASED:
                yield h.id
