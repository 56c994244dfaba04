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

from kvhandoff.pipelines.errors import ConflictError
from kvhandoff.pipelines.messages import HeartbeatAck
from kvhandoff.pipelines.prefill.handoff import PrefillHandoff

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

    def for_ready(self, scope: str | None, handoff_id: str) -> PrefillHandoff | None:
        """The open handoff a ready signal is for. Naming its decode, the handoff of that decode
        (or one not bound to a decode yet); naming none, the only open handoff of that id — two
        decodes' requests under one id are told apart only by the engine naming the decode."""
        if scope is not None:
            return self.get(scope, handoff_id) or self.get(None, handoff_id)
        same = self.with_id(handoff_id)
        if len(same) > 1:
            raise ConflictError(
                f"handoff id {handoff_id!r} is in use by {len(same)} decode services here; "
                "name the request's decode service (decode_url) in the ready signal",
                field="decode_url",
            )
        return same[0] if same else None

    def for_abort(
        self, scope: str | None, handoff_id: str, decode_incarnation: str | None
    ) -> PrefillHandoff | None:
        if scope is not None:
            return self.get(scope, handoff_id) or self.get(None, handoff_id)
        same = self.with_id(handoff_id)
        if len(same) > 1 and decode_incarnation is not None:
            # Unsigned (no peer secret): the destination's decode life tells them apart.
            same = [
                h
                for h in same
                if (d := h.known_destination) is None or d.decode_incarnation == decode_incarnation
            ]
        if len(same) > 1:
            raise ConflictError(
                f"handoff id {handoff_id!r} is in use by {len(same)} decode services here",
                field="handoff_id",
            )
        return same[0] if same else None

    def live_by_decode(self) -> dict[str, list[str]]:
        """Open handoff ids per decode URL (those bound to a decode by a destination)."""
        out: dict[str, list[str]] = {}
        for h in self:
            url = h.decode_url
            if url is not None:
                out.setdefault(url, []).append(h.handoff_id)
        return out

    def outdated(
        self, decode_url: str, ack: HeartbeatAck, sent: list[str]
    ) -> list[tuple[PrefillHandoff, str]]:
        """The handoffs a heartbeat answer from `decode_url` says to stop, each with why (see
        `PrefillPipeline.reconcile`)."""
        theirs = set(ack.live)
        victims = []
        for h in self:
            dest = h.known_destination
            if dest is None or dest.decode_url != decode_url:
                continue
            if dest.decode_incarnation != ack.incarnation:
                victims.append((h, f"decode {decode_url} restarted"))
            elif h.handoff_id in sent and h.handoff_id not in theirs and not h.told(dest.pp_ranks):
                victims.append((h, f"decode {decode_url} no longer has it"))
        return victims

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

    def refuse(self, scope: str | None, handoff_id: str) -> None:
        outcome = self.outcome(scope, handoff_id)
        if outcome is not None:
            raise ConflictError(
                f"handoff {handoff_id!r} already {outcome} on this prefill service",
                field="handoff_id",
            )
