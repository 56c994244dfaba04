"""Heartbeats alone: silence, kills (a refused watch), reconciliation, robustness — over fake
peers and a fake clock."""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Callable
from typing import Any, cast

import aiohttp

from kvhandoff.pipelines.errors import InternalError, PeerUnreachable
from kvhandoff.pipelines.messages import HeartbeatAck, HeartbeatMsg
from kvhandoff.service.http.peer_client import PeerClient
from kvhandoff.service.http.problems import PeerTimeout
from kvhandoff.service.peers.heartbeat import Heartbeats, HeartbeatSettings
from kvhandoff.service.peers.protocol import HttpPeers
from tests.fakes import Clock, PeerServer, eventually

PEER = "http://prefill:1"


class FakePeers:
    """Answers heartbeats unless the peer is down (refused) or hung (times out); a watch is held
    until `drop` is set for that peer. Records what was sent."""

    def __init__(self) -> None:
        self.down: set[str] = set()
        self.hung: set[str] = set()
        self.sent: list[tuple[str, HeartbeatMsg]] = []
        self.live: dict[str, list[str]] = {}
        self.incarnation = "p1"
        self.drop: dict[str, asyncio.Event] = {}
        self.watching: dict[str, int] = {}

    async def heartbeat(self, url: str, msg: HeartbeatMsg, timeout_s: float) -> HeartbeatAck:
        self.sent.append((url, msg))
        if url in self.hung:
            raise PeerTimeout(f"{url} got no answer", peer=url)
        if url in self.down:
            raise PeerUnreachable(f"cannot reach {url}", peer=url)
        return HeartbeatAck(
            role="prefill", url=url, incarnation=self.incarnation, live=self.live.get(url, [])
        )

    async def watch(self, url: str, opened: Callable[[], None] | None = None) -> None:
        self.watching[url] = self.watching.get(url, 0) + 1
        if url in self.down:
            raise PeerUnreachable(f"cannot reach {url}", peer=url)
        if opened is not None:
            opened()
        await self.drop.setdefault(url, asyncio.Event()).wait()
        raise PeerUnreachable(f"{url} closed the connection", peer=url)


class Side:
    """A `PeerSide` made of callbacks (sync or async, as a test needs), as a pipeline would be."""

    def __init__(
        self,
        *,
        live: Callable[[], dict[str, list[str]]],
        lost: Callable[[str, str], Any],
        back: Callable[[str], None] | None = None,
        reconcile: Callable[[str, HeartbeatAck, list[str]], Any] | None = None,
        listing: Callable[[str], list[str]] | None = None,
    ) -> None:
        self._live, self._lost, self._back = live, lost, back
        self._reconcile, self._listing = reconcile, listing

    def live(self) -> dict[str, list[str]]:
        return self._live()

    def listing(self, url: str) -> list[str]:
        return self._listing(url) if self._listing is not None else []

    async def lost(self, url: str, reason: str) -> None:
        result = self._lost(url, reason)
        if inspect.isawaitable(result):
            await result

    def back(self, url: str) -> None:
        if self._back is not None:
            self._back(url)

    async def reconcile(self, url: str, ack: HeartbeatAck, sent: list[str]) -> None:
        if self._reconcile is not None:
            result = self._reconcile(url, ack, sent)
            if inspect.isawaitable(result):
                await result


class Beats:
    """A `Heartbeats` (interval 0.1 s, timeout 0.3 s) over fake peers and clock, with one live
    handoff on PEER. Declaring a peer lost ends its handoffs, as the pipelines do."""

    def __init__(self, **options: Any) -> None:
        self.clock = Clock(0.0)
        self.peers = FakePeers()
        self.live: dict[str, list[str]] = {PEER: ["h1"]}
        self.lost: list[tuple[str, str]] = []
        self.back: list[str] = []
        self.reconciled: list[tuple[str, HeartbeatAck, list[str]]] = []
        self.hb = Heartbeats(
            url="http://decode:1",
            role="decode",
            peers=cast(HttpPeers, self.peers),
            side=Side(
                live=lambda: dict(self.live),
                lost=self._lost,
                back=self.back.append,
                reconcile=lambda url, ack, sent: self.reconciled.append((url, ack, sent)),
                listing=lambda url: ["mine"],
            ),
            settings=HeartbeatSettings.of(
                interval_s=0.1, timeout_s=0.3, confirm_s=0.001, **options
            ),
            incarnation="d1",
            clock=self.clock,
        )

    def _lost(self, url: str, reason: str) -> None:
        self.lost.append((url, reason))

    async def tick_at(self, now: float) -> None:
        self.clock.now = now
        await self.hb.tick()
        await self.hb.settled()

    async def close(self) -> None:
        await self.hb.close()


def watch_state(b: Beats) -> str:
    (health,) = b.hb.health()
    return health.watch


