"""App extension: start the configured transport with the app and close it after the last request.

`transport_opened(app)` opens `config.transport` through its backend's opener (`OPENERS`: the
Mooncake Transfer Engine for `backend = "mooncake"`, the in-process `LocalTransport` for
`"local"`), stores it under `TRANSPORT`, publishes its `local_target` under
`kvhandoff.service.http.app.LOCAL_TARGET`, and closes it when the `async with` ends; the role's
runtime (`kvhandoff.service.runtime.roles`) runs inside it, so memory is unregistered before the
transport closes. `install_transport(app)` runs it alone (tests, tools).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import msgspec
from aiohttp import web

from kvhandoff.service.config import Config, ConfigError, TransportConfig
from kvhandoff.service.http.app import CONFIG, LOCAL_TARGET, READINESS
from kvhandoff.transport import ascend
from kvhandoff.transport.base import Transport
from kvhandoff.transport.config import MooncakeConfig
from kvhandoff.transport.local import LocalConfig

TRANSPORT = web.AppKey("transport", Transport)


def _open_mooncake(config: MooncakeConfig) -> Transport:
    check_ascend(config)
    from kvhandoff.transport.mooncake import MooncakeTransport  # imports the engine only when used

    return MooncakeTransport.start(config)


def _open_local(config: LocalConfig) -> Transport:
    from kvhandoff.transport.local import LocalTransport

    return LocalTransport.start(config)


#: One opener per member of `TransportConfig`, by its config type: a new backend is its module
#: (config Struct and transport), its member in that union and its line here.
OPENERS: dict[type[TransportConfig], Callable[[Any], Transport]] = {
    MooncakeConfig: _open_mooncake,
    LocalConfig: _open_local,
}


def open_transport(config: TransportConfig) -> Transport:
    """Build the transport `config` names; blocking (the engine starts its listener). What
    Mooncake's protocol `ascend` needs is checked first (`check_ascend`)."""
    return OPENERS[type(config)](config)


def with_stage_npu(config: Config) -> TransportConfig:
    """`config.transport`, under protocol `ascend` with `npu` unset taken from the first stage
    pool on an NPU (`torch:npu[:N]`): the engine starts on the NPU whose memory it moves."""
    transport = config.transport
    if not isinstance(transport, MooncakeConfig):
        return transport
    if transport.protocol != "ascend" or transport.npu is not None:
        return transport
    for stage in config.stages:
        kind, _, index = stage.pool.removeprefix("torch:").partition(":")
        if stage.pool.startswith("torch:") and kind == "npu":
            return msgspec.structs.replace(transport, npu=int(index or 0))
    return transport


def check_ascend(config: MooncakeConfig, hccn_conf: Path = ascend.HCCN_CONF) -> None:
    """ConfigError naming the first `transport` setting protocol `ascend` cannot start with
    (the hostname's form; under another protocol, a hostname in that form), then the host
    (`hccn_conf`, under `ascend`). At start-up, not when the file is loaded: an engine adapter
    completes each rank's hostname after loading it
    (`kvhandoff.service.integrations.sglang.settings`)."""
    for key, why in ascend.settings_problems(config):
        raise ConfigError(f"transport.{key}", why)
    problem = ascend.host_problem(hccn_conf) if config.protocol == "ascend" else None
    if problem is not None:
        raise ConfigError("transport.protocol", problem)


@contextlib.asynccontextmanager
async def transport_opened(app: web.Application) -> AsyncIterator[Transport]:
    """The app's transport (also under `TRANSPORT`), open until the `async with` ends."""
    # Engine start-up blocks for a while (socket set-up, metadata handshake): not on the loop.
    config = app[CONFIG]
    transport = await asyncio.to_thread(open_transport, with_stage_npu(config))
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
    (`kvhandoff.service.runtime.roles.install_runtime`)."""
    app.cleanup_ctx.append(_transport_ctx)
    app[READINESS].add("transport", lambda: TRANSPORT in app)
