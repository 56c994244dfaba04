"""The handoff pipelines of this service's role, built when the app starts.

`install_pipelines(app)` adds a cleanup context that, once the transport is up (install
`service.runtime.transport` first):

1. opens every configured stage's pool and registers it (`service.runtime.stages`);
2. builds the event bus and the role's pipeline over the HTTP peer protocol
   (`service.peers.protocol`), and stores them as `RUNTIME` for the route modules (`service.api`);
3. runs the heartbeat task (`service.peers.heartbeat`).

On shutdown it stops the heartbeats, aborts every live handoff (waiting until none can still
write), then unregisters and releases the pools — all before the transport closes. Exactly one
of `Runtime.decode` / `Runtime.prefill` is set, by the configured role.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from aiohttp import web

from pipelines.decode import DecodePipeline
from pipelines.errors import InvalidInput
from pipelines.events import TERMINAL_EVENTS, Event, EventBus, event_tag, life_first_seq
from pipelines.messages import PEER_PROTOCOL_VERSION, LayoutInfo
from pipelines.prefill import HostedStage, PrefillPipeline
from service.config import Config, ConfigError
from service.http.app import CONFIG, INCARNATION, PEERS, READINESS
from service.peers.heartbeat import Heartbeats
from service.peers.protocol import HttpPeers
from service.runtime.landing import TransferMemory, open_transfer_memory
from service.runtime.stages import Buffers, HostedMemory, open_stages
from service.runtime.transport import TRANSPORT

log = logging.getLogger("kvhandoff.handoffs")


@dataclass
class Runtime:
    role: str
    url: str
    target: str
    bus: EventBus
    hosted: list[HostedMemory]
    heartbeats: Heartbeats
    peers: HttpPeers
    incarnation: str
    max_call_s: float
    decode: DecodePipeline | None = None
    prefill: PrefillPipeline | None = None
    # Set when the app begins to shut down: ends the peers' watch streams.
    closing: asyncio.Event = field(default_factory=asyncio.Event)

    def layout_info(self) -> LayoutInfo:
        return LayoutInfo(
            version=PEER_PROTOCOL_VERSION,
            role=self.role,
            url=self.url,
            target=self.target,
            stages=[h.info() for h in self.hosted],
            incarnation=self.incarnation,
            max_call_s=self.max_call_s,
        )


RUNTIME = web.AppKey("handoff_runtime", Runtime)


def decode_of(request: web.Request) -> DecodePipeline:
    pipeline = request.app[RUNTIME].decode
    assert pipeline is not None, "decode routes are installed on the decode role only"
    return pipeline


def prefill_of(request: web.Request) -> PrefillPipeline:
    pipeline = request.app[RUNTIME].prefill
    assert pipeline is not None, "prefill routes are installed on the prefill role only"
    return pipeline


def check_version(version: int) -> None:
    """Refuse a peer message of another protocol version instead of guessing at it."""
    if version != PEER_PROTOCOL_VERSION:
        raise InvalidInput(
            f"peer protocol version {version} is not supported (this service speaks "
            f"{PEER_PROTOCOL_VERSION}); upgrade the older side",
            field="version",
        )


#: Set by an embedding engine (`service.embedded`) before start: its own buffers per pp_rank.
EMBEDDED_BUFFERS = web.AppKey("embedded_buffers", dict)


def install_pipelines(app: web.Application) -> None:
    """Build the role's pipeline with the app (after the transport extension) and gate /readyz."""
    app.cleanup_ctx.append(_handoffs_ctx)
    app.on_shutdown.append(_closing)
    app[READINESS].add("handoffs", lambda: RUNTIME in app)


async def _closing(app: web.Application) -> None:
    # Runs before the server waits for open handlers: the watch streams must end first.
    if RUNTIME in app:
        app[RUNTIME].closing.set()


async def _handoffs_ctx(app: web.Application) -> AsyncIterator[None]:
    config = app[CONFIG]
    transport = app[TRANSPORT]
    buffers: Buffers | None = app.get(EMBEDDED_BUFFERS)
    opening = asyncio.ensure_future(asyncio.to_thread(open_stages, config, transport, buffers))
    try:
        hosted = await asyncio.shield(opening)
    except asyncio.CancelledError:
        # Start-up abandoned: the thread runs on, so close what it opens once it is done.
        opening.add_done_callback(_close_opened)
        raise
    try:
        transfer = await asyncio.to_thread(open_transfer_memory, config, app[TRANSPORT], hosted)
    except BaseException:
        await asyncio.to_thread(_close_pools, hosted)
        raise
    try:
        runtime = _build(config, app, hosted, transfer)
        app[RUNTIME] = runtime
        beat = asyncio.get_running_loop().create_task(
            runtime.heartbeats.run(), name="kvhandoff-heartbeats"
        )
        try:
            yield
        finally:
            # Heartbeats keep running while live handoffs are aborted: a peer that stops
            # answering is declared lost instead of holding up the shutdown.
            if runtime.decode is not None:
                await runtime.decode.close(config.handoff.shutdown_grace_s)
            if runtime.prefill is not None:
                await runtime.prefill.close()
            beat.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await beat
            await runtime.peers.close()
    finally:
        if transfer is not None:
            await asyncio.to_thread(transfer.close)
        await asyncio.to_thread(_close_pools, hosted)


