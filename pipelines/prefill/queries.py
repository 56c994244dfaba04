"""What the service reads of the handoffs open on a prefill pipeline: values, never the handoffs
themselves.

Read by the engine route's bound on handoffs awaiting a destination (`holds`, `open_count`,
`awaiting_destination`), the abort route's sender check (`decode_of`), the dashboard
(`open_ids`) and metrics (`arena`). Built once by `PrefillPipeline` over its own state (`query`).
"""

from __future__ import annotations

from kvhandoff.pipelines.arena import ArenaUse
from kvhandoff.pipelines.prefill.handoff import Staging
from kvhandoff.pipelines.prefill.scopes import OpenHandoffs


class PrefillQueries:
    def __init__(self, handoffs: OpenHandoffs, staging: Staging | None) -> None:
        self._handoffs = handoffs
        self._staging = staging

    def holds(self, handoff_id: str) -> bool:
        """Whether a handoff of this id is open here, for any decode."""
        return self._handoffs.holds(handoff_id)

    def open_count(self) -> int:
        """Handoffs open here (signalled ready or given a destination, not yet ended)."""
        return len(self._handoffs)

    def awaiting_destination(self) -> int:
        """Handoffs signalled ready whose destination no decode service has sent yet."""
        return sum(1 for h in self._handoffs if h.decode_url is None)

    def open_ids(self) -> frozenset[str]:
        return frozenset(h.handoff_id for h in self._handoffs)

    def decodes_of(self, handoff_id: str) -> list[str]:
        """The decode services that sent a destination for this id (ids are unique per decode
        only; empty: none yet, or no handoff of this id is open here)."""
        return sorted({url for h in self._handoffs.with_id(handoff_id) if (url := h.decode_url)})

    def arena(self) -> ArenaUse | None:
        """The staging buffer's use now (None in direct mode)."""
        return None if self._staging is None else self._staging.arena.use("staging")