async def test_heartbeats_declare_a_silent_peer_lost_once_after_the_timeout() -> None:
    b = Beats()
    b.peers.hung.add(PEER)  # a stopped process: the connection holds, nothing answers
    for now in (0.0, 0.1, 0.2, 0.3):
        await b.tick_at(now)
    assert b.lost == []  # silent for 0.3 s: not more than the timeout yet
    await b.tick_at(0.4)
    assert [url for url, _ in b.lost] == [PEER]
    assert "silent for 0.4 s" in b.lost[0][1]
    # Its handoffs are still quiescing (it stays in `live`): declared once, not every timeout.
    for now in (0.5, 1.0, 2.0):
        await b.tick_at(now)
    assert len(b.lost) == 1
    url, msg = b.peers.sent[0]
    assert (url, msg.sender_url, msg.sender_incarnation, msg.role, msg.live) == (
        PEER,
        "http://decode:1",
        "d1",
        "decode",
        ["h1"],
    )
    await b.close()


async def test_heartbeats_a_peer_that_is_heard_is_not_lost() -> None:
    b = Beats()
    b.peers.hung.add(PEER)  # our pings fail, but the peer's own heartbeats reach us
    await b.tick_at(0.0)
    b.clock.now = 0.25
    b.hb.heard(PEER)
    await b.tick_at(0.5)
    assert b.lost == []  # 0.25 s since heard
    await b.tick_at(0.6)
    assert [url for url, _ in b.lost] == [PEER]
    await b.close()


async def test_heartbeats_answered_pings_keep_a_peer_alive_and_are_reconciled() -> None:
    b = Beats()
    b.peers.live[PEER] = ["h1"]
    for step in range(20):
        await b.tick_at(step * 0.1)
    assert b.lost == [] and len(b.peers.sent) == 20
    url, ack, sent = b.reconciled[-1]
    assert (url, ack.incarnation, ack.live, sent) == (PEER, "p1", ["h1"], ["h1"])
    await b.close()


async def test_heartbeats_report_a_lost_peer_back_once_when_heard_again() -> None:
    b = Beats()
    b.peers.hung.add(PEER)
    await b.tick_at(0.0)
    await b.tick_at(0.5)
    assert len(b.lost) == 1 and b.back == []
    b.peers.hung.clear()
    b.live[PEER] = ["h2"]  # a new handoff with the peer, whose ping now answers
    await b.tick_at(0.6)
    assert b.back == [PEER]
    b.hb.heard(PEER)
    await b.tick_at(0.7)
    assert b.back == [PEER] and len(b.lost) == 1
    await b.close()


async def test_a_killed_peer_is_lost_as_soon_as_its_watch_breaks_and_connections_are_refused() -> (
    None
):
    b = Beats()
    await b.tick_at(0.0)  # starts the watch
    await asyncio.sleep(0)
    assert b.peers.watching == {PEER: 1}
    b.peers.down.add(PEER)  # the process is gone: its port refuses connections
    b.peers.drop[PEER].set()  # ... and its kernel closed our connection
    await eventually(lambda: bool(b.lost), what="the loss")  # after real confirm_s sleeps
    # Lost without any heartbeat round and with the fake clock standing still: not by silence.
    assert [url for url, _ in b.lost] == [PEER]
    assert "refuses connections" in b.lost[0][1]
    await b.tick_at(0.05)
    assert len(b.lost) == 1  # declared once
    await b.close()


async def test_a_lost_peer_that_joins_a_new_handoff_can_be_lost_again() -> None:
    # Killed, declared lost; its first handoff stays live (fenced until its bound). It restarts,
    # a new handoff with it is created (its layout fetched: it answered), and it dies again
    # before any heartbeat reached it: the new handoff must fail at once, not at its deadline.
    b = Beats()
    await b.tick_at(0.0)
    await asyncio.sleep(0)
    b.peers.down.add(PEER)
    b.peers.drop[PEER].set()
    await eventually(lambda: len(b.lost) == 1, what="the first loss")
    b.peers.down.discard(PEER)  # restarted
    b.peers.drop[PEER] = asyncio.Event()
    b.live[PEER] = ["h1", "h2"]
    b.hb.joined([PEER])
    assert b.back == [PEER]
    await eventually(lambda: b.peers.watching[PEER] > 1, what="the new watch")
    b.peers.down.add(PEER)  # killed again
    b.peers.drop[PEER].set()
    await eventually(lambda: len(b.lost) == 2, what="the second loss")
    assert "refuses connections" in b.lost[1][1]
    await b.close()


async def test_a_broken_watch_of_a_peer_that_still_answers_is_not_a_loss() -> None:
    b = Beats()
    await b.tick_at(0.0)
    await asyncio.sleep(0)
    b.clock.now = 0.1  # open for a heartbeat interval: the stream lived
    b.peers.drop[PEER].set()  # e.g. a proxy closed an idle connection
    # Watched again: only after its probe was answered, so the verdict (not lost) is in.
    await eventually(lambda: b.peers.watching[PEER] > 1, what="the watch again")
    assert b.lost == []
    await b.close()


