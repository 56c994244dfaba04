"""The per-peer health table behind `/metrics` and the dashboard: bounded, and forgetting.

Every peer URL that is heard (a heartbeat answered or received), missed or lost gets a row; each
row becomes a label value of the `kvhandoff_peer_*` metrics and a line on the dashboard, so the
table must not grow with every URL that ever sent a heartbeat (a peer that moved, a service that
was removed, a flood of senders). Two rules keep it bounded:

- a row is **kept** while its peer is *pinned* — named in the configuration (`peers.prefill`) or
  sharing live handoffs with this service (`Heartbeats` re-pins the live set every round);
- an unpinned row is **forgotten** once it has been idle (not heard, not shared) for
  `forget_after_s`, and beyond `max_peers` rows the unpinned ones idle longest go first.

Pinned rows are never evicted: they are bounded by the configuration and the live handoffs, and
the heartbeats need them. Used by `kvhandoff.service.peers.heartbeat` only; readers get
`PeerHealth`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

from msgspec import Struct


class PeerHealth(Struct, frozen=True):
    """One peer as the heartbeats see it (read by metrics and the dashboard)."""

    url: str
    last_heard_s: float | None  # seconds since it was last heard; None: never
    lost: bool  # declared lost and not heard since
    misses: int  # heartbeats to it that failed, since it was first tracked
    losses: int  # times it was declared lost, since it was first tracked
    #: Its watch stream: "" (not watched: no live handoff), "connecting", "watching",
    #: "refused" (it answered the watch with an HTTP error: see `watch_status`) or "failing"
    #: (the stream broke or ended at once while the peer still answers heartbeats).
    watch: str = ""
    #: The HTTP status of the refusal while `watch` is "refused" (e.g. 404: a peer too old to
    #: serve the route; 401/403: a credential mismatch).
    watch_status: int | None = None
    #: Why the watch is refused or failing, as the last attempt said; "" otherwise.
    watch_detail: str = ""
    #: Connections its current watch attempted (a watch starts afresh when the peer shares
    #: handoffs again after none, or is back after a loss).
    watch_attempts: int = 0
    #: Reachable now: heard within the silence timeout and not lost since (never heard: not
    #: up). What `kvhandoff_peer_up`, `/readyz` and the dashboard's "up" say.
    up: bool = False
    #: Named in the configuration (`peers.prefill`): watched whether or not anything is in
    #: flight with it, and what the decode's readiness asks about.
    configured: bool = False


@dataclass
class _Row:
    active_at: float  # last time it was heard or shared live handoffs (what idleness counts)
    heard_at: float | None = None
    misses: int = 0
    losses: int = 0


class HealthTable:
    """Rows by peer URL; every method that adds a row keeps the table within its bounds."""

    def __init__(
        self,
        *,
        clock: Callable[[], float],
        forget_after_s: float,
        max_peers: int,
        configured: Iterable[str] = (),
    ) -> None:
        self._clock = clock
        self._configured = frozenset(u.rstrip("/") for u in configured)
        self._live: frozenset[str] = frozenset()
        self.forget_after_s = forget_after_s
        self.max_peers = max_peers
        self._rows: dict[str, _Row] = {}

    def __len__(self) -> int:
        return len(self._rows)

    def __contains__(self, url: object) -> bool:
        return url in self._rows

    def pin(self, live: Iterable[str]) -> None:
        """`live` are the peers sharing live handoffs now: keep them (and count them active),
        then forget what has been idle too long. Called once per heartbeat round."""
        now = self._clock()
        self._live = frozenset(live)
        for url in self._live:
            self._row(url, now).active_at = now
        self._prune(now)

    def shared(self, url: str) -> None:
        """`url` was just named by a handoff (before any round pinned it): track it now."""
        self._row(url, self._clock()).active_at = self._clock()

    def heard(self, url: str) -> None:
        now = self._clock()
        row = self._row(url, now)
        row.heard_at = row.active_at = now

    def missed(self, url: str) -> None:
        self._row(url, self._clock()).misses += 1

    def lost(self, url: str) -> None:
        self._row(url, self._clock()).losses += 1

    def rows(self) -> list[tuple[str, float | None, int, int]]:
        """(url, seconds since heard or None, misses, losses), by URL."""
        now = self._clock()
        return [
            (url, None if r.heard_at is None else now - r.heard_at, r.misses, r.losses)
            for url, r in sorted(self._rows.items())
        ]

    def _pinned(self, url: str) -> bool:
        return url in self._live or url.rstrip("/") in self._configured

    def _row(self, url: str, now: float) -> _Row:
        row = self._rows.get(url)
        if row is None:
            row = self._rows[url] = _Row(active_at=now)
            if len(self._rows) > self.max_peers:
                self._evict_one()
        return row

    def _evict_one(self) -> None:
        """Forget the unpinned row idle longest (the one just added is the newest; it goes only
        when every other row is pinned)."""
        unpinned = [(r.active_at, url) for url, r in self._rows.items() if not self._pinned(url)]
        if unpinned:
            del self._rows[min(unpinned)[1]]

    def _prune(self, now: float) -> None:
        idle = [
            url
            for url, row in self._rows.items()
            if not self._pinned(url) and now - row.active_at > self.forget_after_s
        ]
        for url in idle:
            del self._rows[url]
