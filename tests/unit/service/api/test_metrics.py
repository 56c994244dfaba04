"""`GET /metrics` on a live decode service and its prefill service, after a known run.

The run: three handoffs completed and one aborted. The test checks the exposition with
`promtool check metrics` (Debian package `prometheus`), then that every counter moved by exactly
what the run did, compared with the handoffs' own views.
"""

from __future__ import annotations

import json
import re
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from kvhandoff.service.observability.metrics import Metrics, PeerCollector, TransportCollector
from kvhandoff.service.peers.heartbeat import PeerHealth
from kvhandoff.service.runtime.roles import DECODE, PREFILL
from kvhandoff.transport.base import TransportStats
from tests.unit.service.api.test_handoffs import MOVE, Move, ready_all
from tests.unit.service.handoff_fixtures import (
    Deployment,
    fill_sources,
    open_deployment,
)
from tests.unit.service.metrics_checks import Samples, parse, promtool_check, value


@pytest.fixture
async def d() -> AsyncIterator[Deployment]:
    async with open_deployment() as deployment:
        fill_sources(deployment)
        yield deployment


async def scrape(d: Deployment, url: str) -> tuple[str, Samples]:
    async with d.http.get(f"{url}/metrics") as resp:
        assert resp.status == 200
        assert resp.headers["Content-Type"].startswith("text/plain; version=")
        text = await resp.text()
    return text, parse(text)


async def test_metrics_pass_promtool_and_counters_move_by_exactly_the_run(d: Deployment) -> None:
    _, before = await scrape(d, d.decode.url)
    assert value(before, "kvhandoff_handoffs_accepted_total") == 0
    moves = [Move([1 + 3 * i, 2 + 3 * i], [10 + 2 * i, 11 + 2 * i], i, i) for i in range(3)]
    views = []
    for i, move in enumerate(moves):
        assert (await d.create(f"m{i}", move.dst_pages, move.dst_slot)).status == 201
        await ready_all(d, f"m{i}", move)
        views.append(await d.finish(f"m{i}"))
    assert (await d.create("gone", [40], 9)).status == 201
    reply = await d.request("DELETE", f"{d.decode.url}/v1/handoffs/gone")
    assert reply.status == 200 and reply.body["state"] == "aborted"
    assert [v["state"] for v in views] == ["completed"] * 3

    text, dec = await scrape(d, d.decode.url)
    promtool_check(text)
    assert value(dec, "kvhandoff_build_info", role="decode", version="0.1.0") == 1
    assert value(dec, "kvhandoff_handoffs_accepted_total") == 4
    assert value(dec, "kvhandoff_handoffs_finished_total", state="completed", code="") == 3
    assert value(dec, "kvhandoff_handoffs_finished_total", state="aborted", code="") == 1
    assert value(dec, "kvhandoff_handoffs_in_flight") == 0
    assert value(dec, "kvhandoff_handoff_duration_seconds_count") == 3
    latency = sum(e["seconds"] for v in views for e in v["timeline"] if "seconds" in e)
    assert value(dec, "kvhandoff_handoff_duration_seconds_sum") == pytest.approx(latency)
    for rank in (0, 1):
        arrived = sum(s["bytes"] for v in views for s in v["stages"] if s["pp_rank"] == rank)
        assert arrived > 0
        assert value(dec, "kvhandoff_stage_arrived_bytes_total", pp_rank=str(rank)) == arrived

    text, pre = await scrape(d, d.prefill_urls[0])
    promtool_check(text)
    assert value(pre, "kvhandoff_handoffs_in_flight") == 0
    # The transport's own counters (read from `Transport.stats()`) agree with the events.
    sent = {
        kind: sum(value(pre, f"kvhandoff_stage_sent_{kind}_total", pp_rank=r) for r in "01")
        for kind in ("bytes", "blocks", "batches")
    }
    assert value(pre, "kvhandoff_transport_written_bytes_total") == sent["bytes"]
    assert value(pre, "kvhandoff_transport_written_blocks_total") == sent["blocks"]
    assert value(pre, "kvhandoff_transport_batches_submitted_total") == sent["batches"]
    assert value(pre, "kvhandoff_transport_batches_total", result="succeeded") == sent["batches"]
    assert value(pre, "kvhandoff_transport_batches_total", result="failed") == 0
    assert value(dec, "kvhandoff_transport_written_bytes_total") == 0  # decode only receives
    for rank in (0, 1):
        arrived = value(dec, "kvhandoff_stage_arrived_bytes_total", pp_rank=str(rank))
        assert value(pre, "kvhandoff_stage_sent_bytes_total", pp_rank=str(rank)) == arrived
        assert value(pre, "kvhandoff_stage_sent_blocks_total", pp_rank=str(rank)) > 0
        assert value(pre, "kvhandoff_stage_transfer_seconds_count", pp_rank=str(rank)) >= 3
        assert value(pre, "kvhandoff_stage_planning_seconds_count", pp_rank=str(rank)) == 3


