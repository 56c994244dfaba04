"""Prometheus metrics of one service: a registry per app, fed by the event bus and read at scrape.

`Metrics(role, version)` owns a `CollectorRegistry` (one per app, so tests and embedded services
never share counters). Handoff and stage metrics move in `Metrics.observe`, a bus listener
(`EventBus.add_listener`): every number is derived from the one event union, so the metrics, the
SSE stream and the API timeline cannot disagree. State that lives elsewhere — peer health from
the heartbeats, SSE readers — is read at scrape time by collectors added with
`Metrics.add_collector` (`kvhandoff.service.api.metrics` adds them; other features, e.g. the webhook
outbox, add theirs the same way). Labels are bounded: role, state, error code, pp_rank, peer URL
— never a handoff id.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from kvhandoff.pipelines.arena import ArenaUse
from kvhandoff.pipelines.events import (
    TERMINAL_EVENTS,
    ChunksEmitted,
    Event,
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
from kvhandoff.service.observability.streams import StreamStats
from kvhandoff.service.peers.health import PeerHealth
from kvhandoff.service.webhooks.dispatch import WebhookStats
from kvhandoff.transport.base import TransportStats

#: 1 ms to 30 s: one page on loopback to a large request over a slow link.
LATENCY_BUCKETS_S = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
)  # fmt: skip
#: Error codes that mean the two sides' layouts do not pair (no byte moved).
PAIRING_CODES = frozenset({"pairing_error", "layout_error", "plan_error"})


@dataclass(frozen=True, slots=True)
class _Metric:
    """One metric's definition; histograms take `LATENCY_BUCKETS_S`."""

    kind: type[Counter] | type[Gauge] | type[Histogram]
    name: str
    doc: str
    labels: tuple[str, ...] = ()

    def build(self, registry: CollectorRegistry) -> Any:
        if self.kind is Histogram:
            return Histogram(
                self.name, self.doc, self.labels, buckets=LATENCY_BUCKETS_S, registry=registry
            )
        return self.kind(self.name, self.doc, self.labels, registry=registry)


_RANK = ("pp_rank",)
#: Every metric `Metrics` moves, by its attribute, in exposition order.
DEFINITIONS = {
    "created": _Metric(
        Counter, "kvhandoff_handoffs_accepted", "Handoffs this service accepted (created)"
    ),
    "finished": _Metric(
        Counter,
        "kvhandoff_handoffs_finished",
        "Handoffs that reached a terminal state, by state and error code",
        ("state", "code"),
    ),
    "in_flight": _Metric(
        Gauge, "kvhandoff_handoffs_in_flight", "Handoffs started and not yet terminal"
    ),
    "latency": _Metric(
        Histogram,
        "kvhandoff_handoff_duration_seconds",
        "End-to-end time of completed handoffs (created to last stage arrived)",
    ),
    "transfer": _Metric(
        Histogram,
        "kvhandoff_stage_transfer_seconds",
        "Time one stage's transfer (one send of its chunks) took, by pp_rank",
        _RANK,
    ),
    "planning": _Metric(
        Histogram,
        "kvhandoff_stage_planning_seconds",
        "Time from a stage's chunks emitted to its blocks planned, by pp_rank",
        _RANK,
    ),
    "sent_bytes": _Metric(
        Counter, "kvhandoff_stage_sent_bytes", "Bytes a prefill stage wrote", _RANK
    ),
    "sent_blocks": _Metric(
        Counter, "kvhandoff_stage_sent_blocks", "Blocks a prefill stage wrote", _RANK
    ),
    "sent_batches": _Metric(
        Counter, "kvhandoff_stage_sent_batches", "Transfer batches a prefill stage submitted", _RANK
    ),
    "arrived_bytes": _Metric(
        Counter,
        "kvhandoff_stage_arrived_bytes",
        "Bytes the decode service was told arrived, by the stage that sent them",
        _RANK,
    ),
    "pairing_failures": _Metric(
        Counter,
        "kvhandoff_pairing_failures",
        "Handoffs failed because the layouts do not pair, by error code",
        ("code",),
    ),
    "segments_committed": _Metric(
        Counter,
        "kvhandoff_segments_committed",
        "Landed segments the decode committed into KV pages (digest matched), by pp_rank",
        _RANK,
    ),
    "segment_committed_bytes": _Metric(
        Counter,
        "kvhandoff_segment_committed_bytes",
        "Bytes of landed segments committed into KV pages, by pp_rank",
        _RANK,
    ),
    "segments_rejected": _Metric(
        Counter,
        "kvhandoff_segments_rejected",
        "Landed segments refused by their digest (nothing committed), by pp_rank and "
        "whether the stage was asked to send it again",
        ("pp_rank", "resend"),
    ),
    "commit": _Metric(
        Histogram,
        "kvhandoff_segment_commit_seconds",
        "Time one landed segment's commit took (scatter out of the window, digest of the pages)",
    ),
}


