"""The live dashboard: `GET /` (one self-contained HTML page) and `GET /v1/dashboard` (its JSON
snapshot), installed on both roles by `install_dashboard`.

The page loads the snapshot once (recent handoffs with per-stage progress, throughput buckets,
latency percentiles, peers and their heartbeat health, the landing arena or staging buffer in
use and its waits) and then applies the live events of
`GET /v1/events`; it refreshes the snapshot every few seconds for the charts and peers. The page
itself is open (it holds no data); the snapshot and the stream are API routes and need the
token when one is set — the page asks for it once and keeps it in memory only.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from importlib import resources

from aiohttp import web
from msgspec import Struct

from kvhandoff.pipelines.arena import ArenaUse
from kvhandoff.pipelines.decode.views import PageUse
from kvhandoff.pipelines.errors import KVHandoffError
from kvhandoff.service.http.app import CONFIG, ROUTES, VERSION, json_response
from kvhandoff.service.http.routing import RouteTable
from kvhandoff.service.observability.activity import (
    BUCKET_S,
    RECENT,
    Activity,
    Bucket,
    HandoffActivity,
    Latency,
)
from kvhandoff.service.peers.heartbeat import PeerHealth
from kvhandoff.service.peers.protocol import HttpPeers
from kvhandoff.service.runtime.roles import (
    DECODE,
    PREFILL,
    RUNTIME,
    DecodeRuntime,
    Runtime,
    on_runtime,
)

#: A configured prefill whose layout could not be read is asked again after this long.
LAYOUT_RETRY_S = 10.0
LAYOUT_TIMEOUT_S = 1.0


class ConfiguredStages:
    """The PP ranks the configured prefill services host, for a decode that has not fetched
    their layouts yet (nothing created since it started): asked once per peer life, bounded
    by a short timeout, so an idle decode's page still labels its peers by stage. Bounded by
    `peers.prefill`; a peer's entry goes when it is lost (a restart may host other stages)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._ranks: dict[str, list[int]] = {}
        self._tried: dict[str, float] = {}
        self._clock = clock

    async def of(
        self, peers: HttpPeers, health: dict[str, PeerHealth], known: dict[str, list[int]]
    ) -> dict[str, list[int]]:
        now = self._clock()
        ask = []
        for url, p in health.items():
            if not p.configured or url in known:
                continue
            if p.lost:
                self._ranks.pop(url, None)
                continue
            due = now - self._tried.get(url, -LAYOUT_RETRY_S) >= LAYOUT_RETRY_S
            if url not in self._ranks and p.up and due:
                self._tried[url] = now
                ask.append(url)
        answers = await asyncio.gather(*(self._ask(peers, url) for url in ask))
        for url, ranks in zip(ask, answers):
            if ranks is not None:
                self._ranks[url] = ranks
        return {url: r for url, r in self._ranks.items() if url in health}

    @staticmethod
    async def _ask(peers: HttpPeers, url: str) -> list[int] | None:
        try:
            async with asyncio.timeout(LAYOUT_TIMEOUT_S):
                info = await peers.layout(url)
        except (KVHandoffError, TimeoutError):
            return None  # asked again after LAYOUT_RETRY_S
        return sorted(s.layout.pp_rank for s in info.stages)


ACTIVITY = web.AppKey("dashboard_activity", Activity)
_STAGES = web.AppKey("dashboard_configured_stages", ConfiguredStages)
_PAGE = web.AppKey("dashboard_page", bytes)

routes = RouteTable()


def install_dashboard(app: web.Application) -> None:
    """Serve the page and its snapshot (an `Extension`); it listens once the runtime is up."""
    app[ACTIVITY] = Activity()
    app[_STAGES] = ConfiguredStages()
    app[_PAGE] = resources.files("kvhandoff.service.api").joinpath("dashboard.html").read_bytes()
    activity = app[ACTIVITY]

    def listen(runtime: Runtime) -> None:
        runtime.bus.add_listener(activity.observe)
        if isinstance(runtime, DecodeRuntime) and runtime.persistence is not None:
            # Restored before the app serves: a restarted decode's page shows the handoffs
            # of its earlier life (the failure being investigated among them), not nothing.
            activity.seed(runtime.persistence.records.recent(RECENT))

    on_runtime(app, listen)
    app[ROUTES].include(routes)


