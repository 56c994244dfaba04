"""What the decode side's heartbeats ask of its handoffs, and what their answers do to them.

Called through the decode pipeline by the service's heartbeat task
(`kvhandoff.service.peers.heartbeat`): whom to ping and what to check each answer against
(`live_by_prefill`, `live_with`), and what it learned: a prefill peer lost or back (`peer_lost`,
`peer_back`), restarted, or no longer running a handoff it was given (`reconcile`). A failure here
is an outcome only; a peer's writers count as stopped only on its own word (SAFETY.md I4), never
because it went silent (L1, L3).
"""

from __future__ import annotations

from collections.abc import Callable

from kvhandoff.pipelines.decode.handoff import DecodeHandoff, DecodeStage
from kvhandoff.pipelines.decode.outcomes import Outcomes
from kvhandoff.pipelines.decode.prefill_peers import PrefillDirectory
from kvhandoff.pipelines.decode.release import Releases
from kvhandoff.pipelines.messages import HeartbeatAck


class PrefillWatch:
    def __init__(
        self,
        handoffs: dict[str, DecodeHandoff],
        peers: PrefillDirectory,
        outcomes: Outcomes,
        releases: Releases,
    ) -> None:
        self._handoffs = handoffs  # the pipeline's own dict, read live
        self._unreleased = releases.unreleased  # the same, unreleased only: what is scanned
        self._peers = peers
        self._outcomes = outcomes
        self._releases = releases

    def live_by_prefill(self) -> dict[str, list[str]]:
        """Whom the heartbeats must ping (every prefill with an unreleased handoff) and, per
        peer, the handoffs it has accepted the destination of (what the answer is checked
        against)."""
        out: dict[str, list[str]] = {}
        for h in self._unreleased.values():
            for peer in h.peers:
                ids = out.setdefault(peer, [])
                if all(s.delivered for s in h.stages.values() if s.peer == peer):
                    ids.append(h.id)
        return out

    def live_with(self, url: str) -> list[str]:
        """Every unreleased handoff with a stage on prefill `url` (a heartbeat answer)."""
        return [
            h.id for h in self._unreleased.values() if any(s.peer == url for s in h.stages.values())
        ]

    def peer_lost(self, url: str, reason: str) -> list[str]:
        """A prefill service went silent or refuses connections: fail every handoff that waits
        on one of its stages. Its writers are not confirmed stopped: their pages stay leased
        until the bound passes (or the peer answers an abort after all)."""
        self._peers.mark_lost(url)  # and forgets its layouts: a restart registers new addresses
        return self._fail_peer_stages(url, reason)

    def peer_back(self, url: str) -> None:
        self._peers.mark_back(url)

    def reconcile(self, url: str, ack: HeartbeatAck, sent: list[str]) -> list[str]:
        """A heartbeat answer from prefill `url`: a stage bound to another life of it fails (the
        process restarted), and a handoff listed in `sent` (delivered before the ping) that the
        peer no longer runs fails at once. Returns the failed handoff ids."""
        victims = set(
            self._fail_peer_stages(
                url,
                f"restarted (incarnation {ack.incarnation})",
                only=lambda s: s.incarnation != ack.incarnation,
            )
        )
        theirs = set(ack.live)
        for hid in sent:
            h = self._handoffs.get(hid)
            if h is None or hid in theirs:
                continue
            gone = [
                r
                for r, s in h.stages.items()
                if s.peer == url and s.delivered and s.incarnation == ack.incarnation
            ]
            for r in gone:
                # The peer ended its work on it: its task drained before it forgot the handoff.
                self._releases.confirm_stopped(h, h.stages[r])
            waiting = [r for r in gone if not h.stages[r].state.final]
            if waiting and not h.state.terminal:
                self._outcomes.fail_stages(h, url, waiting, "no longer has this handoff")
                victims.add(hid)
        return sorted(victims)

    def _fail_peer_stages(
        self, url: str, reason: str, only: Callable[[DecodeStage], bool] = lambda s: True
    ) -> list[str]:
        """Fail every unreleased handoff waiting on a stage of prefill `url` (of those `only`
        selects). Returns the handoffs this failed."""
        victims = []
        for h in list(self._unreleased.values()):
            ranks = [
                r
                for r, s in sorted(h.stages.items())
                if s.peer == url and not s.state.final and only(s)
            ]
            if not ranks:
                continue
            h.progress.set()  # a quiesce retrying this peer reconsiders now
            if self._outcomes.fail_stages(h, url, ranks, reason):
                victims.append(h.id)
        return victims
