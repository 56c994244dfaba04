"""App extension: start the configured transport with the app and close it after the last request.

`transport_opened(app)` builds `config.transport` — the Mooncake Transfer Engine (`backend =
"mooncake"`) or the in-process `LocalTransport` (`"local"`) — stores it under `TRANSPORT`,
publishes its `local_target` under `service.http.app.LOCAL_TARGET`, and closes it when the `async
with` ends; the role's runtime (`service.runtime.roles`) runs inside it, so memory is unregistered
before the transport closes. `install_transport(app)` runs it alone (tests, tools).
"""

from __future__ import annotations

import asyncio
import contextlib
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


@contextlib.asynccontextmanager
async def transport_opened(app: web.Application) -> AsyncIterator[Transport]:
    """The app's transport (also under `TRANSPORT`), open until the `async with` ends."""
    # Engine start-up blocks for a while (socket set-up, metadata handshake): not on the loop.
    transport = await asyncio.to_thread(open_transport, app[CONFIG].transport)
    app[TRANSPORT] = transport
    app[LOCAL_TARGET] = transport.local_target
    try:
        yield transport
    finally:
        # close() waits for running engine calls (bounded by the engine's timeout).
        await asyncio.to_thread(transport.close)


async def _transport_ctx(app: web.Application) -> AsyncIterator[None]:
    async with transport_opened(app):
        yield


def install_transport(app: web.Application) -> None:
    """The transport alone (an app without handoffs); the service runs it with its runtime
    (`service.runtime.roles.install_runtime`)."""
    app.cleanup_ctx.append(_transport_ctx)
    app[READINESS].add("transport", lambda: TRANSPORT in app)
