"""`PeerLane.stuck`: derived from which call is running, so it cannot go stale."""

from __future__ import annotations

from kvhandoff.transport.lanes import PeerLane


async def test_a_lane_is_stuck_only_while_the_call_that_timed_out_runs() -> None:
    lane = PeerLane("peer:1", 4)
    assert not lane.stuck()
    lane.in_call = lane.stuck_call = 7
    assert lane.stuck()
    lane.in_call = 0  # the call returned: no flag to clear
    assert not lane.stuck()
    lane.in_call = 8  # a later call runs: not the one that timed out
    assert not lane.stuck()