def _build(
    config: Config,
    app: web.Application,
    hosted: list[HostedMemory],
    transfer: TransferMemory | None,
) -> Runtime:
    transport = app[TRANSPORT]
    url = config.server.public_url
    handoff = config.handoff
    # Numbered from this life's start: ids never repeat an earlier life's (SSE resume).
    bus = EventBus(replay=handoff.sse_buffer, first_seq=life_first_seq())
    bus.add_listener(_log_event)
    # An abort answers once in-flight writes drained: give it a transfer's time and then some.
    peers = HttpPeers(
        app[PEERS],
        abort_timeout_s=config.transport.transfer_timeout_s + 5.0,
        watch_idle_s=2 * handoff.heartbeat_interval_s + 1.0,
    )
    incarnation = app[INCARNATION]  # what signed peer requests and answers are bound to
    # The longest one engine call of this process can still write once started: declared to
    # the decode side, whose grace past the deadline it bounds.
    max_call_s = transport.max_call_s
    runtime = Runtime(
        role=config.role,
        url=url,
        target=transport.local_target,
        bus=bus,
        hosted=hosted,
        peers=peers,
        incarnation=incarnation,
        max_call_s=max_call_s,
        heartbeats=Heartbeats(  # watching the pipeline built below
            url=url,
            role=config.role,
            peers=peers,
            incarnation=incarnation,
            interval_s=handoff.heartbeat_interval_s,
            timeout_s=handoff.peer_timeout_s,
            configured=config.peers.prefill,
            forget_after_s=config.peers.forget_after_s,
            max_peers=config.peers.max_tracked,
            watch_retry_min_s=config.peers.watch_retry_min_s,
            watch_retry_max_s=config.peers.watch_retry_max_s,
        ),
    )
    beats = runtime.heartbeats
    if config.role == "decode":
        memory = hosted[0].memory if hosted[0].pool.on_host else None
        if handoff.verify and memory is None:
            raise ConfigError("handoff.verify", "verification needs a host-readable decode pool")
        decode = runtime.decode = DecodePipeline(
            hosted[0].layout,
            transport.local_target,
            url,
            peers,
            bus,
            memory=memory,
            landing=transfer.landing(config, hosted[0]) if transfer is not None else None,
            default_prefill=config.peers.prefill,
            max_live=handoff.max_concurrent,
            default_deadline_s=handoff.default_deadline_s,
            verify_default=handoff.verify,
            # After the deadline no prefill batch starts; one started ends within what its
            # prefill declared, which may not exceed this.
            max_grace_s=handoff.max_grace_s,
            incarnation=incarnation,
        )
        beats.watch(
            live=decode.live_by_prefill,
            lost=decode.peer_lost,
            back=decode.peer_back,
            reconcile=decode.reconcile,
            listing=decode.live_with,
        )
        decode.on_peers = beats.joined
    else:
        prefill = runtime.prefill = PrefillPipeline(
            {
                h.layout.pp_rank: HostedStage(
                    h.layout, h.memory if h.pool.on_host else None, h.memory
                )
                for h in hosted
            },
            transport,
            peers,
            bus,
            url=url,
            incarnation=incarnation,
            default_deadline_s=handoff.default_deadline_s,
            max_blocks_per_batch=config.transport.max_blocks_per_batch,
            staging=transfer.staging() if transfer is not None else None,
        )
        beats.watch(
            live=prefill.live_by_decode,
            lost=prefill.peer_lost,
            reconcile=prefill.reconcile,
            listing=prefill.live_with,
        )
        prefill.on_peers = beats.joined
    return runtime


def _close_opened(opening: asyncio.Future[list[HostedMemory]]) -> None:
    if not opening.cancelled() and opening.exception() is None:
        _close_pools(opening.result())


def _close_pools(hosted: list[HostedMemory]) -> None:
    for h in hosted:
        h.pool.close()


def _log_event(event: Event) -> None:
    if isinstance(event, TERMINAL_EVENTS):
        log.info("%s %s %s", event_tag(event), event.role, event.handoff_id)
    elif log.isEnabledFor(logging.DEBUG):
        log.debug("%s %s %s", event_tag(event), event.role, event.handoff_id)