class Metrics:
    # The metrics of `DEFINITIONS`, built per instance (one registry per app).
    created: Counter
    finished: Counter
    in_flight: Gauge
    latency: Histogram
    transfer: Histogram
    planning: Histogram
    sent_bytes: Counter
    sent_blocks: Counter
    sent_batches: Counter
    arrived_bytes: Counter
    pairing_failures: Counter
    segments_committed: Counter
    segment_committed_bytes: Counter
    segments_rejected: Counter
    commit: Histogram

    def __init__(self, role: str, version: str) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        Gauge(
            "kvhandoff_build_info", "Build of this service (always 1)", ["version", "role"],
            registry=self.registry,
        ).labels(version, role).set(1)  # fmt: skip
        for attr, metric in DEFINITIONS.items():
            setattr(self, attr, metric.build(self.registry))
        # (handoff, pp_rank) -> when its chunks were emitted; cleared at the terminal event.
        self._emitted_at: dict[tuple[str, int], float] = {}
        # Each series' child, by metric and label values: `labels()` validates and locks on
        # every call, several times per event on the hot path; the label sets are few.
        self._children: dict[tuple[int, tuple[str, ...]], Any] = {}

    def count_in_flight(self, live: Callable[[], int]) -> None:
        """Read the in-flight gauge from the pipeline at scrape time (a prefill service sees no
        terminal event for a handoff that went well, so events alone cannot count it)."""
        self.in_flight.set_function(live)

    def add_collector(self, collector: Collector) -> None:
        self.registry.register(collector)

    def _series(self, metric: Any, *values: str) -> Any:
        key = (id(metric), values)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = metric.labels(*values)
        return child

    def observe(self, event: Event) -> None:
        """The bus listener: move the metrics by what `event` says happened."""
        match event:
            case HandoffCreated():
                self.created.inc()
            case ChunksEmitted():
                self._emitted_at[(event.handoff_id, event.pp_rank)] = event.at
            case StagePaired():
                emitted = self._emitted_at.pop((event.handoff_id, event.pp_rank), None)
                if emitted is not None:
                    self._series(self.planning, str(event.pp_rank)).observe(
                        max(event.at - emitted, 0)
                    )
            case StageTransferred():
                rank = str(event.pp_rank)
                self._series(self.sent_bytes, rank).inc(event.bytes)
                self._series(self.sent_blocks, rank).inc(event.blocks)
                self._series(self.sent_batches, rank).inc(event.batches)
                self._series(self.transfer, rank).observe(event.seconds)
            case StageArrived():
                self._series(self.arrived_bytes, str(event.pp_rank)).inc(event.bytes)
            case SegmentCommitted():
                rank = str(event.pp_rank)
                self._series(self.segments_committed, rank).inc()
                self._series(self.segment_committed_bytes, rank).inc(event.bytes)
                self.commit.observe(event.commit_s)
            case SegmentRejected():
                resend = "true" if event.resend else "false"
                self._series(self.segments_rejected, str(event.pp_rank), resend).inc()
            case HandoffCompleted():
                self._series(self.finished, "completed", "").inc()
                self.latency.observe(event.seconds)
            case HandoffFailed():
                self._series(self.finished, "failed", event.code).inc()
                if event.code in PAIRING_CODES:
                    self._series(self.pairing_failures, event.code).inc()
            case HandoffAborted():
                self._series(self.finished, "aborted", "").inc()
            case _:
                pass
        if isinstance(event, StageTransferred) and event.final:
            self._emitted_at.pop((event.handoff_id, event.pp_rank), None)
        elif isinstance(event, TERMINAL_EVENTS):
            for key in [k for k in self._emitted_at if k[0] == event.handoff_id]:
                del self._emitted_at[key]


#: The app's `Metrics`, set by `kvhandoff.service.api.metrics.install_metrics`; a feature with
#: numbers of its own adds a collector here when it starts (`app[METRICS].add_collector(...)`).
METRICS = web.AppKey("metrics", Metrics)


#: The states of a peer's watch stream (`PeerHealth.watch`), one series each.
WATCH_STATES = ("connecting", "watching", "refused", "failing")


