"""Heartbeats between services that share live handoffs, and the verdict on silent peers.

Every `interval_s`, a service sends a heartbeat to each peer it has live handoffs with (the
decode side to its prefill services, each prefill service to its decode services), and to each
configured peer (`peers.prefill`) whether or not anything is in flight with it — so "up" on the
dashboard and `kvhandoff_peer_up` mean reachable now, and a stage that dies while idle is lost
before the next handoff waits on it — naming its incarnation and the handoffs it runs with that
peer. The answer names the peer's incarnation and
the handoffs *it* runs with us: the role's pipeline reconciles the two (a handoff the peer no
longer has, or one bound to an earlier life of the peer, fails at once).

A peer counts as heard when it answers one, or sends one itself. Two ways to lose it:

- **killed**: besides the heartbeats, each live peer is watched over one idle streaming
  connection (`kvhandoff.service.peers.watch`), which a killed process's kernel closes at once. Then
  the peer is probed `confirm_probes` times, `confirm_s` apart; if each probe is refused (not merely
  slow), it is lost now, well under a heartbeat interval after the kill;
- **hung** (stopped, partitioned): the connection stays open but nothing answers; it is lost once
  it has not been heard for more than `timeout_s`.

A lost peer is declared once, and again only after it was heard in between.

What the heartbeats ask of the role's pipeline is one small protocol, `PeerSide`, which each
role implements (`kvhandoff.service.runtime.roles`): whom to ping, what to answer, what a loss or an
answer means. Their settings are one `HeartbeatSettings`, taken from the configuration.

Peers are independent: a round only *starts* work, in tasks of their own. Each peer has at most
one ping in flight (bounded by `interval_s`: a slow peer skips rounds, its pings never pile up),
at most one reconciliation of an answer (the pings go on meanwhile), and what the pipeline does
with a loss (failing that peer's handoffs) runs on its own. So one dead, hung or slow peer, or a
slow or failing callback about it, never delays the heartbeats to the others or the verdict on
them. Per-peer health for metrics and the dashboard is a bounded table
(`kvhandoff.service.peers.health`). Used by `kvhandoff.service.runtime.roles` (which runs `run()`
and stops it) and `kvhandoff.service.api.peer` (`receive`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import random
import time
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, Protocol

from kvhandoff.pipelines.errors import KVHandoffError, PeerUnreachable
from kvhandoff.pipelines.messages import HeartbeatAck, HeartbeatMsg
from kvhandoff.service.config import HandoffConfig, PeersConfig
from kvhandoff.service.http.problems import PeerTimeout
from kvhandoff.service.peers.health import HealthTable, PeerHealth
from kvhandoff.service.peers.protocol import HttpPeers
from kvhandoff.service.peers.watch import Backoff, PeerWatch
from kvhandoff.service.tasks import TaskOwner

__all__ = ["HeartbeatSettings", "Heartbeats", "PeerHealth", "PeerSide"]

log = logging.getLogger("kvhandoff.heartbeat")


class PeerSide(Protocol):
    """What the heartbeats need from the role's pipeline; each role implements it once
    (`kvhandoff.service.runtime.roles`). Called on the event loop; none may block it."""

    def live(self) -> dict[str, list[str]]:
        """Whom to ping: peer URL -> the handoff ids its answer is reconciled against."""
        ...

    def listing(self, url: str) -> list[str]:
        """What to answer peer `url`'s heartbeat with: the handoffs run with it."""
        ...

    async def lost(self, url: str, reason: str) -> None:
        """Peer `url` is gone: fail what waits on it (may take its time: runs in its own task)."""
        ...

    def back(self, url: str) -> None:
        """Peer `url`, declared lost, was heard again."""
        ...

    async def reconcile(self, url: str, ack: HeartbeatAck, sent: list[str]) -> None:
        """Check peer `url`'s answer to a heartbeat that named `sent` (one at a time per peer)."""
        ...


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class HeartbeatSettings:
    """The heartbeats' knobs. Those a deployment sets live in the configuration and are taken
    from it (`of`), so their defaults are written once, there."""

    interval_s: float
    #: A peer silent for longer than this is lost.
    timeout_s: float
    forget_after_s: float
    max_peers: int
    watch_retry_min_s: float
    watch_retry_max_s: float
    #: Peers the health table keeps whatever happens (the configured prefill services).
    configured: tuple[str, ...] = ()
    #: A broken watch is confirmed by this many refused probes, this far apart.
    confirm_s: float = 0.1
    confirm_probes: int = 2

    @classmethod
    def of(
        cls,
        handoff: HandoffConfig | None = None,
        peers: PeersConfig | None = None,
        **overrides: Any,
    ) -> HeartbeatSettings:
        """The settings of `handoff` and `peers` (their defaults when None), then `overrides`."""
        h = handoff if handoff is not None else HandoffConfig()
        p = peers if peers is not None else PeersConfig()
        settings = cls(
            interval_s=h.heartbeat_interval_s,
            timeout_s=h.peer_timeout_s,
            forget_after_s=p.forget_after_s,
            max_peers=p.max_tracked,
            watch_retry_min_s=p.watch_retry_min_s,
            watch_retry_max_s=p.watch_retry_max_s,
            configured=tuple(p.prefill),
        )
        return dataclasses.replace(settings, **overrides)


