"""What the service reads of the handoffs a decode pipeline holds: immutable snapshots and
counts, never the handoffs themselves, so no reader can change one or depend on how the pipeline
keeps it.

Read by the service's records journal (`find`), the handoff list (`held`, `holds`), metrics and
readiness (`in_flight`), the dashboard (`recent_peers`, `peer_stages`, `pages`, `arena`) and the
peer routes (`stage_peer`). Built once by `DecodePipeline` over its own state (`query`).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator

from kvhandoff.pipelines.arena import ArenaUse
from kvhandoff.pipelines.decode.handoff import DecodeHandoff
from kvhandoff.pipelines.decode.landing import Landing
from kvhandoff.pipelines.decode.leases import Leases
from kvhandoff.pipelines.decode.prefill_peers import PrefillDirectory
from kvhandoff.pipelines.decode.views import (
    MAX_FENCED_SHOWN,
    FencedUse,
    HandoffView,
    HeldHandoff,
    PageUse,
)
from kvhandoff.pipelines.states import HandoffState


class DecodeQueries:
    def __init__(
        self,
        handoffs: dict[str, DecodeHandoff],
        leases: Leases,
        peers: PrefillDirectory,
        landing: Landing | None,
        *,
        archived: Callable[[str], HandoffView],
    ) -> None:
        self._handoffs = handoffs
        self._leases = leases
        self._peers = peers
        self._landing = landing
        self._archived = archived  # an earlier life's handoff, or NotFoundError

    def holds(self, handoff_id: str) -> bool:
        return handoff_id in self._handoffs

    def find(self, handoff_id: str) -> HeldHandoff | None:
        """The handoff as admitted, if this process holds it (None: an earlier life's or
        evicted; `get` answers for those from the archive)."""
        h = self._handoffs.get(handoff_id)
        return None if h is None else self._held(h)

    def held(self, state: HandoffState | None = None) -> Iterator[HeldHandoff]:
        """The handoffs held here (of `state`), in creation order. Consume it before awaiting:
        a handoff created meanwhile ends the iteration with a RuntimeError."""
        for h in self._handoffs.values():
            if state is None or h.state == state:
                yield self._held(h)

    @staticmethod
    def _held(h: DecodeHandoff) -> HeldHandoff:
        return HeldHandoff(h.request, h.seq, h.state, h.created_at, h.deadline_at)

    def in_flight(self) -> int:
        """Handoffs held here and not yet terminal."""
        return sum(not h.state.terminal for h in self._handoffs.values())

    def recent_peers(self, limit: int) -> list[str]:
        """The prefill services named by the `limit` most recent handoffs, newest first, once."""
        recent = itertools.islice(reversed(self._handoffs.values()), limit)
        return list(dict.fromkeys(url for h in recent for url in h.peers))

    def stage_peer(self, handoff_id: str, pp_rank: int) -> str | None:
        """The prefill service stage `pp_rank` of a handoff was assigned to (None: the handoff
        has no such stage). An unknown handoff is a NotFoundError, as `get` says."""
        h = self._handoffs.get(handoff_id)
        if h is not None:
            stage = h.stages.get(pp_rank)
            return None if stage is None else stage.peer
        view = self._archived(handoff_id)
        return next((s.peer for s in view.stages if s.pp_rank == pp_rank), None)

    def peer_stages(self) -> dict[str, list[int]]:
        """The PP ranks each known prefill service hosts: from its cached layout, else from the
        handoffs held here that were assigned stages on it."""
        out: dict[str, set[int]] = {}
        for h in self._handoffs.values():
            for rank, stage in h.stages.items():
                out.setdefault(stage.peer, set()).add(rank)
        found = {url: sorted(ranks) for url, ranks in out.items()}
        found.update(self._peers.hosted())
        return found

    def pages(self) -> PageUse:
        """The pool's pages now: leased to live handoffs, or fenced (outcome known, writers
        not confirmed stopped; or an earlier life's, until its bound)."""
        holders = self._leases.holders()
        live = fenced = 0
        shown: list[FencedUse] = []
        for hid, n in holders.items():
            h = self._handoffs.get(hid)
            if h is not None and not h.state.terminal:
                live += n
                continue
            fenced += n
            if len(shown) < MAX_FENCED_SHOWN:
                shown.append(FencedUse(hid, n, restored=h is None))
        return PageUse(
            total=self._leases.num_pages,
            leased=live + fenced,
            live=live,
            fenced=fenced,
            fenced_handoffs=shown,
        )

    def arena(self) -> ArenaUse | None:
        """The landing arena's use now (None in direct mode)."""
        return None if self._landing is None else self._landing.arena.use("landing")

    def arena_span(self) -> tuple[int, int] | None:
        """The landing arena's registered memory (base, bytes), None in direct mode: what the
        records keep with each handoff, so a restart knows where its stale writes can land."""
        if self._landing is None:
            return None
        return self._landing.arena.base_addr, self._landing.arena.capacity_bytes