async def test_a_hung_peer_is_not_lost_by_its_watch_only_by_silence() -> None:
    b = Beats()
    await b.tick_at(0.0)
    await asyncio.sleep(0)
    b.peers.hung.add(PEER)  # probes time out: slow is not gone
    b.peers.drop[PEER].set()
    # Judged a failing watch (retried after a backoff): only after its probe timed out, so the
    # verdict (not lost) is in.
    await eventually(lambda: watch_state(b) == "failing", what="the watch's verdict")
    assert b.lost == []
    await b.tick_at(0.4)
    assert [url for url, _ in b.lost] == [PEER] and "silent" in b.lost[0][1]
    await b.close()


async def test_the_heartbeat_task_survives_a_failing_callback() -> None:
    b = Beats()
    calls = 0

    def broken_live() -> dict[str, list[str]]:
        nonlocal calls
        calls += 1
        if calls == 1:
            raise InternalError("a bug in one round")
        return {}

    b.hb.side = Side(live=broken_live, lost=b._lost)
    b.hb.interval_s = 0.001
    task = asyncio.get_running_loop().create_task(b.hb.run())
    await eventually(lambda: calls >= 3 or task.done(), what="three rounds")
    assert calls >= 3 and not task.done()
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)


async def test_a_heartbeat_is_answered_with_our_incarnation_and_our_handoffs_with_the_sender() -> (
    None
):
    b = Beats()
    ack = b.hb.receive(HeartbeatMsg(sender_url=PEER, sender_incarnation="p1", role="prefill"))
    assert (ack.role, ack.url, ack.incarnation, ack.live) == (
        "decode",
        "http://decode:1",
        "d1",
        ["mine"],
    )


async def test_a_new_handoff_s_peer_is_watched_at_once_not_at_the_next_round() -> None:
    b = Beats()
    b.hb.joined([PEER])  # what the pipeline calls on create / delivery
    await asyncio.sleep(0)
    assert b.peers.watching == {PEER: 1} and b.peers.sent == []  # no round ran
    b.peers.down.add(PEER)
    b.peers.drop[PEER].set()
    await eventually(lambda: bool(b.lost), what="the loss")
    assert [url for url, _ in b.lost] == [PEER]
    await b.close()


async def test_a_hung_peer_and_the_slow_failing_of_its_handoffs_never_hold_up_the_others() -> None:
    """Real peers on 127.0.0.1: A hangs (its heartbeats are never answered), B answers. Rounds
    every 1,000 s of controlled time; a ping may take up to the interval, so a round that waited
    for A would never return within this test."""
    a, b = PeerServer(), PeerServer()
    url_a, url_b = await a.start(), await b.start()
    a.hold_heartbeats = True
    clock = Clock(0.0)
    failing = asyncio.Event()  # the pipeline's failing of A's handoffs, until the test ends
    lost: list[str] = []

    async def fail_handoffs_of(url: str, reason: str) -> None:
        lost.append(url)
        await failing.wait()

    async def beat_to_b_ends(n: int) -> None:
        await b.heartbeats_reach(n)  # B got it; now its answer is read and the beat ends
        beat = hb._beats.get(url_b)
        if beat is not None:
            await beat

    async with aiohttp.ClientSession() as session:
        peers = HttpPeers(PeerClient(session), watch_idle_s=10_000.0)
        hb = Heartbeats(
            url="http://decode:1",
            role="decode",
            peers=peers,
            side=Side(live=lambda: {url_a: ["a1"], url_b: ["b1"]}, lost=fail_handoffs_of),
            settings=HeartbeatSettings.of(interval_s=1000.0, timeout_s=2500.0),
            clock=clock,
        )
        try:
            for r in range(3):
                clock.now = 1000.0 * r
                await hb.tick()
                await beat_to_b_ends(r + 1)
            assert a.heartbeats == 1  # its one beat still hangs: later rounds skip it, no pile-up
            clock.now = 3000.0  # A silent for 3,000 s: lost; failing its handoffs takes long
            await hb.tick()
            await beat_to_b_ends(4)
            for r in (4, 5):
                clock.now = 1000.0 * r
                await hb.tick()
                await beat_to_b_ends(r + 1)
            assert lost == [url_a] and a.heartbeats == 1
            health = {h.url: h for h in hb.health()}
            assert health[url_a].lost and not health[url_b].lost
            assert health[url_b].last_heard_s == 0.0
        finally:
            failing.set()
            await hb.close()
            await a.close()
            await b.close()
            await peers.close()