async def test_landed_transfer_metrics_move_by_exactly_the_run(d: Deployment) -> None:
    """The landing arena (decode), the staging buffer (prefill) and the segment counters: what
    the handoffs' own timelines say, and every window and staging extent given back."""
    config = d.decode.config.transfer
    _, before = await scrape(d, d.decode.url)
    assert value(before, "kvhandoff_arena_capacity_bytes", arena="landing") > 0
    assert value(before, "kvhandoff_arena_used_bytes", arena="landing") == 0
    assert value(before, "kvhandoff_segments_committed_total", pp_rank="0") == 0
    moves = [Move([1 + 3 * i, 2 + 3 * i], [10 + 2 * i, 11 + 2 * i], i, i) for i in range(3)]
    views = []
    for i, move in enumerate(moves):
        assert (await d.create(f"s{i}", move.dst_pages, move.dst_slot)).status == 201
        await ready_all(d, f"s{i}", move)
        views.append(await d.finish(f"s{i}"))
    assert [v["state"] for v in views] == ["completed"] * 3
    commits = [e for v in views for e in v["timeline"] if e["type"] == "stage.segment_committed"]
    assert commits  # landed mode: every stage committed at least one segment

    text, dec = await scrape(d, d.decode.url)
    promtool_check(text)
    for rank in ("0", "1"):
        mine = [e for e in commits if str(e["pp_rank"]) == rank]
        assert value(dec, "kvhandoff_segments_committed_total", pp_rank=rank) == len(mine)
        assert value(dec, "kvhandoff_segment_committed_bytes_total", pp_rank=rank) == sum(
            e["bytes"] for e in mine
        )
        arrived = value(dec, "kvhandoff_stage_arrived_bytes_total", pp_rank=rank)
        assert value(dec, "kvhandoff_segment_committed_bytes_total", pp_rank=rank) == arrived
    assert value(dec, "kvhandoff_segment_commit_seconds_count") == len(commits)
    assert value(dec, "kvhandoff_segment_commit_seconds_sum") == pytest.approx(
        sum(e["commit_s"] for e in commits)
    )
    assert not [k for k in dec if k[0] == "kvhandoff_segments_rejected_total"]
    landing = d.decode.app[DECODE].pipeline.query.arena()
    assert landing is not None
    assert value(dec, "kvhandoff_arena_capacity_bytes", arena="landing") == landing.capacity_bytes
    assert landing.capacity_bytes <= config.landing_bytes
    assert value(dec, "kvhandoff_arena_used_bytes", arena="landing") == 0  # all given back
    assert value(dec, "kvhandoff_arena_quarantined_bytes", arena="landing") == 0
    assert value(dec, "kvhandoff_arena_waiting", arena="landing") == 0
    assert value(dec, "kvhandoff_arena_waits_total", arena="landing") == landing.waits
    assert ("kvhandoff_arena_used_bytes", (("arena", "staging"),)) not in dec

    text, pre = await scrape(d, d.prefill_urls[0])
    promtool_check(text)
    staging = d.prefills[0].app[PREFILL].pipeline.query.arena()
    assert staging is not None
    assert value(pre, "kvhandoff_arena_capacity_bytes", arena="staging") == staging.capacity_bytes
    assert 0 < staging.capacity_bytes <= d.prefills[0].config.transfer.staging_bytes
    assert value(pre, "kvhandoff_arena_used_bytes", arena="staging") == 0
    assert ("kvhandoff_arena_used_bytes", (("arena", "landing"),)) not in pre
    assert value(pre, "kvhandoff_segments_committed_total", pp_rank="0") == 0  # decode counts


