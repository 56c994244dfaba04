"""`kvhandoff.service.observability.activity.Activity`: the dashboard's model, moved by events (fake
clock)."""

from __future__ import annotations

from kvhandoff.pipelines.decode.views import ErrorView, HandoffView, StageView
from kvhandoff.pipelines.events import (
    EventBus,
    HandoffCompleted,
    HandoffCreated,
    HandoffFailed,
    SegmentCommitted,
    StageArrived,
    StageTransferred,
)
from kvhandoff.pipelines.states import HandoffState, StageState
from kvhandoff.service.observability.activity import BUCKET_S, RECENT, WINDOW_S, Activity
from tests.fakes import Clock


def bus_with(activity: Activity, clock: Clock) -> EventBus:
    bus = EventBus(clock=clock)
    bus.add_listener(activity.observe)
    return bus


def test_a_handoff_moves_through_its_states_with_per_stage_progress() -> None:
    clock = Clock()
    activity = Activity(clock)
    bus = bus_with(activity, clock)
    bus.publish(HandoffCreated(handoff_id="a", role="decode", num_pages=2, pp_size=2))
    assert activity.handoffs["a"].state == "pending"
    clock.now += 0.1
    bus.publish(
        StageArrived(handoff_id="a", role="decode", pp_rank=1, bytes=300, arrived=1, expected=2)
    )
    h = activity.handoffs["a"]
    assert h.state == "transferring" and h.bytes == 300
    assert [(s.pp_rank, s.bytes, s.done) for s in h.stages] == [(1, 300, True)]
    clock.now += 0.1
    bus.publish(
        StageArrived(handoff_id="a", role="decode", pp_rank=0, bytes=200, arrived=2, expected=2)
    )
    bus.publish(
        HandoffCompleted(handoff_id="a", role="decode", bytes=500, seconds=0.2, verified=False)
    )
    assert [s.pp_rank for s in h.stages] == [0, 1]
    assert h.state == "completed" and h.seconds == 0.2 and h.finished_at == clock.now
    bus.publish(HandoffCreated(handoff_id="b", role="decode", num_pages=1, pp_size=2))
    bus.publish(
        HandoffFailed(handoff_id="b", role="decode", code="peer_unreachable", reason="x", pp_rank=1)
    )
    b = activity.handoffs["b"]
    assert (b.state, b.code, b.pp_rank) == ("failed", "peer_unreachable", 1)
    assert b.stages[0].failed


def test_prefill_progress_counts_layers_sent_and_the_final_send() -> None:
    clock = Clock()
    activity = Activity(clock)
    bus = bus_with(activity, clock)
    for final in (False, True):
        bus.publish(
            StageTransferred(
                handoff_id="p", role="prefill", pp_rank=0, blocks=2, bytes=64, batches=1,
                seconds=0.01, final=final,
            )
        )  # fmt: skip
    s = activity.handoffs["p"].stages[0]
    assert (s.bytes, s.layers, s.done) == (128, 2, True)