class Heartbeats:
    def __init__(
        self,
        *,
        url: str,
        role: str,
        peers: HttpPeers,
        side: PeerSide,
        settings: HeartbeatSettings,
        incarnation: str = "-",
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
        rand: Callable[[], float] = random.random,
    ) -> None:
        self._url = url
        self._role = role
        self._peers = peers
        self.incarnation = incarnation
        #: The role's pipeline, as the heartbeats see it.
        self.side = side
        self.interval_s = settings.interval_s
        self.timeout_s = settings.timeout_s
        self.confirm_s = settings.confirm_s
        self.confirm_probes = settings.confirm_probes
        self._clock = clock
        self._sleep = sleep
        self._configured = settings.configured
        self._backoff = Backoff(settings.watch_retry_min_s, settings.watch_retry_max_s, rand)
        self._last: dict[str, float] = {}  # peers watched (live or configured) -> last heard
        self._lost_peers: set[str] = set()
        # For metrics and the dashboard: configured and live peers, and others for a while.
        self._table = HealthTable(
            clock=clock,
            configured=settings.configured,
            forget_after_s=settings.forget_after_s,
            max_peers=settings.max_peers,
        )
        self._watchers: dict[str, tuple[PeerWatch, asyncio.Task[None]]] = {}
        self._beats: dict[str, asyncio.Task[None]] = {}  # each peer's ping in flight
        self._reconciling: dict[str, asyncio.Task[None]] = {}  # each peer's answer being checked
        self._tasks = TaskOwner("heartbeats")  # every task started here, until it ends
        # What ended watches last logged, for the next watch of the same peer (health table's).
        self._watch_reported: dict[str, tuple[str, int | None]] = {}

    def health(self) -> list[PeerHealth]:
        """The peers of the health table (configured, live, or heard lately), by URL."""
        out = []
        configured = set(self._configured)
        for url, heard_s, misses, losses in self._table.rows():
            w = self._watchers.get(url)
            watch = w[0] if w is not None else None
            lost = url in self._lost_peers
            out.append(
                PeerHealth(
                    url=url,
                    last_heard_s=heard_s,
                    lost=lost,
                    misses=misses,
                    losses=losses,
                    up=not lost and heard_s is not None and heard_s <= self.timeout_s,
                    configured=url in configured,
                    watch="" if watch is None else watch.state,
                    watch_status=None if watch is None else watch.status,
                    watch_detail="" if watch is None else watch.detail,
                    watch_attempts=0 if watch is None else watch.attempts,
                )
            )
        return out

    def joined(self, peers: list[str]) -> None:
        """A handoff with `peers` was just created (their layouts fetched or cached: they answered
        since any loss, which makes the decode forget a layout) or delivered (by that peer).
        Called by the role's pipeline. A peer lost earlier is back: were it still marked lost,
        neither its watch nor its silence could declare it lost again, and the new handoff
        would wait for its deadline if it died once more."""
        for peer in peers:
            if peer in self._lost_peers:
                self.heard(peer)
        self.follow(peers)

    def follow(self, peers: list[str]) -> None:
        """Watch `peers` now, not at the next round, so a kill right after is noticed at once."""
        if self._tasks.closing:
            return  # stopped: a handoff joining now (on the way out) is not watched
        now = self._clock()
        for peer in peers:
            self._last.setdefault(peer, now)
            self._table.shared(peer)
            if peer not in self._watchers and peer not in self._lost_peers:
                watch = PeerWatch(
                    peer,
                    open_stream=self._peers.watch,
                    refuses=self._refuses,
                    lost=self._declare_lost,
                    backoff=self._backoff,
                    # The peer streams a byte every heartbeat interval: a stream open that long
                    # was accepted and working, whatever ended it.
                    lived_s=self.interval_s,
                    rewatch_s=self.confirm_s,
                    clock=self._clock,
                    sleep=self._sleep,
                    reported=self._watch_reported.pop(peer, None),
                )
                task = self._spawn(self._watch(watch), f"kvhandoff-watch:{peer}")
                self._watchers[peer] = (watch, task)

    def heard(self, url: str) -> None:
        """`url` answered or sent a heartbeat."""
        self._table.heard(url)
        if url in self._last:
            self._last[url] = self._clock()
        if url in self._lost_peers:
            self._lost_peers.discard(url)
            log.info("peer %s is back", url)
            self.side.back(url)

    def receive(self, msg: HeartbeatMsg) -> HeartbeatAck:
        """A peer's heartbeat: it is alive; answer with our life and our handoffs with it."""
        self.heard(msg.sender_url)
        return HeartbeatAck(
            role=self._role,
            url=self._url,
            incarnation=self.incarnation,
            live=self.side.listing(msg.sender_url),
        )

    async def run(self) -> None:
        me = asyncio.current_task()
        try:
            while True:
                try:
                    await self.tick()
                # The task outlives any one round: a bug in a callback is logged with its
                # traceback, and the next round runs (a dead heartbeat task would leave every
                # peer's loss undetected). A CancelledError that is not this task's own
                # cancellation (a pipeline reading a future an abort just cancelled) is such a
                # bug too, not a reason to stop.
                except asyncio.CancelledError:
                    if me is not None and me.cancelling():
                        raise
                    log.exception("heartbeat round failed (a callback raised CancelledError)")
                except Exception:
                    log.exception("heartbeat round failed")
                await asyncio.sleep(self.interval_s)
        finally:
            await self.close()

    async def close(self) -> None:
        """Stop every beat, watch, reconciliation and loss handling started here."""
        await self._tasks.close()

    async def tick(self) -> None:
        """One round: start a beat to every configured peer and every peer sharing live
        handoffs (unless its last one is still running), then judge the silent ones. Waits for
        no peer (see `settled`)."""
        live = self._watched()
        now = self._clock()
        for peer in list(self._last):
            if peer not in live:
                del self._last[peer]  # nothing shared any more: a later handoff starts afresh
        # A lost peer stays shown lost while the health table tracks it (a landed handoff is
        # released at its outcome, so its peer is soon shared by nothing); a new handoff with
        # it clears the mark (`joined`), so it can be declared lost again at once.
        self._lost_peers = {p for p in self._lost_peers if p in live or p in self._table}
        for peer in live:
            self._last.setdefault(peer, now)  # a new peer gets a full window
        self._table.pin(live)
        for peer in [p for p in self._watch_reported if p not in self._table]:
            del self._watch_reported[peer]  # forgotten by the health table: forgotten here
        for peer in set(self._watchers) - set(live):
            self._watchers.pop(peer)[1].cancel()
        self.follow(list(live))
        for peer, ids in live.items():
            if peer not in self._beats:
                self._beats[peer] = self._spawn(self._beat(peer, ids), f"kvhandoff-beat:{peer}")
        for peer in live:
            if peer in self._lost_peers:
                continue  # declared once; again only after it was heard in between
            silent = now - self._last.get(peer, now)
            if silent > self.timeout_s:
                reason = f"was silent for {silent:.1f} s (heartbeat timeout {self.timeout_s:g} s)"
                self._declare_lost(peer, reason)

    def _watched(self) -> dict[str, list[str]]:
        """Whom this round pings: each configured peer (with nothing to reconcile when nothing
        is shared with it) and each peer the pipeline shares live handoffs with."""
        watched: dict[str, list[str]] = {peer: [] for peer in self._configured}
        watched.update(self.side.live())
        return watched

    async def settled(self) -> None:
        """Wait until the beats and loss handling started so far have ended (watches run on).
        For callers that step rounds by hand (`tick`), e.g. tests and tools."""
        watching = {task for _, task in self._watchers.values()}
        while pending := self._tasks.tasks - watching:
            await asyncio.wait(pending)
            watching = {task for _, task in self._watchers.values()}

    def _spawn(self, work: Coroutine[Any, Any, None], name: str) -> asyncio.Task[None]:
        # One peer's bug is logged with its traceback by the owner; the other peers carry on.
        return self._tasks.spawn(work, name)

    def _declare_lost(self, peer: str, reason: str) -> None:
        """Mark `peer` lost now; the pipeline fails its handoffs in a task of its own."""
        if peer in self._lost_peers or self._tasks.closing:
            return
        self._last.pop(peer, None)
        self._lost_peers.add(peer)
        self._table.lost(peer)
        log.warning("peer %s %s; failing its handoffs", peer, reason)
        self._spawn(self._handle_loss(peer, reason), f"kvhandoff-lost:{peer}")

    async def _handle_loss(self, peer: str, reason: str) -> None:
        await self.side.lost(peer, reason)

    async def _beat(self, peer: str, handoff_ids: list[str]) -> None:
        """Ping `peer` (bounded by `interval_s`); hand its answer to the reconciliation."""
        try:
            msg = HeartbeatMsg(
                sender_url=self._url,
                sender_incarnation=self.incarnation,
                role=self._role,
                live=handoff_ids,
            )
            ack = await self._peers.heartbeat(peer, msg, timeout_s=self.interval_s)
        except KVHandoffError as exc:
            log.debug("heartbeat to %s failed: %s", peer, exc)
            self._table.missed(peer)
            return
        finally:
            if self._beats.get(peer) is asyncio.current_task():
                del self._beats[peer]
        self.heard(peer)
        # The pipeline may take its time over an answer (a prefill aborts what the decode no
        # longer has); the pings go on meanwhile, so a busy peer is never judged silent. One
        # reconciliation per peer at a time: an answer that comes during one is not checked
        # (the next beat's is).
        if peer not in self._reconciling:
            self._reconciling[peer] = self._spawn(
                self._reconcile_answer(peer, ack, handoff_ids), f"kvhandoff-reconcile:{peer}"
            )

    async def _reconcile_answer(self, peer: str, ack: HeartbeatAck, sent: list[str]) -> None:
        try:
            await self.side.reconcile(peer, ack, sent)
        finally:
            if self._reconciling.get(peer) is asyncio.current_task():
                del self._reconciling[peer]

    async def _watch(self, watch: PeerWatch) -> None:
        try:
            await watch.run()
        finally:
            w = self._watchers.get(watch.peer)
            if w is not None and w[0] is watch:
                del self._watchers[watch.peer]
            if watch.reported is not None and watch.peer in self._table:
                self._watch_reported[watch.peer] = watch.reported

    async def _refuses(self, peer: str) -> bool:
        """Whether each of `confirm_probes` probes, `confirm_s` apart, is refused."""
        for i in range(self.confirm_probes):
            if i:
                await self._sleep(self.confirm_s)
            try:
                await self._peers.heartbeat(
                    peer,
                    HeartbeatMsg(
                        sender_url=self._url, sender_incarnation=self.incarnation, role=self._role
                    ),
                    timeout_s=self.interval_s,
                )
            except PeerTimeout:
                return False  # slow, not gone: the silence timeout decides
            except PeerUnreachable:
                continue
            except KVHandoffError:
                return False  # it answered, if with an error
            self.heard(peer)
            return False
        return True