class Summary(Struct, frozen=True):
    role: str
    url: str
    version: str
    now: float
    last_event_id: int
    in_flight: int
    handoffs: list[HandoffActivity]  # most recent last
    throughput: list[Bucket]
    bucket_s: float
    latency: Latency
    #: In stage order: a prefill by the first PP rank it hosts (`peer_stages`), then the rest.
    peers: list[PeerHealth]
    #: The landed transfer's memory: the landing arena (decode), the staging buffer (prefill).
    arenas: list[ArenaUse] = []
    #: Decode: the PP ranks each prefill service hosts, as far as known.
    peer_stages: dict[str, list[int]] = {}
    #: Decode: its pool's pages leased to live handoffs and fenced (outcome known, writers not
    #: confirmed stopped, or an earlier life's until its bound).
    pages: PageUse | None = None


@routes.get(
    "/v1/dashboard",
    response=Summary,
    summary="The dashboard's snapshot: recent handoffs, throughput, latency, peer health",
    tags=("observability",),
)
async def dashboard_summary(request: web.Request) -> web.StreamResponse:
    app = request.app
    runtime, activity, config = app[RUNTIME], app[ACTIVITY], app[CONFIG]
    health = {p.url: p for p in runtime.heartbeats.health()}
    # Peers configured or named by recent handoffs, but not heard by the heartbeats yet.
    known = list(config.peers.prefill)
    decode = app.get(DECODE)
    stages: dict[str, list[int]] = {}
    pages = None
    if decode is not None:
        query = decode.pipeline.query
        known += query.recent_peers(RECENT)
        stages, pages = query.peer_stages(), query.pages()
    for url in known:
        health.setdefault(
            url, PeerHealth(url, None, False, 0, 0, configured=url in config.peers.prefill)
        )
    if decode is not None:  # what the pipeline knows wins: it is what handoffs were paired on
        stages = {**await app[_STAGES].of(runtime.peers, health, stages), **stages}
    prefill = app.get(PREFILL)
    if prefill is not None:
        activity.settle(prefill.pipeline.query.open_ids())
    handoffs = list(activity.handoffs.values())
    return json_response(
        Summary(
            role=config.role,
            url=config.server.public_url,
            version=VERSION,
            now=time.time(),
            last_event_id=runtime.bus.last_seq,
            in_flight=sum(h.finished_at is None for h in handoffs),
            handoffs=handoffs,
            throughput=activity.buckets(),
            bucket_s=BUCKET_S,
            latency=activity.latency(),
            peers=sorted(health.values(), key=lambda p: _stage_order(p.url, stages)),
            arenas=runtime.arenas(),
            peer_stages=stages,
            pages=pages,
        )
    )


@routes.get(
    "/",
    response=str,
    content_type="text/html",
    summary="The live dashboard page (self-contained HTML)",
    tags=("observability",),
)
async def dashboard_page(request: web.Request) -> web.StreamResponse:
    return web.Response(
        body=request.app[_PAGE],
        content_type="text/html",
        charset="utf-8",
        headers={"Cache-Control": "no-cache", "Content-Security-Policy": _CSP},
    )


def _stage_order(url: str, stages: dict[str, list[int]]) -> tuple[int, str]:
    ranks = stages.get(url)
    return (ranks[0] if ranks else 1 << 30, url)


# The page's icon (a 404 on every load otherwise): two bars, a prefill stage handing to decode.
_FAVICON = (
    b'<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 16 16">'
    b'<rect x="1" y="3" width="6" height="10" rx="1" fill="#2f81f7"/>'
    b'<rect x="9" y="3" width="6" height="10" rx="1" fill="#3fb950"/></svg>'
)


@routes.get(
    "/favicon.ico",
    response=str,
    content_type="image/svg+xml",
    summary="The dashboard page's icon",
    tags=("observability",),
)
async def favicon(request: web.Request) -> web.StreamResponse:
    return web.Response(
        body=_FAVICON,
        content_type="image/svg+xml",
        headers={"Cache-Control": "max-age=86400"},
    )


# Everything is inline; nothing may load from elsewhere.
_CSP = (
    "default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; "
    "connect-src 'self'; img-src 'self' data:"
)
