"""`Heartbeats.health()`: the per-peer snapshot metrics and the dashboard read (fake clock and
peers from `test_heartbeat.py`)."""

from __future__ import annotations

from kvhandoff.service.peers.heartbeat import PeerHealth
from tests.unit.service.peers.test_heartbeat import PEER, Beats


async def test_health_counts_misses_losses_and_the_time_since_heard() -> None:
    b = Beats()
    assert b.hb.health() == []  # no peer shared yet
    await b.tick_at(0.0)
    watch = "watching"  # its watch stream is open (the fake peer holds it)
    assert b.hb.health() == [PeerHealth(PEER, 0.0, False, 0, 0, watch, None, "", 1, up=True)]
    b.peers.hung.add(PEER)  # a stopped process: every ping times out, the silence decides
    for now in (0.1, 0.2, 0.3, 0.4):
        await b.tick_at(now)
    b.clock.now = 0.5
    assert b.hb.health() == [PeerHealth(PEER, 0.5, True, 4, 1, watch, None, "", 1, up=False)]
    b.peers.hung.clear()
    b.live[PEER] = ["h2"]  # a new handoff with the peer, which answers again
    await b.tick_at(1.0)
    assert b.hb.health() == [PeerHealth(PEER, 0.0, False, 4, 1, watch, None, "", 1, up=True)]
    assert b.back == [PEER]
    await b.close()


async def test_a_peer_is_up_only_while_heard_within_the_silence_timeout() -> None:
    """`up` (what `kvhandoff_peer_up` and `/readyz` read) means reachable now: a configured peer
    never heard is not up, nor is one silent past the timeout before it is declared lost."""
    b = Beats(configured=("http://never:1",))
    b.peers.down.add("http://never:1")
    await b.tick_at(0.0)
    up = {h.url: (h.up, h.configured) for h in b.hb.health()}
    assert up == {PEER: (True, False), "http://never:1": (False, True)}
    b.peers.hung.add(PEER)
    b.clock.now = 0.35  # silent past the 0.3 s timeout, the next round not yet run
    assert {h.url: h.up for h in b.hb.health()}[PEER] is False
    await b.close()
