"""Heartbeats between services that share live handoffs, and the verdict on silent peers.

Every `interval_s`, a service sends a heartbeat to each peer it has live handoffs with (the
decode side to its prefill services, each prefill service to its decode services). A peer counts
as heard when it answers one, or sends one itself. A peer with live handoffs that has not been
heard for more than `timeout_s` is declared lost: its handoffs fail here, naming it (and, on the
decode side, its stages), instead of waiting for their deadlines. A killed process refuses the
connection and a stopped one times out; both go silent the same way.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

from msgspec import Struct

from pipelines.errors import KVHandoffError
from pipelines.messages import HeartbeatMsg
from service.peers.protocol import HttpPeers

log = logging.getLogger("kvhandoff.heartbeat")


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
        live: Callable[[], dict[str, list[str]]] | None = None,
        lost: Callable[[str, str], Awaitable[Any] | Any] | None = None,
        back: Callable[[str], None] | None = None,
        interval_s: float = 1.0,
        timeout_s: float = 3.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._url = url
        self._role = role
        self._peers = peers
        self._live: Callable[[], dict[str, list[str]]] = live or dict
        self._lost: Callable[[str, str], Awaitable[Any] | Any] = lost or (lambda peer, why: None)
        self._back = back
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self._clock = clock
        self._last: dict[str, float] = {}  # peers with live handoffs -> last time heard
        self._lost_peers: set[str] = set()
        # Cumulative, for metrics: one entry per peer ever shared (a deployment's peers).
        self._heard_at: dict[str, float] = {}
        self._misses: dict[str, int] = {}
        self._losses: dict[str, int] = {}

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
        live: Callable[[], dict[str, list[str]]],
        lost: Callable[[str, str], Awaitable[Any] | Any],
        back: Callable[[str], None] | None = None,
    ) -> None:
        """Whom to ping (`live`: peer URL -> live handoff ids), whom to tell a peer went silent
        (`lost(url, reason)`) and came back (`back(url)`): the role's pipeline."""
        self._live, self._lost, self._back = live, lost, back

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

    async def run(self) -> None:
        while True:
            await self.tick()
            await asyncio.sleep(self.interval_s)

    async def tick(self) -> None:
        """One round: ping every peer sharing live handoffs, then judge the silent ones."""
        live = self._live()
        now = self._clock()
        for peer in list(self._last):
            if peer not in live:
                del self._last[peer]  # nothing shared any more: a later handoff starts afresh
        for peer in live:
            self._last.setdefault(peer, now)  # a new peer gets a full window
        await asyncio.gather(*(self._ping(peer, ids) for peer, ids in live.items()))
        now = self._clock()
        for peer in list(live):
            silent = now - self._last.get(peer, now)
            if silent > self.timeout_s:
                del self._last[peer]
                self._lost_peers.add(peer)
                self._losses[peer] = self._losses.get(peer, 0) + 1
                reason = f"was silent for {silent:.1f} s (heartbeat timeout {self.timeout_s:g} s)"
                log.warning("peer %s %s; failing its handoffs", peer, reason)
                result = self._lost(peer, reason)
                if inspect.isawaitable(result):
                    await result

    async def _ping(self, peer: str, handoff_ids: list[str]) -> None:
        msg = HeartbeatMsg(sender_url=self._url, role=self._role, live=handoff_ids)
        try:
            await self._peers.heartbeat(peer, msg, timeout_s=self.interval_s)
        except KVHandoffError as exc:
            log.debug("heartbeat to %s failed: %s", peer, exc)
            self._misses[peer] = self._misses.get(peer, 0) + 1
            return
        self.heard(peer)
