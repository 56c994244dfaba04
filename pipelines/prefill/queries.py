"""What the service reads of the handoffs open on a prefill pipeline: values, never the handoffs
themselves.

Read by the engine route's bound on handoffs awaiting a destination (`holds`, `open_count`,
`awaiting_destination`), the abort route's sender check (`decode_of`), the dashboard
(`open_ids`) and metrics (`arena`). Built once by `PrefillPipeline` over its own state (`query`).
"""

from __future__ import annotations

from collections.abc import Mapping

from pipelines.arena import ArenaUse
from pipelines.prefill.handoff import PrefillHandoff, Staging


class PrefillQueries:
    def __init__(self, handoffs: Mapping[str, PrefillHandoff], staging: Staging | None) -> None:
        self._handoffs = handoffs
        self._staging = staging

    def holds(self, handoff_id: str) -> bool:
        return handoff_id in self._handoffs

    def open_count(self) -> int:
        """Handoffs open here (signalled ready or given a destination, not yet ended)."""
        return len(self._handoffs)

    def awaiting_destination(self) -> int:
        """Handoffs signalled ready whose destination no decode service has sent yet."""
        return sum(1 for h in self._handoffs.values() if h.decode_url is None)

    def open_ids(self) -> frozenset[str]:
        return frozenset(self._handoffs)

    def decode_of(self, handoff_id: str) -> str | None:
        """The decode service that sent this handoff's destination (None: none yet, or the
        handoff is not open here)."""
        h = self._handoffs.get(handoff_id)
        return None if h is None else h.decode_url

    def arena(self) -> ArenaUse | None:
        """The staging buffer's use now (None in direct mode)."""
        return None if self._staging is None else self._staging.arena.use("staging")
