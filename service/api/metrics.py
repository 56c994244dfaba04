"""`GET /metrics`: the service's Prometheus metrics (installed on both roles by `install_metrics`).

Builds the app's `Metrics` (`service.runtime.metrics`) at install, so any feature can add its
collectors to `app[METRICS]` when it starts (e.g. the webhook outbox); once the role's pipeline
is up, it listens to the event bus and reads the heartbeats' peer health. The route is outside
`/v1/`, so scrapers need no token (it carries no handoff ids and no payload).
"""

from __future__ import annotations

from collections.abc import AsyncIterator

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from service.http.app import CONFIG, ROUTES, VERSION
from service.http.routing import RouteTable
from service.runtime.activity import arena_uses
from service.runtime.metrics import (
    METRICS,
    ArenaCollector,
    Metrics,
    PeerCollector,
    StreamCollector,
    TransportCollector,
)
from service.runtime.pipelines import RUNTIME
from service.runtime.streams import STREAMS
from service.runtime.transport import TRANSPORT

routes = RouteTable()


def install_metrics(app: web.Application) -> None:
    """Serve `/metrics` (an `Extension`; after the handoffs and events ones)."""
    metrics = app[METRICS] = Metrics(app[CONFIG].role, VERSION)
    if STREAMS in app:
        metrics.add_collector(StreamCollector(app[STREAMS]))
    app.cleanup_ctx.append(_listen)
    app[ROUTES].include(routes)


async def _listen(app: web.Application) -> AsyncIterator[None]:
    runtime, metrics = app[RUNTIME], app[METRICS]
    runtime.bus.add_listener(metrics.observe)
    metrics.add_collector(PeerCollector(runtime.heartbeats.health))
    metrics.add_collector(TransportCollector(app[TRANSPORT].stats))
    decode, prefill = runtime.decode, runtime.prefill
    metrics.add_collector(ArenaCollector(lambda: arena_uses(decode, prefill)))
    if decode is not None:
        metrics.count_in_flight(lambda: sum(not h.state.terminal for h in decode.handoffs.values()))
    elif prefill is not None:
        metrics.count_in_flight(
            lambda: len({i for ids in prefill.live_by_decode().values() for i in ids})
        )
    yield


@routes.get(
    "/metrics",
    response=str,
    content_type="text/plain",
    summary="Prometheus metrics (text exposition format)",
    tags=("observability",),
)
async def metrics_text(request: web.Request) -> web.StreamResponse:
    body = generate_latest(request.app[METRICS].registry)
    response = web.Response(body=body)
    response.headers["Content-Type"] = CONTENT_TYPE_LATEST
    return response