class PeerCollector(Collector):
    """Per-peer heartbeat health, read from the heartbeats at scrape time."""

    def __init__(self, health: Callable[[], list[PeerHealth]]) -> None:
        self._health = health

    def collect(self) -> Iterable[CounterMetricFamily | GaugeMetricFamily]:
        peers = self._health()
        up = GaugeMetricFamily(
            "kvhandoff_peer_up",
            "1 while a peer is reachable (heard within the silence timeout, not lost), else 0",
            labels=["peer"],
        )
        heard = GaugeMetricFamily(
            "kvhandoff_peer_last_heard_seconds",
            "Seconds since the peer was last heard",
            labels=["peer"],
        )
        misses = CounterMetricFamily(
            "kvhandoff_peer_heartbeat_misses",
            "Heartbeats to the peer that failed",
            labels=["peer"],
        )
        lost = CounterMetricFamily(
            "kvhandoff_peer_lost", "Times the peer was declared lost", labels=["peer"]
        )
        watch = GaugeMetricFamily(
            "kvhandoff_peer_watch_state",
            "1 for the state the peer's watch stream is in (connecting, watching, refused: it "
            "answered with an HTTP error, failing: it ends at once); absent while not watched",
            labels=["peer", "state"],
        )
        refused = GaugeMetricFamily(
            "kvhandoff_peer_watch_refused_status",
            "The HTTP status the peer refuses its watch stream with (e.g. 404: an older "
            "version), while it does",
            labels=["peer"],
        )
        attempts = CounterMetricFamily(
            "kvhandoff_peer_watch_attempts",
            "Watch stream connections attempted to the peer",
            labels=["peer"],
        )
        for p in peers:
            up.add_metric([p.url], 1.0 if p.up else 0.0)
            if p.last_heard_s is not None:
                heard.add_metric([p.url], p.last_heard_s)
            misses.add_metric([p.url], p.misses)
            lost.add_metric([p.url], p.losses)
            if p.watch:
                for state in WATCH_STATES:
                    watch.add_metric([p.url, state], 1.0 if p.watch == state else 0.0)
                attempts.add_metric([p.url], p.watch_attempts)
            if p.watch == "refused" and p.watch_status is not None:
                refused.add_metric([p.url], p.watch_status)
        return [up, heard, misses, lost, watch, refused, attempts]

    def describe(self) -> Iterable[CounterMetricFamily | GaugeMetricFamily]:
        return []


class ArenaCollector(Collector):
    """The landed transfer's memory (each pipeline's `arena()`), read at scrape time:
    the decode's landing arena and a prefill's staging buffer, by `arena`."""

    def __init__(self, arenas: Callable[[], list[ArenaUse]]) -> None:
        self._arenas = arenas

    def collect(self) -> Iterable[CounterMetricFamily | GaugeMetricFamily]:
        def gauge(name: str, doc: str) -> GaugeMetricFamily:
            return GaugeMetricFamily(name, doc, labels=["arena"])

        capacity = gauge("kvhandoff_arena_capacity_bytes", "Bytes of the arena in all")
        used = gauge(
            "kvhandoff_arena_used_bytes", "Bytes of the arena taken (granted or quarantined)"
        )
        quarantined = gauge(
            "kvhandoff_arena_quarantined_bytes",
            "Bytes of the arena held back until a writer's bound passed (a late write may land)",
        )
        waiting = gauge("kvhandoff_arena_waiting", "Takers waiting for room in the arena now")
        waits = CounterMetricFamily(
            "kvhandoff_arena_waits",
            "Takers that had to wait for room in the arena (backpressure)",
            labels=["arena"],
        )
        for a in self._arenas():
            capacity.add_metric([a.arena], a.capacity_bytes)
            used.add_metric([a.arena], a.used_bytes)
            quarantined.add_metric([a.arena], a.quarantined_bytes)
            waiting.add_metric([a.arena], a.waiting)
            waits.add_metric([a.arena], a.waits)
        return [capacity, used, quarantined, waiting, waits]

    def describe(self) -> Iterable[CounterMetricFamily | GaugeMetricFamily]:
        return []