async def test_a_failing_loss_callback_for_one_peer_does_not_spare_the_others_that_round() -> None:
    b = Beats()
    other = "http://prefill:2"
    b.live = {PEER: ["h1"], other: ["h2"]}
    b.peers.hung |= {PEER, other}
    told: list[str] = []

    def lost(url: str, reason: str) -> None:
        told.append(url)
        if url == PEER:
            raise InternalError("a bug while failing this peer's handoffs")

    b.hb.side = Side(live=lambda: dict(b.live), lost=lost)
    await b.tick_at(0.0)
    await b.tick_at(0.5)  # both silent past the timeout, in the same round
    assert sorted(told) == [PEER, other]
    assert {h.url for h in b.hb.health() if h.lost} == {PEER, other}
    await b.close()


async def test_a_slow_reconciliation_neither_stops_the_pings_nor_runs_twice_at_once() -> None:
    b = Beats()
    checking = asyncio.Event()  # a prefill aborting what the decode no longer has, say
    checked: list[list[str]] = []

    async def reconcile(url: str, ack: HeartbeatAck, sent: list[str]) -> None:
        checked.append(sent)
        await checking.wait()

    b.hb.side = Side(live=lambda: dict(b.live), lost=b._lost, reconcile=reconcile)
    for step in range(6):  # 0.5 s of rounds: past the 0.3 s silence timeout
        b.clock.now = step * 0.1
        await b.hb.tick()
        ping = b.hb._beats.get(PEER)
        if ping is not None:
            await ping
    assert len(b.peers.sent) == 6 and b.lost == []  # pinged and heard every round
    assert checked == [["h1"]]  # the first answer is still being checked; the rest skipped
    checking.set()
    await b.hb.settled()
    await b.tick_at(0.6)
    assert len(checked) == 2
    await b.close()


async def test_a_cancelled_error_from_the_pipeline_does_not_end_the_heartbeat_task() -> None:
    """An abort racing a round: the prefill read a destination future the abort had just
    cancelled, and the CancelledError ended the heartbeat task for good (issue 18)."""
    b = Beats()
    calls = 0

    def racing_live() -> dict[str, list[str]]:
        nonlocal calls
        calls += 1
        if calls == 1:
            raise asyncio.CancelledError  # not this task's own cancellation
        return {}

    b.hb.side = Side(live=racing_live, lost=b._lost)
    b.hb.interval_s = 0.001
    task = asyncio.get_running_loop().create_task(b.hb.run())
    await eventually(lambda: calls >= 3 or task.done(), what="three rounds")
    assert calls >= 3 and not task.done()
    task.cancel()  # its own cancellation still stops it
    await asyncio.gather(task, return_exceptions=True)
    assert task.cancelled()


async def test_a_configured_peer_is_watched_while_idle_and_lost_when_it_dies() -> None:
    """Issue 18 D: a stage killed while nothing is in flight must not stay "up". A configured
    peer is pinged and watched every round with nothing shared, lost once its watch breaks and
    connections are refused, and back once it answers again."""
    b = Beats(configured=(PEER,))
    b.live.clear()  # nothing in flight
    await b.tick_at(0.0)
    await asyncio.sleep(0)
    assert b.peers.watching == {PEER: 1}
    assert [(url, msg.live) for url, msg in b.peers.sent] == [(PEER, [])]
    assert b.reconciled[-1][0] == PEER and b.reconciled[-1][2] == []
    (health,) = b.hb.health()
    assert not health.lost and health.last_heard_s is not None
    b.peers.down.add(PEER)
    b.peers.drop[PEER].set()
    await eventually(lambda: bool(b.lost), what="the idle peer's loss")
    assert [url for url, _ in b.lost] == [PEER]
    (health,) = b.hb.health()
    assert health.lost  # what `kvhandoff_peer_up` reads: 0 now
    await b.tick_at(0.1)  # still pinged while lost, so a restart is noticed
    assert len(b.lost) == 1 and b.peers.sent[-1][0] == PEER
    b.peers.down.clear()
    await b.tick_at(0.2)
    assert b.back == [PEER]
    (health,) = b.hb.health()
    assert not health.lost
    await b.close()


async def test_an_idle_configured_peer_that_hangs_is_lost_by_silence() -> None:
    b = Beats(configured=(PEER,))
    b.live.clear()
    b.peers.hung.add(PEER)
    for now in (0.0, 0.1, 0.2, 0.3):
        await b.tick_at(now)
    assert b.lost == []
    await b.tick_at(0.4)
    assert [url for url, _ in b.lost] == [PEER] and "silent for 0.4 s" in b.lost[0][1]
    await b.close()


async def test_without_configured_peers_an_idle_service_pings_nobody() -> None:
    b = Beats()
    b.live.clear()
    await b.tick_at(0.0)
    assert b.peers.sent == [] and b.peers.watching == {}
    await b.close()