def test_throughput_buckets_and_latency_cover_the_window_only() -> None:
    clock = Clock(10_000.0)
    activity = Activity(clock)
    bus = bus_with(activity, clock)
    for i, seconds in enumerate([0.01, 0.02, 0.03, 0.04, 1.0]):
        bus.publish(
            StageArrived(handoff_id=f"h{i}", role="decode", pp_rank=0, bytes=10, arrived=1,
                         expected=1)
        )  # fmt: skip
        bus.publish(
            HandoffCompleted(
                handoff_id=f"h{i}", role="decode", bytes=10, seconds=seconds, verified=False
            )
        )
    buckets = activity.buckets()
    assert len(buckets) == int(WINDOW_S // BUCKET_S) + 1
    assert sum(b.bytes for b in buckets) == 50 and sum(b.handoffs for b in buckets) == 5
    assert buckets[-1].handoffs == 5  # all now
    latency = activity.latency()
    assert (latency.count, latency.p50_s, latency.p99_s) == (5, 0.03, 1.0)
    clock.now += WINDOW_S + BUCKET_S
    assert sum(b.handoffs for b in activity.buckets()) == 0
    assert activity.latency().count == 0


def test_only_the_most_recent_handoffs_are_kept() -> None:
    clock = Clock()
    activity = Activity(clock)
    bus = bus_with(activity, clock)
    for i in range(RECENT + 5):
        bus.publish(HandoffCreated(handoff_id=f"h{i}", role="decode", num_pages=1, pp_size=1))
    assert len(activity.handoffs) == RECENT
    assert next(iter(activity.handoffs)) == "h5"


def test_settle_marks_sent_what_a_prefill_pipeline_no_longer_runs() -> None:
    clock = Clock()
    activity = Activity(clock)
    bus = bus_with(activity, clock)
    for hid in ("done", "live"):
        bus.publish(
            StageTransferred(
                handoff_id=hid, role="prefill", pp_rank=1, blocks=1, bytes=8, batches=1,
                seconds=0.01, final=False,
            )
        )  # fmt: skip
    at = clock.now
    clock.now += 5
    activity.settle({"live"})
    done, live = activity.handoffs["done"], activity.handoffs["live"]
    assert (done.state, done.finished_at, done.stages[0].done) == ("sent", at, True)
    assert (live.state, live.finished_at) == ("transferring", None)


def test_a_landed_stage_shows_its_segments_and_bytes_before_it_arrives() -> None:
    """Issue 18 D: progress inside a stage. The decode's `stage.segment_committed` events say
    how many bytes of how many are committed; the stage's bar reads them."""
    clock = Clock()
    activity = Activity(clock)
    bus = bus_with(activity, clock)
    bus.publish(HandoffCreated(handoff_id="s", role="decode", num_pages=4, pp_size=2))
    for committed in (100, 250):
        bus.publish(
            SegmentCommitted(
                handoff_id="s",
                role="decode",
                pp_rank=1,
                bytes=committed,
                committed=committed if committed == 100 else 350,
                expected=1000,
                commit_s=0.001,
            )
        )
    h = activity.handoffs["s"]
    [s] = h.stages
    assert (s.pp_rank, s.segments, s.bytes, s.expected, s.done) == (1, 2, 350, 1000, False)
    assert h.state == "transferring" and h.bytes == 350
    bus.publish(
        StageArrived(handoff_id="s", role="decode", pp_rank=1, bytes=1000, arrived=1, expected=2)
    )
    assert (s.bytes, s.done, h.bytes) == (1000, True, 1000)  # not counted twice


def test_seeded_records_come_first_and_keep_their_outcome() -> None:
    """After a restart the page shows the records of the earlier life (the failure being
    investigated), older than anything this life observes."""
    clock = Clock()
    activity = Activity(clock)
    bus = bus_with(activity, clock)
    bus.publish(HandoffCreated(handoff_id="new", role="decode", num_pages=1, pp_size=1))
    old = HandoffView(
        id="old",
        state=HandoffState.FAILED,
        created_at=900.0,
        deadline_at=930.0,
        num_pages=2,
        dst_slot=None,
        prefill=["http://p:1"],
        verify=False,
        bytes=64,
        stages=[
            StageView(0, "http://p:1", StageState.ARRIVED, 64),
            StageView(1, "http://p:1", StageState.FAILED, 0),
        ],
        released=True,
        finished_at=901.5,
        error=ErrorView("service_restarted", "the decode service restarted", None),
    )
    activity.seed([old])
    assert list(activity.handoffs) == ["old", "new"]
    h = activity.handoffs["old"]
    assert (h.state, h.code, h.finished_at, h.seconds, h.recorded) == (
        "failed",
        "service_restarted",
        901.5,
        1.5,
        True,
    )
    assert [(s.pp_rank, s.done, s.failed) for s in h.stages] == [(0, True, False), (1, False, True)]
    activity.seed([old])  # once each
    assert list(activity.handoffs) == ["old", "new"]


def test_latency_and_buckets_count_only_the_window_whatever_events_came_since() -> None:
    """Only the events that add to a windowed queue trim it; a reader trims to its own now, so
    a completion older than the window is not counted even when no event came since."""
    clock = Clock()
    activity = Activity(clock)
    bus = bus_with(activity, clock)
    bus.publish(HandoffCreated(handoff_id="a", role="decode", num_pages=1, pp_size=1))
    bus.publish(
        HandoffCompleted(handoff_id="a", role="decode", bytes=10, seconds=0.5, verified=False)
    )
    assert activity.latency().count == 1
    clock.now += WINDOW_S / 2
    bus.publish(HandoffCreated(handoff_id="b", role="decode", num_pages=1, pp_size=1))
    assert activity.latency().count == 1 and sum(b.handoffs for b in activity.buckets()) == 1
    clock.now += WINDOW_S
    assert activity.latency().count == 0 and sum(b.handoffs for b in activity.buckets()) == 0
