"""`kvhandoff.service.observability.metrics.Metrics` moved by events on a bus (no service): every
event kind moves exactly its metrics; labels stay bounded."""

from __future__ import annotations

from prometheus_client import generate_latest

from kvhandoff.pipelines.arena import ArenaUse
from kvhandoff.pipelines.events import (
    ChunksEmitted,
    EventBus,
    HandoffAborted,
    HandoffCompleted,
    HandoffCreated,
    HandoffFailed,
    SegmentCommitted,
    SegmentRejected,
    StageArrived,
    StagePaired,
    StageTransferred,
)
from kvhandoff.service.observability.metrics import ArenaCollector, Metrics, TransportCollector
from kvhandoff.transport.base import TransportStats
from tests.fakes import Clock
from tests.unit.service.metrics_checks import parse, promtool_check


def samples(metrics: Metrics) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return parse(generate_latest(metrics.registry).decode())


def test_decode_events_move_handoff_counters_and_latency() -> None:
    clock, metrics = Clock(100.0), Metrics("decode", "9")
    bus = EventBus(clock=clock)
    bus.add_listener(metrics.observe)
    for i in range(3):
        bus.publish(HandoffCreated(handoff_id=f"h{i}", role="decode", num_pages=1, pp_size=2))
    bus.publish(
        StageArrived(handoff_id="h0", role="decode", pp_rank=1, bytes=70, arrived=1, expected=2)
    )
    bus.publish(
        HandoffCompleted(handoff_id="h0", role="decode", bytes=70, seconds=0.02, verified=False)
    )
    bus.publish(
        HandoffFailed(handoff_id="h1", role="decode", code="pairing_error", reason="r", pp_rank=0)
    )
    bus.publish(HandoffFailed(handoff_id="h2", role="decode", code="deadline_exceeded", reason=""))
    bus.publish(HandoffAborted(handoff_id="h9", role="decode", reason="asked"))
    s = samples(metrics)
    assert s[("kvhandoff_build_info", (("role", "decode"), ("version", "9")))] == 1
    assert s[("kvhandoff_handoffs_accepted_total", ())] == 3
    finished = {k[1]: v for k, v in s.items() if k[0] == "kvhandoff_handoffs_finished_total"}
    assert finished == {
        (("code", ""), ("state", "completed")): 1,
        (("code", "pairing_error"), ("state", "failed")): 1,
        (("code", "deadline_exceeded"), ("state", "failed")): 1,
        (("code", ""), ("state", "aborted")): 1,
    }
    assert s[("kvhandoff_pairing_failures_total", (("code", "pairing_error"),))] == 1
    assert ("kvhandoff_pairing_failures_total", (("code", "deadline_exceeded"),)) not in s
    assert s[("kvhandoff_stage_arrived_bytes_total", (("pp_rank", "1"),))] == 70
    assert s[("kvhandoff_handoff_duration_seconds_count", ())] == 1
    assert s[("kvhandoff_handoff_duration_seconds_bucket", (("le", "0.025"),))] == 1
    assert s[("kvhandoff_handoff_duration_seconds_bucket", (("le", "0.01"),))] == 0
    assert not any("h0" in str(labels) for _, labels in s)  # never a handoff id


def test_prefill_events_move_stage_counters_and_planning_time() -> None:
    clock, metrics = Clock(100.0), Metrics("prefill", "9")
    bus = EventBus(clock=clock)
    bus.add_listener(metrics.observe)
    bus.publish(ChunksEmitted(handoff_id="p", role="prefill", pp_rank=2, kv_layers=[3],
                              state_layers=[]))  # fmt: skip
    clock.now += 0.004
    bus.publish(StagePaired(handoff_id="p", role="prefill", pp_rank=2, kv_pairs=2, state_pairs=0,
                            blocks=5, bytes=500))  # fmt: skip
    for _ in range(2):
        bus.publish(StageTransferred(handoff_id="p", role="prefill", pp_rank=2, blocks=5,
                                     bytes=500, batches=1, seconds=0.003, final=False))  # fmt: skip
    s = samples(metrics)
    rank = (("pp_rank", "2"),)
    assert s[("kvhandoff_stage_sent_bytes_total", rank)] == 1000
    assert s[("kvhandoff_stage_sent_blocks_total", rank)] == 10
    assert s[("kvhandoff_stage_sent_batches_total", rank)] == 2
    assert s[("kvhandoff_stage_transfer_seconds_count", rank)] == 2
    assert s[("kvhandoff_stage_planning_seconds_count", rank)] == 1
    assert abs(s[("kvhandoff_stage_planning_seconds_sum", rank)] - 0.004) < 1e-9
    metrics.count_in_flight(lambda: 7)
    assert samples(metrics)[("kvhandoff_handoffs_in_flight", ())] == 7


