"""The peer health table stays bounded: configured and live peers stay, others are forgotten
once idle for `forget_after_s`, and the table never holds more than `max_peers` unpinned rows —
so `/metrics` label sets do not grow with every URL that ever sent a heartbeat."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest

from kvhandoff.pipelines.messages import HeartbeatMsg
from kvhandoff.service.observability.metrics import PeerCollector
from kvhandoff.service.peers.health import HealthTable
from tests.fakes import Clock
from tests.unit.service.peers.test_heartbeat import PEER, Beats

CONFIGURED = "http://prefill:9"


def beat_from(url: str) -> HeartbeatMsg:
    return HeartbeatMsg(sender_url=url, sender_incarnation="x", role="decode")


def metric_peers(b: Beats) -> set[str]:
    registry = CollectorRegistry()
    registry.register(PeerCollector(b.hb.health))
    text = generate_latest(registry).decode()
    return {
        line.split('peer="')[1].split('"')[0]
        for line in text.splitlines()
        if line.startswith("kvhandoff_peer_up{")
    }


def bounded(**kwargs: object) -> Beats:
    """`Beats` (one live peer, PEER) whose table keeps CONFIGURED, forgets after 10 s, caps at 4."""
    return Beats(configured=[CONFIGURED], forget_after_s=10.0, max_peers=4, **kwargs)


async def test_a_peer_that_is_neither_configured_nor_live_is_forgotten_once_idle() -> None:
    b = bounded()
    b.hb.receive(beat_from(CONFIGURED))
    b.hb.receive(beat_from("http://moved:1"))  # a peer that later moved away
    await b.tick_at(0.0)
    assert metric_peers(b) == {PEER, CONFIGURED, "http://moved:1"}
    await b.tick_at(10.0)
    assert "http://moved:1" in metric_peers(b)  # idle 10 s: not more than forget_after_s yet
    b.peers.hung.add(PEER)  # the live peer falls silent (and is lost): it stays while live
    await b.tick_at(10.5)
    assert metric_peers(b) == {PEER, CONFIGURED}
    await b.tick_at(100.0)
    assert metric_peers(b) == {PEER, CONFIGURED}  # configured: kept however long idle
    assert [h.url for h in b.hb.health() if h.lost] == [PEER]
    await b.close()


async def test_a_peer_whose_handoffs_ended_is_forgotten_after_the_idle_time() -> None:
    b = bounded()
    await b.tick_at(0.0)
    b.live = {}  # its last handoff ended at 0 s
    await b.tick_at(5.0)
    assert PEER in metric_peers(b)
    await b.tick_at(10.1)
    assert metric_peers(b) == {CONFIGURED}  # watched always, so always shown
    b.live = {PEER: ["h9"]}  # a new handoff: tracked afresh, counters from zero
    b.peers.hung.add(PEER)
    await b.tick_at(11.0)
    assert [(h.url, h.misses) for h in b.hb.health()] == [(PEER, 1), (CONFIGURED, 0)]
    await b.close()


async def test_a_flood_of_senders_never_grows_the_table_past_its_cap() -> None:
    b = bounded()
    b.hb.receive(beat_from(CONFIGURED))
    await b.tick_at(0.0)
    for i in range(1000):  # e.g. unsigned heartbeats naming ever new sender URLs
        b.clock.now = 1.0 + i / 1000
        b.hb.receive(beat_from(f"http://flood:{i}"))
    peers = metric_peers(b)
    assert len(peers) == 4 and {PEER, CONFIGURED} <= peers
    assert peers - {PEER, CONFIGURED} == {"http://flood:998", "http://flood:999"}  # the newest
    await b.close()


def test_pinned_rows_are_never_evicted_even_beyond_the_cap() -> None:
    clock = Clock(0.0)
    table = HealthTable(clock=clock, forget_after_s=1.0, max_peers=2)
    live = [f"http://p:{i}" for i in range(3)]
    table.pin(live)
    table.heard("http://other:1")  # unpinned, and the table is full of pinned rows: not kept
    assert [row[0] for row in table.rows()] == live
    clock.now = 50.0
    table.pin(live)
    assert len(table) == 3