async def test_sse_readers_are_counted(d: Deployment) -> None:
    async with d.http.get(f"{d.decode.url}/v1/events") as stream:
        assert stream.status == 200
        _, samples = await scrape(d, d.decode.url)
        assert value(samples, "kvhandoff_sse_subscribers") == 1
        assert value(samples, "kvhandoff_sse_streams_total") == 1
        assert value(samples, "kvhandoff_sse_dropped_total") == 0


def test_peer_health_is_exported_per_peer() -> None:
    metrics = Metrics("decode", "0.1.0")
    peers = [
        PeerHealth(url="http://a:1", last_heard_s=0.5, lost=False, misses=2, losses=0, up=True),
        # Never heard and not declared lost (a configured peer that does not resolve): down.
        PeerHealth(url="http://c:3", last_heard_s=None, lost=False, misses=3, losses=0),
        PeerHealth(url="http://b:2", last_heard_s=None, lost=True, misses=7, losses=1),
    ]
    metrics.add_collector(PeerCollector(lambda: peers))
    text = generate_latest(metrics.registry).decode()
    promtool_check(text)
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }
    assert value(samples, "kvhandoff_peer_up", peer="http://a:1") == 1
    assert value(samples, "kvhandoff_peer_up", peer="http://b:2") == 0
    assert value(samples, "kvhandoff_peer_up", peer="http://c:3") == 0
    assert value(samples, "kvhandoff_peer_last_heard_seconds", peer="http://a:1") == 0.5
    assert ("kvhandoff_peer_last_heard_seconds", (("peer", "http://b:2"),)) not in samples
    assert value(samples, "kvhandoff_peer_heartbeat_misses_total", peer="http://b:2") == 7
    assert value(samples, "kvhandoff_peer_lost_total", peer="http://b:2") == 1


DASHBOARD = Path(__file__).resolve().parents[4] / "docker/grafana/dashboards/kvhandoff.json"


def dashboard_exprs(node: Any) -> list[str]:
    if isinstance(node, dict):
        found = [node["expr"]] if isinstance(node.get("expr"), str) else []
        return found + [e for v in node.values() for e in dashboard_exprs(v)]
    if isinstance(node, list):
        return [e for v in node for e in dashboard_exprs(v)]
    return []


async def test_the_grafana_dashboard_queries_only_exported_metrics(d: Deployment) -> None:
    assert (await d.create("g", MOVE.dst_pages, MOVE.dst_slot)).status == 201
    await ready_all(d, "g")
    await d.finish("g")
    texts = []
    for url in (d.decode.url, d.prefill_urls[0]):
        texts.append((await scrape(d, url))[0])
    # Collectors whose series need peers or a transport with `stats()`, over test doubles.
    others = Metrics("decode", "0")
    others.add_collector(PeerCollector(lambda: [PeerHealth("http://a:1", 0.1, False, 0, 0)]))
    others.add_collector(TransportCollector(lambda: TransportStats(engine_errors_by_rc={-1: 1})))
    texts.append(generate_latest(others.registry).decode())
    exported = set()
    for text in texts:
        for family in text_string_to_metric_families(text):
            # A labelled family with no child yet (no pairing failure) has no sample.
            suffixes = {"counter": ["_total"], "histogram": ["_bucket", "_sum", "_count"]}
            exported |= {family.name + s for s in suffixes.get(family.type, [""])}

    dashboard = json.loads(DASHBOARD.read_text())
    exprs = dashboard_exprs(dashboard["panels"])
    assert len(exprs) >= 15
    used = {name for expr in exprs for name in re.findall(r"\bkvhandoff_\w+", expr)}
    assert used - exported == set()
    titles = " ".join(p["title"].lower() for p in dashboard["panels"])
    for topic in ("throughput", "latency", "failures by code", "peer health", "engine errors"):
        assert topic in titles
    assert any(p["type"] == "heatmap" for p in dashboard["panels"])