def test_transport_counters_are_read_at_scrape_time() -> None:
    metrics = Metrics("prefill", "9")
    current = [TransportStats()]
    metrics.add_collector(TransportCollector(lambda: current[0]))
    assert samples(metrics)[("kvhandoff_transport_batches_submitted_total", ())] == 0
    current[0] = TransportStats(
        batches_submitted=12, batches_succeeded=9, batches_failed=2, batches_timed_out=1,
        bytes_written=4096, blocks_written=64, engine_calls=10,
        engine_errors_by_rc={-1: 1, -800: 2}, engine_exceptions=1, live_lanes=3, worker_threads=2,
    )  # fmt: skip
    text = generate_latest(metrics.registry).decode()
    promtool_check(text)
    s = samples(metrics)
    assert s[("kvhandoff_transport_batches_submitted_total", ())] == 12
    assert s[("kvhandoff_transport_batches_total", (("result", "succeeded"),))] == 9
    assert s[("kvhandoff_transport_batches_total", (("result", "failed"),))] == 2
    assert s[("kvhandoff_transport_batches_total", (("result", "timed_out"),))] == 1
    assert s[("kvhandoff_transport_written_bytes_total", ())] == 4096
    assert s[("kvhandoff_transport_written_blocks_total", ())] == 64
    assert s[("kvhandoff_transport_engine_calls_total", ())] == 10
    assert s[("kvhandoff_transport_engine_errors_total", (("rc", "-800"),))] == 2
    assert s[("kvhandoff_transport_engine_errors_total", (("rc", "-1"),))] == 1
    assert s[("kvhandoff_transport_engine_exceptions_total", ())] == 1
    assert s[("kvhandoff_transport_lanes", ())] == 3
    assert s[("kvhandoff_transport_worker_threads", ())] == 2


def test_segment_events_move_commit_and_rejection_counters() -> None:
    metrics = Metrics("decode", "9")
    bus = EventBus()
    bus.add_listener(metrics.observe)
    for rank, nbytes, secs in ((0, 100, 0.002), (0, 50, 0.001), (1, 70, 0.004)):
        bus.publish(
            SegmentCommitted(
                handoff_id="h",
                role="decode",
                pp_rank=rank,
                bytes=nbytes,
                committed=nbytes,
                expected=150,
                commit_s=secs,
            )
        )
    for resend in (True, False):
        bus.publish(
            SegmentRejected(
                handoff_id="h", role="decode", pp_rank=1, bytes=9, layers="layer 3", resend=resend
            )
        )
    text = generate_latest(metrics.registry).decode()
    promtool_check(text)
    s = parse(text)
    assert s[("kvhandoff_segments_committed_total", (("pp_rank", "0"),))] == 2
    assert s[("kvhandoff_segments_committed_total", (("pp_rank", "1"),))] == 1
    assert s[("kvhandoff_segment_committed_bytes_total", (("pp_rank", "0"),))] == 150
    assert s[("kvhandoff_segment_committed_bytes_total", (("pp_rank", "1"),))] == 70
    assert s[("kvhandoff_segment_commit_seconds_count", ())] == 3
    assert abs(s[("kvhandoff_segment_commit_seconds_sum", ())] - 0.007) < 1e-12
    rejected = {k[1]: v for k, v in s.items() if k[0] == "kvhandoff_segments_rejected_total"}
    assert rejected == {
        (("pp_rank", "1"), ("resend", "true")): 1,
        (("pp_rank", "1"), ("resend", "false")): 1,
    }


def test_arena_collector_reads_each_arena_at_scrape_time() -> None:
    metrics = Metrics("decode", "9")
    now = [ArenaUse("landing", 1024, 512, 256, 2, 7)]
    metrics.add_collector(ArenaCollector(lambda: now))
    text = generate_latest(metrics.registry).decode()
    promtool_check(text)
    s = parse(text)
    landing = (("arena", "landing"),)
    assert s[("kvhandoff_arena_capacity_bytes", landing)] == 1024
    assert s[("kvhandoff_arena_used_bytes", landing)] == 512
    assert s[("kvhandoff_arena_quarantined_bytes", landing)] == 256
    assert s[("kvhandoff_arena_waiting", landing)] == 2
    assert s[("kvhandoff_arena_waits_total", landing)] == 7
    now[:] = [ArenaUse("landing", 1024, 0, 0, 0, 8)]  # read again at the next scrape
    s = parse(generate_latest(metrics.registry).decode())
    assert s[("kvhandoff_arena_used_bytes", landing)] == 0
    assert s[("kvhandoff_arena_waits_total", landing)] == 8
    now[:] = []  # direct mode: no arena, no series
    s = parse(generate_latest(metrics.registry).decode())
    assert not [k for k in s if k[0].startswith("kvhandoff_arena_")]
