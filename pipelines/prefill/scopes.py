"""The handoffs open on a prefill service, by the decode service each id belongs to.

Routers pick handoff ids per decode service; two decodes sharing a prefill may pick the same
one. Keyed by id alone, the second decode's destination was refused, and worse, an engine's
ready signal for one decode's request could be matched to the other's destination (its KV
written into the other request's pages). So a handoff is keyed by `(scope, id)`: its scope is
the decode service's URL, named by its destination or by the engine's ready signal
(`decode_url`), None until one does. An unscoped handoff (a ready that named no decode, before
any destination) takes the scope of the first destination for its id.

Used by `PrefillPipeline` only (and its `query`); everything here is synchronous bookkeeping.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator

from pipelines.prefill.handoff import PrefillHandoff

#: How many ended handoffs are remembered, so a late or repeated signal is refused rather than
#: opening a handoff that waits for a destination that will never come.
MAX_FINISHED = 65536

Key = tuple[str | None, str]


class OpenHandoffs:
    """The open handoffs by `(scope, id)`, with an index by id."""

    def __init__(self) -> None:
        self._by_key: dict[Key, PrefillHandoff] = {}
        self._by_id: dict[str, list[PrefillHandoff]] = {}

    def get(self, scope: str | None, handoff_id: str) -> PrefillHandoff | None:
        return self._by_key.get((scope, handoff_id))

    def with_id(self, handoff_id: str) -> list[PrefillHandoff]:
        """Every open handoff of this id, whichever decode it belongs to."""
        return list(self._by_id.get(handoff_id, ()))

    def add(self, h: PrefillHandoff) -> None:
        key = (h.scope, h.handoff_id)
        assert key not in self._by_key, key
        self._by_key[key] = h
        self._by_id.setdefault(h.handoff_id, []).append(h)

    def rescope(self, h: PrefillHandoff, scope: str) -> None:
        """Give an unscoped handoff the scope a destination or a ready signal named."""
        assert h.scope is None and self._by_key.get((None, h.handoff_id)) is h
        del self._by_key[(None, h.handoff_id)]
        h.scope = scope
        self._by_key[(scope, h.handoff_id)] = h

    def remove(self, h: PrefillHandoff) -> bool:
        """Forget `h`; False when it was not (or no longer) open."""
        key = (h.scope, h.handoff_id)
        if self._by_key.get(key) is not h:
            return False
        del self._by_key[key]
        same = self._by_id[h.handoff_id]
        same.remove(h)
        if not same:
            del self._by_id[h.handoff_id]
        return True

    def __iter__(self) -> Iterator[PrefillHandoff]:
        return iter(list(self._by_key.values()))

    def __len__(self) -> int:
        return len(self._by_key)

    def holds(self, handoff_id: str) -> bool:
        return handoff_id in self._by_id


class Finished:
    """The outcome of recently ended handoffs, by `(scope, id)` and, for signals that name no
    decode, by id alone."""

    def __init__(self, limit: int = MAX_FINISHED) -> None:
        self._outcomes: OrderedDict[Key, str] = OrderedDict()
        #: Ids of handoffs that ended unscoped (given up or aborted before any destination or
        #: signal named their decode): the first destination of the id is theirs, as it would
        #: have been had they still been open, and is refused.
        self._unclaimed: OrderedDict[str, str] = OrderedDict()
        self._limit = limit

    def remember(self, scope: str | None, handoff_id: str, outcome: str) -> None:
        for key in {(scope, handoff_id), (None, handoff_id)}:
            self._outcomes[key] = outcome
            self._outcomes.move_to_end(key)
        if scope is None:
            self._unclaimed[handoff_id] = outcome
            self._unclaimed.move_to_end(handoff_id)
        else:
            self._unclaimed.pop(handoff_id, None)
        while len(self._outcomes) > self._limit:
            self._outcomes.popitem(last=False)
        while len(self._unclaimed) > self._limit:
            self._unclaimed.popitem(last=False)

    def outcome(self, scope: str | None, handoff_id: str) -> str | None:
        return self._outcomes.get((scope, handoff_id))

    def claim(self, scope: str, handoff_id: str) -> str | None:
        """The outcome a destination from decode `scope` meets: that decode's handoff of this
        id ended, or one that ended unscoped takes this scope now (once)."""
        outcome = self._outcomes.get((scope, handoff_id))
        if outcome is None:
            outcome = self._unclaimed.pop(handoff_id, None)
            if outcome is not None:
                self.remember(scope, handoff_id, outcome)
        return outcome
