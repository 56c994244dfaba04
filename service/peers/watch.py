"""One peer's watch stream: held open, retried with backoff, and the kill verdict when it breaks.

A live peer is watched over one idle streaming connection (`GET /v1/peer/watch`), which the
kernel of a killed process closes at once. `PeerWatch.run` holds it; when it ends:

- **refused** (the peer answered with an HTTP error: 404 from a version without the route,
  401/403 on a credential mismatch, 5xx): the peer is alive, so nothing is probed; the watch is
  tried again after a backoff;
- **broken** (the connection closed, failed or went idle): the peer is probed
  (`refuses(peer)`); if every probe is refused, its process is gone: `lost(peer, reason)` and the
  watch ends. Otherwise it is watched again: soon if the stream *lived* (stayed open at least
  `lived_s`: e.g. a proxy closed an idle connection), after a backoff if it ended at once.

Backoff: the n-th failure in a row waits `min(max_s, min_s * 2**(n-1))`, jittered down to half
of that ("equal jitter": peers that failed together spread out, yet never retry faster than half
the step); a stream that lived resets it. The state (`watch`, `status`, `detail`, `attempts`) is
read by `Heartbeats.health()` and logged once per change, never per attempt — an operator sees
"watch refused: HTTP 404" once, and the retries stay a few per minute. Used by
`kvhandoff.service.peers.heartbeat`.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from kvhandoff.pipelines.errors import KVHandoffError, PeerUnreachable
from kvhandoff.service.http.problems import status_of

log = logging.getLogger("kvhandoff.heartbeat")

#: Holds `peer`'s watch stream until it ends (raising why); calls the callback once it is open.
Open = Callable[[str, Callable[[], None]], Awaitable[None]]


@dataclass(frozen=True)
class Backoff:
    """Delays between failed watch attempts; `rand()` draws from [0, 1)."""

    min_s: float
    max_s: float
    rand: Callable[[], float]

    def delay_s(self, failures: int) -> float:
        """The wait after the `failures`-th failure in a row (failures >= 1)."""
        step = min(self.max_s, self.min_s * 2.0 ** min(failures - 1, 62))
        return step / 2 + self.rand() * step / 2


class PeerWatch:
    """The watch of one peer, for as long as `run()` runs (the heartbeats cancel it when the
    peer shares nothing any more)."""

    def __init__(
        self,
        peer: str,
        *,
        open_stream: Open,
        refuses: Callable[[str], Awaitable[bool]],
        lost: Callable[[str, str], None],
        backoff: Backoff,
        lived_s: float,
        rewatch_s: float,
        clock: Callable[[], float],
        sleep: Callable[[float], Awaitable[None]],
        reported: tuple[str, int | None] | None = None,
    ) -> None:
        self.peer = peer
        self._open = open_stream
        self._refuses = refuses
        self._lost = lost
        self._backoff = backoff
        self._lived_s = lived_s
        self._rewatch_s = rewatch_s
        self._clock = clock
        self._sleep = sleep
        self.state = "connecting"
        self.status: int | None = None  # HTTP status of a refusal
        self.detail = ""
        self.attempts = 0
        self.failures = 0  # attempts in a row that neither lived nor were lost
        self._opened_at: float | None = None
        # The last state logged (`reported`: by an earlier watch of the peer, so a peer that
        # refuses every watch is not logged again each time it shares handoffs again).
        self.reported = reported

    async def run(self) -> None:
        """Watch until the peer is judged gone (then `lost` was called) or the task is cancelled."""
        while True:
            self.attempts += 1
            self._opened_at = None
            try:
                await self._open(self.peer, self._opened)
                ended: KVHandoffError = PeerUnreachable(
                    f"{self.peer} ended the watch stream", peer=self.peer
                )
            except KVHandoffError as exc:
                ended = exc
            lived = self._opened_at is not None and self._clock() - self._opened_at >= self._lived_s
            if isinstance(ended, PeerUnreachable):
                if await self._refuses(self.peer):
                    self._lost(
                        self.peer, "refuses connections (its process ended: the connection closed)"
                    )
                    return
                # Still answering (or only slow: the silence timeout judges that).
                if lived:
                    self._set("connecting", None, "")
                else:
                    self._set("failing", None, ended.message)
            else:
                raw = ended.context.get("status")
                status = raw if isinstance(raw, int) else status_of(ended)
                self._set("refused", status, f"{ended.code}: {ended.message}")
            if lived:
                self.failures = 0
                await self._sleep(self._rewatch_s)
            else:
                self.failures += 1
                await self._sleep(self._backoff.delay_s(self.failures))

    def _opened(self) -> None:
        self._opened_at = self._clock()
        self.state, self.status, self.detail = "watching", None, ""
        # A peer that refused the route accepts it now: say so at once. After streams that
        # ended at once, an open stream proves nothing yet: that is said once one lived.
        if self.reported is None or self.reported[0] == "refused":
            self._report("watching", None)

    def _set(self, state: str, status: int | None, detail: str) -> None:
        """Record how an attempt ended ("connecting": it lived and ended); log a change."""
        self.state, self.status, self.detail = state, status, detail
        self._report("watching" if state == "connecting" else state, status)

    def _report(self, state: str, status: int | None) -> None:
        """Log `state` if it differs from the last one logged: once per change, not per try."""
        previous, self.reported = self.reported, (state, status)
        if previous == self.reported:
            return
        if state == "refused":
            log.warning(
                "watch of peer %s refused: HTTP %s (%s); retrying with backoff, and a kill of it "
                "is noticed by heartbeat silence only until the watch is accepted",
                self.peer,
                status,
                self.detail,
            )
        elif state == "failing":
            log.warning(
                "watch of peer %s ends at once while it still answers (%s); retrying with backoff",
                self.peer,
                self.detail,
            )
        elif previous is not None:
            log.info(
                "watch of peer %s open again after %d attempts (%s before)",
                self.peer,
                self.attempts,
                previous[0],
            )
        else:
            log.debug("watch of peer %s open", self.peer)
