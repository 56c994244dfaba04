"""`GET /metrics`: the service's Prometheus metrics (installed on both roles by `install_metrics`).

Builds the app's `Metrics` (`kvhandoff.service.observability.metrics`) at install; once the role's
runtime is up (`kvhandoff.service.runtime.roles.on_runtime`), it listens to the event bus and adds
the collectors of the heartbeats' peer health, the transport, the SSE streams and, on a decode with
records, the webhook dispatcher. The route is outside `/v1/`, so scrapers need no token (it carries
no handoff ids and no payload).
"""

from __future__ import annotations

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from kvhandoff.service.http.app import CONFIG, ROUTES, VERSION
from kvhandoff.service.http.routing import RouteTable
from kvhandoff.service.observability.metrics import (
    METRICS,
    ArenaCollector,
    Metrics,
    PeerCollector,
    StreamCollector,
    TransportCollector,
    WebhookCollector,
)
from kvhandoff.service.observability.streams import STREAMS
from kvhandoff.service.runtime.persistence import PERSISTENCE
from kvhandoff.service.runtime.roles import Runtime, on_runtime
from kvhandoff.service.runtime.transport import TRANSPORT

routes = RouteTable()


def install_metrics(app: web.Application) -> None:
    """Serve `/metrics` (an `Extension`); it listens once the role's runtime is up."""
    metrics = app[METRICS] = Metrics(app[CONFIG].role, VERSION)

    def listen(runtime: Runtime) -> None:
        if STREAMS in app:
            metrics.add_collector(StreamCollector(app[STREAMS]))
        runtime.bus.add_listener(metrics.observe)
        metrics.add_collector(PeerCollector(runtime.heartbeats.health))
        metrics.add_collector(TransportCollector(app[TRANSPORT].stats))
        metrics.add_collector(ArenaCollector(runtime.arenas))
        metrics.count_in_flight(runtime.in_flight)
        if PERSISTENCE in app:
            dispatcher = app[PERSISTENCE].dispatcher
            metrics.add_collector(
                WebhookCollector(lambda: dispatcher.stats, lambda: dispatcher.pending_count)
            )

    on_runtime(app, listen)
    app[ROUTES].include(routes)


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