class StreamCollector(Collector):
    """SSE readers (`kvhandoff.service.api.events`), read at scrape time."""

    def __init__(self, stats: StreamStats) -> None:
        self._stats = stats

    def collect(self) -> Iterable[CounterMetricFamily | GaugeMetricFamily]:
        s = self._stats
        yield GaugeMetricFamily(
            "kvhandoff_sse_subscribers", "Open SSE streams", value=s.subscribers
        )
        yield CounterMetricFamily(
            "kvhandoff_sse_streams", "SSE streams opened", value=s.opened_total
        )
        yield CounterMetricFamily(
            "kvhandoff_sse_dropped",
            "SSE readers dropped for falling behind (stream.overflow)",
            value=s.dropped_total,
        )
        yield CounterMetricFamily(
            "kvhandoff_sse_gaps",
            "SSE resumes that asked for events no longer buffered (stream.gap)",
            value=s.gaps_total,
        )

    def describe(self) -> Iterable[CounterMetricFamily | GaugeMetricFamily]:
        return []


class WebhookCollector(Collector):
    """Webhook deliveries from the outbox (`kvhandoff.service.webhooks.dispatch`), read at scrape
    time."""

    def __init__(self, stats: Callable[[], WebhookStats], depth: Callable[[], int]) -> None:
        self._stats = stats
        self._depth = depth

    def collect(self) -> Iterable[CounterMetricFamily | GaugeMetricFamily]:
        s = self._stats()
        yield CounterMetricFamily(
            "kvhandoff_webhook_attempts", "Webhook delivery attempts", value=s.attempts
        )
        ended = CounterMetricFamily(
            "kvhandoff_webhook_deliveries",
            "Webhook deliveries that ended, by result (delivered, failed: given up)",
            labels=["result"],
        )
        ended.add_metric(["delivered"], s.delivered)
        ended.add_metric(["failed"], s.failed)
        yield ended
        yield CounterMetricFamily(
            "kvhandoff_webhook_retries",
            "Webhook attempts that failed and were scheduled again",
            value=s.retried,
        )
        yield CounterMetricFamily(
            "kvhandoff_webhook_endpoints_disabled",
            "Webhook endpoints disabled by a 410 answer",
            value=s.disabled,
        )
        yield CounterMetricFamily(
            "kvhandoff_webhook_delivered_latency_seconds",
            "Seconds the delivered attempts took, summed",
            value=s.delivered_latency_s,
        )
        yield GaugeMetricFamily(
            "kvhandoff_webhook_outbox_depth",
            "Deliveries pending in the outbox (queued or waiting for a retry)",
            value=self._depth(),
        )

    def describe(self) -> Iterable[CounterMetricFamily | GaugeMetricFamily]:
        return []


class TransportCollector(Collector):
    """The transport's cumulative counters (`Transport.stats()`, a snapshot any thread may take),
    read at scrape time: batches by result, bytes and blocks written, engine calls and errors by
    return code, live lanes and worker threads."""

    def __init__(self, stats: Callable[[], TransportStats]) -> None:
        self._stats = stats

    def collect(self) -> Iterable[CounterMetricFamily | GaugeMetricFamily]:
        s = self._stats()
        yield CounterMetricFamily(
            "kvhandoff_transport_batches_submitted",
            "Transfer batches handed to the engine",
            value=s.batches_submitted,
        )
        batches = CounterMetricFamily(
            "kvhandoff_transport_batches",
            "Transfer batches by result (succeeded, failed, timed_out)",
            labels=["result"],
        )
        batches.add_metric(["succeeded"], s.batches_succeeded)
        batches.add_metric(["failed"], s.batches_failed)
        batches.add_metric(["timed_out"], s.batches_timed_out)
        yield batches
        yield CounterMetricFamily(
            "kvhandoff_transport_written_bytes",
            "Bytes of succeeded batches",
            value=s.bytes_written,
        )
        yield CounterMetricFamily(
            "kvhandoff_transport_written_blocks",
            "Blocks of succeeded batches",
            value=s.blocks_written,
        )
        yield CounterMetricFamily(
            "kvhandoff_transport_engine_calls", "Engine calls made", value=s.engine_calls
        )
        errors = CounterMetricFamily(
            "kvhandoff_transport_engine_errors",
            "Engine calls that returned a non-zero return code, by code",
            labels=["rc"],
        )
        for rc, count in sorted(s.engine_errors_by_rc.items()):
            errors.add_metric([str(rc)], count)
        yield errors
        yield CounterMetricFamily(
            "kvhandoff_transport_engine_exceptions",
            "Engine calls that raised",
            value=s.engine_exceptions,
        )
        yield GaugeMetricFamily(
            "kvhandoff_transport_lanes", "Peers with a transfer lane now", value=s.live_lanes
        )
        yield GaugeMetricFamily(
            "kvhandoff_transport_worker_threads",
            "Transfer worker threads alive now",
            value=s.worker_threads,
        )

    def describe(self) -> Iterable[CounterMetricFamily | GaugeMetricFamily]:
        return []
