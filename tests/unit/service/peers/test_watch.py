"""The watch stream of one peer (`kvhandoff.service.peers.watch`) against real HTTP peers on
127.0.0.1: refused or short-lived watches are retried with a capped, jittered backoff — a few
attempts a minute, never a loop — the state is exposed and logged once per change, and a stream that
lived resets the backoff. Time is `SteppedTime`: every wait of the watch is a step the test
takes."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable

import aiohttp
import pytest
from prometheus_client import CollectorRegistry, generate_latest

from kvhandoff.service.http.peer_client import PeerClient
from kvhandoff.service.observability.metrics import PeerCollector
from kvhandoff.service.peers.heartbeat import Heartbeats, HeartbeatSettings
from kvhandoff.service.peers.protocol import HttpPeers
from kvhandoff.service.peers.watch import Backoff
from tests.fakes import PeerServer, SteppedTime
from tests.unit.service.peers.test_heartbeat import Side

#: With rand() = 0.5, a step waits 3/4 of min(30, 0.5 * 2**(n-1)).
STEPS = [0.375, 0.75, 1.5, 3.0, 6.0, 12.0, 22.5]


class World:
    """One peer server, and a decode's `Heartbeats` over the real peer client, on stepped time
    (interval 30 s, watch backoff 0.5 s doubling up to 30 s, jitter fixed at its middle). The
    interval also bounds each real HTTP probe: a refused connection must never read as a slow
    peer because a loaded machine stalled this loop."""

    def __init__(self, server: PeerServer, session: aiohttp.ClientSession) -> None:
        self.server = server
        self.time = SteppedTime()
        self.lost: list[tuple[str, str]] = []
        self.peers = HttpPeers(PeerClient(session), watch_idle_s=30.0)
        self.live = {server.url: ["h1"]}
        self.hb = Heartbeats(
            url="http://decode:1",
            role="decode",
            peers=self.peers,
            side=Side(live=lambda: dict(self.live), lost=self._lost),
            settings=HeartbeatSettings.of(
                interval_s=30.0,
                timeout_s=90.0,
                confirm_s=0.1,
                watch_retry_min_s=0.5,
                watch_retry_max_s=30.0,
            ),
            clock=self.time,
            sleep=self.time.sleep,
            rand=lambda: 0.5,
        )
        self.opened = asyncio.Event()  # set once our side saw the peer accept a watch
        hold = self.peers.watch

        async def watch(url: str, opened: Callable[[], None] | None = None) -> None:
            def accepted() -> None:
                if opened is not None:
                    opened()
                self.opened.set()

            await hold(url, accepted)

        self.peers.watch = watch  # type: ignore[method-assign]

    def _lost(self, url: str, reason: str) -> None:
        self.lost.append((url, reason))

    async def run_until(self, end_s: float) -> None:
        """Let the watch run until its next wait would end past `end_s` (controlled time)."""
        while self.time.now + await self.time.next_sleep() <= end_s:
            self.time.wake()

    def health(self) -> tuple[str, int | None, int]:
        (h,) = self.hb.health()
        return h.watch, h.watch_status, h.watch_attempts

    async def close(self) -> None:
        await self.hb.close()
        await self.peers.close()


@pytest.fixture
async def session() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as s:
        yield s


def test_backoff_doubles_up_to_its_cap_and_jitters_down_to_half() -> None:
    low = Backoff(0.5, 30.0, rand=lambda: 0.0)
    high = Backoff(0.5, 30.0, rand=lambda: 0.999999)
    assert [low.delay_s(n) for n in (1, 2, 3, 7, 8, 200)] == [0.25, 0.5, 1.0, 15.0, 15.0, 15.0]
    assert [round(high.delay_s(n), 3) for n in (1, 2, 7, 200)] == [0.5, 1.0, 30.0, 30.0]


@pytest.mark.parametrize(
    ("answer", "state", "status"),
    [
        ("absent", "refused", 404),  # an older peer without the route
        (401, "refused", 401),  # a credential mismatch
        (503, "refused", 503),
        ("at_once", "failing", None),  # accepted, then the stream ends at once
    ],
)
async def test_a_refused_or_short_lived_watch_backs_off_instead_of_looping(
    session: aiohttp.ClientSession,
    caplog: pytest.LogCaptureFixture,
    answer: str | int,
    state: str,
    status: int | None,
) -> None:
    server = PeerServer(watch=answer)
    url = await server.start()
    w = World(server, session)
    caplog.set_level(logging.DEBUG, logger="kvhandoff.heartbeat")
    try:
        w.hb.follow([url])
        await w.run_until(120.0)
        # 11 attempts in two minutes (0.375 s, then doubling to 22.5 s apart), not thousands.
        assert w.time.delays == [*STEPS, 22.5, 22.5, 22.5, 22.5]
        assert server.watch_attempts == 11
        assert w.health() == (state, status, 11)
        assert w.lost == []  # it answers heartbeats: alive, kill detection just unavailable
        warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
        assert len(warnings) == 1 and url in warnings[0].getMessage()  # once, not per attempt
        assert (str(status) if status else "ends at once") in warnings[0].getMessage()
        registry = CollectorRegistry()
        registry.register(PeerCollector(w.hb.health))
        text = generate_latest(registry).decode()
        assert f'kvhandoff_peer_watch_state{{peer="{url}",state="{state}"}} 1.0' in text
        assert f'kvhandoff_peer_watch_state{{peer="{url}",state="watching"}} 0.0' in text
        assert f'kvhandoff_peer_watch_attempts_total{{peer="{url}"}} 11.0' in text
        if status is not None:
            assert f'kvhandoff_peer_watch_refused_status{{peer="{url}"}} {status}.0' in text
    finally:
        await w.close()
        await server.close()


async def test_a_stream_that_lived_resets_the_backoff(
    session: aiohttp.ClientSession, caplog: pytest.LogCaptureFixture
) -> None:
    server = PeerServer(watch=503)
    url = await server.start()
    w = World(server, session)
    caplog.set_level(logging.INFO, logger="kvhandoff.heartbeat")
    try:
        w.hb.follow([url])
        for _ in range(3):  # refused three times: the backoff grows
            await w.time.next_sleep()
            w.time.wake()
        assert await w.time.next_sleep() == STEPS[3]
        server.watch = "hold"  # the peer accepts the watch again
        w.time.wake()
        await w.opened.wait()
        assert w.health() == ("watching", None, 5)
        w.time.now += 30.0  # open for a heartbeat interval: it lived
        server.watch = 503
        server.end_watch.set()  # then the connection ends (e.g. a proxy's idle limit)
        assert await w.time.next_sleep() == 0.1  # probed, still answering: watched again soon
        w.time.wake()
        assert await w.time.next_sleep() == STEPS[0]  # refused once more: from the first step
        assert server.watch_attempts == 6 and w.lost == []
        messages = [r.getMessage() for r in caplog.records]
        # One line per change, none per attempt: refused, open again, refused.
        assert [m[: m.index(" (")] for m in messages] == [
            f"watch of peer {url} refused: HTTP 503",
            f"watch of peer {url} open again after 5 attempts",
            f"watch of peer {url} refused: HTTP 503",
        ]
    finally:
        await w.close()
        await server.close()


async def test_a_peer_that_refuses_every_watch_is_logged_once_across_its_handoffs(
    session: aiohttp.ClientSession, caplog: pytest.LogCaptureFixture
) -> None:
    server = PeerServer(watch="absent")
    url = await server.start()
    w = World(server, session)
    caplog.set_level(logging.WARNING, logger="kvhandoff.heartbeat")
    try:
        for _ in range(3):  # three handoffs with it, one after the other
            w.live = {url: ["h1"]}
            await w.hb.tick()  # watched again
            assert await w.time.next_sleep() == STEPS[0]  # refused: waiting to retry
            w.live = {}
            await w.hb.tick()  # nothing shared any more: the watch stops
            await w.hb.settled()
        assert server.watch_attempts == 3
        assert len(caplog.records) == 1 and "refused: HTTP 404" in caplog.records[0].getMessage()
    finally:
        await w.close()
        await server.close()


async def test_a_killed_peer_ends_its_watch_and_is_lost_without_backoff(
    session: aiohttp.ClientSession,
) -> None:
    server = PeerServer(watch="hold")
    url = await server.start()
    w = World(server, session)
    try:
        w.hb.follow([url])
        await w.opened.wait()
        await server.kill()  # its port now refuses, and the stream ends
        assert await w.time.next_sleep() == 0.1  # between the two refused probes
        (watching,) = [task for _, task in w.hb._watchers.values()]
        w.time.wake()
        await watching  # ends: the peer is gone
        await w.hb.settled()  # and its loss was handled
        assert [u for u, _ in w.lost] == [url] and "refuses connections" in w.lost[0][1]
        assert w.time.delays == [0.1]  # no backoff wait: lost at once
    finally:
        await w.close()
        await server.close()
