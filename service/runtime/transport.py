"""App extension: start the configured transport with the app and close it after the last request.

`install_transport(app)` (an `Extension`, see `service.http.app`) adds a cleanup context that builds
`config.transport` — the Mooncake Transfer Engine (`backend = "mooncake"`) or the in-process
`LocalTransport` (`"local"`) — stores it under `TRANSPORT`, publishes its `local_target` under
`service.app.LOCAL_TARGET` and gates `/readyz` on it. Install it before extensions that open
pools on it, so their cleanup contexts (unregistering memory) run before the transport closes.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from aiohttp import web

from service.config import TransportConfig
from service.http.app import CONFIG, LOCAL_TARGET, READINESS
from transport.base import Transport

TRANSPORT = web.AppKey("transport", Transport)


def open_transport(config: TransportConfig) -> Transport:
    """Build the transport `config` names; blocking (the engine starts its listener)."""
    if config.backend == "local":
        from transport.local import LocalTransport

        return LocalTransport(
            max_blocks_per_batch=config.max_blocks_per_batch,
            max_bytes_per_batch=config.max_bytes_per_batch,
        )
    from transport.mooncake import MooncakeTransport  # imports the engine only when used

    return MooncakeTransport.start(config)


async def _transport_ctx(app: web.Application) -> AsyncIterator[None]:
    # Engine start-up blocks for a while (socket set-up, metadata handshake): not on the loop.
    transport = await asyncio.to_thread(open_transport, app[CONFIG].transport)
    app[TRANSPORT] = transport
    app[LOCAL_TARGET] = transport.local_target
    try:
        yield
    finally:
        # close() waits for running engine calls (bounded by the engine's timeout).
        await asyncio.to_thread(transport.close)


def install_transport(app: web.Application) -> None:
    app.cleanup_ctx.append(_transport_ctx)
    app[READINESS].add("transport", lambda: TRANSPORT in app)
