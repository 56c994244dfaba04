"""Heartbeats between services that share live handoffs, and the verdict on silent peers.

Every `interval_s`, a service sends a heartbeat to each peer it has live handoffs with (the
decode side to its prefill services, each prefill service to its decode services), naming its
incarnation and the handoffs it runs with that peer. The answer names the peer's incarnation and
the handoffs *it* runs with us: the role's pipeline reconciles the two (a handoff the peer no
longer has, or one bound to an earlier life of the peer, fails at once).

A peer counts as heard when it answers one, or sends one itself. Two ways to lose it:

- **killed**: besides the heartbeats, each live peer is watched over one idle streaming
  connection (`watch`), which a killed process's kernel closes at once. Then the peer is probed
  `confirm_probes` times, `confirm_s` apart; if each probe is refused (not merely slow), it is
  lost now, well under a heartbeat interval after the kill;
- **hung** (stopped, partitioned): the connection stays open but nothing answers; it is lost once
  it has not been heard for more than `timeout_s`.

A lost peer is declared once, and again only after it was heard in between. Used by
`service.runtime.pipelines` (which runs `run()` and stops it) and `service.api.peer` (`receive`).
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

from msgspec import Struct

from pipelines.errors import KVHandoffError, PeerUnreachable
from pipelines.messages import HeartbeatAck, HeartbeatMsg
from service.http.problems import PeerTimeout
from service.peers.protocol import HttpPeers

log = logging.getLogger("kvhandoff.heartbeat")

Live = Callable[[], dict[str, list[str]]]
Reconcile = Callable[[str, HeartbeatAck, list[str]], Awaitable[Any] | Any]


class PeerHealth(Struct, frozen=True):
    """One peer as the heartbeats see it (read by metrics and the dashboard)."""

    url: str
    last_heard_s: float | None  # seconds since it was last heard; None: never
    lost: bool  # declared lost and not heard since
    misses: int  # heartbeats to it that failed, since start
    losses: int  # times it was declared lost, since start


class Heartbeats:
    def __init__(
        self,
        *,
        url: str,
        role: str,
        peers: HttpPeers,
        incarnation: str = "-",
        interval_s: float = 1.0,
        timeout_s: float = 3.0,
        confirm_s: float = 0.1,
        confirm_probes: int = 2,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._url = url
        self._role = role
        self._peers = peers
        self.incarnation = incarnation
        self._live: Live = dict
        self._lost: Callable[[str, str], Awaitable[Any] | Any] = lambda peer, why: None
        self._back: Callable[[str], None] | None = None
        self._reconcile: Reconcile | None = None
        self._listing: Callable[[str], list[str]] = lambda peer: []
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self.confirm_s = confirm_s
        self.confirm_probes = confirm_probes
        self._clock = clock
        self._last: dict[str, float] = {}  # peers with live handoffs -> last time heard
        self._lost_peers: set[str] = set()
        # Cumulative, for metrics: one entry per peer ever shared (a deployment's peers).
        self._heard_at: dict[str, float] = {}
        self._misses: dict[str, int] = {}
        self._losses: dict[str, int] = {}
        self._watchers: dict[str, asyncio.Task[None]] = {}

    def health(self) -> list[PeerHealth]:
        """Every peer shared so far, by URL."""
        now = self._clock()
        peers = sorted(self._heard_at.keys() | self._misses.keys() | self._losses.keys())
        return [
            PeerHealth(
                url=url,
                last_heard_s=now - self._heard_at[url] if url in self._heard_at else None,
                lost=url in self._lost_peers,
                misses=self._misses.get(url, 0),
                losses=self._losses.get(url, 0),
            )
            for url in peers
        ]

    def watch(
        self,
        *,
        live: Live,
        lost: Callable[[str, str], Awaitable[Any] | Any],
        back: Callable[[str], None] | None = None,
        reconcile: Reconcile | None = None,
        listing: Callable[[str], list[str]] | None = None,
    ) -> None:
        """The role's pipeline: whom to ping (`live`: peer URL -> the handoff ids to reconcile
        the answer against), whom to tell a peer is lost (`lost(url, reason)`) or back
        (`back(url)`), who checks an answer (`reconcile(url, ack, sent_ids)`), and what to
        answer a peer's heartbeat with (`listing(url)`: the handoffs run with it)."""
        self._live, self._lost, self._back = live, lost, back
        self._reconcile = reconcile
        if listing is not None:
            self._listing = listing

    def follow(self, peers: list[str]) -> None:
        """A handoff with `peers` was just created or delivered: watch them now, not at the next
        round, so a kill right after is noticed at once. Called by the role's pipeline."""
        loop = asyncio.get_running_loop()
        now = self._clock()
        for peer in peers:
            self._last.setdefault(peer, now)
            if peer not in self._watchers and peer not in self._lost_peers:
                self._watchers[peer] = loop.create_task(
                    self._watch(peer), name=f"kvhandoff-watch:{peer}"
                )

    def heard(self, url: str) -> None:
        """`url` answered or sent a heartbeat."""
        self._heard_at[url] = self._clock()
        if url in self._last:
            self._last[url] = self._clock()
        if url in self._lost_peers:
            self._lost_peers.discard(url)
            log.info("peer %s is back", url)
            if self._back is not None:
                self._back(url)

    def receive(self, msg: HeartbeatMsg) -> HeartbeatAck:
        """A peer's heartbeat: it is alive; answer with our life and our handoffs with it."""
        self.heard(msg.sender_url)
        return HeartbeatAck(
            role=self._role,
            url=self._url,
            incarnation=self.incarnation,
            live=self._listing(msg.sender_url),
        )

    async def run(self) -> None:
        try:
            while True:
                try:
                    await self.tick()
                # The task outlives any one round: a bug in a callback is logged with its
                # traceback, and the next round runs (a dead heartbeat task would leave every
                # peer's loss undetected).
                except Exception:
                    log.exception("heartbeat round failed")
                await asyncio.sleep(self.interval_s)
        finally:
            await self._stop_watchers(set(self._watchers))

    async def tick(self) -> None:
        """One round: ping every peer sharing live handoffs, then judge the silent ones."""
        live = self._live()
        now = self._clock()
        for peer in list(self._last):
            if peer not in live:
                del self._last[peer]  # nothing shared any more: a later handoff starts afresh
        self._lost_peers &= set(live)  # per-peer state lives only while handoffs are shared
        for peer in live:
            self._last.setdefault(peer, now)  # a new peer gets a full window
        await self._stop_watchers(set(self._watchers) - set(live))
        self.follow(list(live))
        await asyncio.gather(*(self._ping(peer, ids) for peer, ids in live.items()))
        now = self._clock()
        for peer in list(live):
            if peer in self._lost_peers:
                continue  # declared once; again only after it was heard in between
            silent = now - self._last.get(peer, now)
            if silent > self.timeout_s:
                reason = f"was silent for {silent:.1f} s (heartbeat timeout {self.timeout_s:g} s)"
                await self._declare_lost(peer, reason)

    async def _declare_lost(self, peer: str, reason: str) -> None:
        if peer in self._lost_peers:
            return
        self._last.pop(peer, None)
        self._lost_peers.add(peer)
        self._losses[peer] = self._losses.get(peer, 0) + 1
        log.warning("peer %s %s; failing its handoffs", peer, reason)
        result = self._lost(peer, reason)
        if inspect.isawaitable(result):
            await result

    async def _ping(self, peer: str, handoff_ids: list[str]) -> None:
        msg = HeartbeatMsg(
            sender_url=self._url,
            sender_incarnation=self.incarnation,
            role=self._role,
            live=handoff_ids,
        )
        try:
            ack = await self._peers.heartbeat(peer, msg, timeout_s=self.interval_s)
        except KVHandoffError as exc:
            log.debug("heartbeat to %s failed: %s", peer, exc)
            self._misses[peer] = self._misses.get(peer, 0) + 1
            return
        self.heard(peer)
        if self._reconcile is not None:
            result = self._reconcile(peer, ack, handoff_ids)
            if inspect.isawaitable(result):
                await result

    async def _watch(self, peer: str) -> None:
        """Hold one idle connection to `peer`; when it breaks, confirm by probing that the
        peer refuses connections, and declare it lost at once if so."""
        try:
            while peer not in self._lost_peers:
                try:
                    await self._peers.watch(peer)  # returns or raises when the connection ends
                except KVHandoffError as exc:
                    log.debug("watch of %s ended: %s", peer, exc)
                if await self._refuses(peer):
                    await self._declare_lost(
                        peer, "refuses connections (its process ended: the connection closed)"
                    )
                    return
                # Still answering (or only slow: the silence timeout judges that); watch again.
                await asyncio.sleep(self.confirm_s)
        finally:
            if self._watchers.get(peer) is asyncio.current_task():
                del self._watchers[peer]

    async def _refuses(self, peer: str) -> bool:
        """Whether each of `confirm_probes` probes, `confirm_s` apart, is refused."""
        for i in range(self.confirm_probes):
            if i:
                await asyncio.sleep(self.confirm_s)
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

    async def _stop_watchers(self, peers: set[str]) -> None:
        tasks = [self._watchers.pop(p) for p in peers if p in self._watchers]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
