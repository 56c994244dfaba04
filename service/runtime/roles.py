"""One assembly per role: the typed runtime of a decode or a prefill service, built in one place.

`open_runtime(config, transport, client, incarnation, buffers)` is the one entry every door uses
(the HTTP app through `install_runtime`, the embedded service through the same app, and next an
engine backend). It opens the configured stages' pools (`kvhandoff.service.runtime.stages`) and the
landed transfer's memory (`kvhandoff.service.runtime.transfer_memory`), builds the role's
runtime — `build_decode` or `build_prefill`, the only functions that wire a role — and, on the
decode role with records on, opens the records and webhooks
(`kvhandoff.service.runtime.persistence`); then it runs the heartbeats
(`kvhandoff.service.peers.heartbeat`) until the `async with` ends. On exit it closes each resource
once, in order: the pipeline (a decode's shutdown aborts reach its records), the records and
webhooks, the heartbeats, the peer calls, then the transfer memory and the pools — all before the
transport the caller owns is closed.

The two runtimes share `RuntimeBase` and differ in their typed `pipeline`; a route reads the one
of its role (`DECODE`, `PREFILL`), so no code asks which role it is and asserts.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from aiohttp import web

from kvhandoff.pipelines.arena import ArenaUse
from kvhandoff.pipelines.decode import DecodePipeline
from kvhandoff.pipelines.decode.views import HandoffRequest, HandoffView
from kvhandoff.pipelines.events import (
    TERMINAL_EVENTS,
    Event,
    EventBus,
    HandoffAborted,
    HandoffFailed,
    event_tag,
    life_first_seq,
)
from kvhandoff.pipelines.messages import PEER_PROTOCOL_VERSION, ArenaSpan, HeartbeatAck, LayoutInfo
from kvhandoff.pipelines.prefill import HostedStage, PrefillPipeline
from kvhandoff.service.config import Config, ConfigError
from kvhandoff.service.http.app import CONFIG, INCARNATION, PEERS, READINESS, PeerReady
from kvhandoff.service.http.egress import EGRESS, Egress
from kvhandoff.service.http.peer_client import PeerClient
from kvhandoff.service.peers.heartbeat import Heartbeats, HeartbeatSettings
from kvhandoff.service.peers.protocol import HttpPeers
from kvhandoff.service.runtime.admission import Admission
from kvhandoff.service.runtime.persistence import PERSISTENCE, Persistence, open_persistence
from kvhandoff.service.runtime.stages import Buffers, HostedMemory, open_stages
from kvhandoff.service.runtime.transfer_memory import TransferMemory, open_transfer_memory
from kvhandoff.service.runtime.transport import TRANSPORT, transport_opened
from kvhandoff.transport.base import Transport

log = logging.getLogger("kvhandoff.handoffs")


@dataclass(kw_only=True)
class RuntimeBase:
    """What both roles run: the stages hosted here, the event bus, the peer calls, heartbeats."""

    config: Config
    url: str
    target: str
    bus: EventBus
    hosted: list[HostedMemory]
    heartbeats: Heartbeats
    peers: HttpPeers
    incarnation: str
    max_call_s: float
    # Set when the app begins to shut down: ends the peers' watch streams.
    closing: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def role(self) -> str:
        return self.config.role

    def layout_info(self) -> LayoutInfo:
        """`GET /v1/layout`: stage addresses only where peers write into them (a direct-mode
        decode), and the landing arena on a landed one (DESIGN: what is registered is reachable)."""
        mode = self.config.transfer.mode
        return LayoutInfo(
            version=PEER_PROTOCOL_VERSION,
            role=self.role,
            url=self.url,
            target=self.target,
            stages=[h.info(addresses=self.publishes_addresses) for h in self.hosted],
            incarnation=self.incarnation,
            max_call_s=self.max_call_s,
            mode=mode,
            arena=self.arena_span(),
        )

    @property
    def publishes_addresses(self) -> bool:
        return False

    def arena_span(self) -> ArenaSpan | None:
        return None


@dataclass(kw_only=True)
class DecodeRuntime(RuntimeBase):
    pipeline: DecodePipeline
    #: Every door's one path to a create (`kvhandoff.service.runtime.admission`).
    admission: Admission

    @property
    def persistence(self) -> Persistence | None:
        """Records and webhooks once open; None with `records.persist = false`."""
        return self.admission.persistence

    @property
    def publishes_addresses(self) -> bool:
        # Direct mode: its prefills plan writes into these pages (and the pool is registered).
        return self.config.transfer.mode == "direct"

    def arena_span(self) -> ArenaSpan | None:
        return self.pipeline.arena_span()

    async def create(self, request: HandoffRequest) -> tuple[HandoffView, bool]:
        """Admit and create a handoff: every door's one path
        (`kvhandoff.service.runtime.admission`)."""
        return await self.admission.create(request)

    def arenas(self) -> list[ArenaUse]:
        """The landing arena in use (none in direct mode)."""
        use = self.pipeline.query.arena()
        return [] if use is None else [use]

    def in_flight(self) -> int:
        """Handoffs started and not yet terminal."""
        return self.pipeline.query.in_flight()


@dataclass(kw_only=True)
class PrefillRuntime(RuntimeBase):
    pipeline: PrefillPipeline

    def arenas(self) -> list[ArenaUse]:
        """The staging buffer in use (none in direct mode)."""
        use = self.pipeline.query.arena()
        return [] if use is None else [use]

    def in_flight(self) -> int:
        """Handoffs with a destination from a decode and not yet ended here."""
        return len({i for ids in self.pipeline.live_by_decode().values() for i in ids})


Runtime = DecodeRuntime | PrefillRuntime

#: The runtime of either role (what both roles' routes read), and each role's own.
RUNTIME: web.AppKey[Runtime] = web.AppKey("runtime")
DECODE = web.AppKey("decode_runtime", DecodeRuntime)
PREFILL = web.AppKey("prefill_runtime", PrefillRuntime)
#: Called with the runtime once it is built, before the app serves (bus listeners, collectors).
_ON_RUNTIME = web.AppKey("on_runtime", list)


def decode_of(request: web.Request) -> DecodePipeline:
    return request.app[DECODE].pipeline


def prefill_of(request: web.Request) -> PrefillPipeline:
    return request.app[PREFILL].pipeline


# ---------------------------------------------------------------------------------------------
# The heartbeats' view of each role (`kvhandoff.service.peers.heartbeat.PeerSide`)


class _DecodeSide:
    def __init__(self, pipeline: DecodePipeline) -> None:
        self._p = pipeline

    def live(self) -> dict[str, list[str]]:
        return self._p.live_by_prefill()

    def listing(self, url: str) -> list[str]:
        return self._p.live_with(url)

    async def lost(self, url: str, reason: str) -> None:
        self._p.peer_lost(url, reason)

    def back(self, url: str) -> None:
        self._p.peer_back(url)

    async def reconcile(self, url: str, ack: HeartbeatAck, sent: list[str]) -> None:
        self._p.reconcile(url, ack, sent)


class _PrefillSide:
    def __init__(self, pipeline: PrefillPipeline) -> None:
        self._p = pipeline

    def live(self) -> dict[str, list[str]]:
        return self._p.live_by_decode()

    def listing(self, url: str) -> list[str]:
        return self._p.live_with(url)

    async def lost(self, url: str, reason: str) -> None:
        await self._p.peer_lost(url, reason)

    def back(self, url: str) -> None:
        pass  # a prefill re-learns a decode from its next destination

    async def reconcile(self, url: str, ack: HeartbeatAck, sent: list[str]) -> None:
        await self._p.reconcile(url, ack, sent)


# ---------------------------------------------------------------------------------------------
# Building a role


@dataclass(frozen=True, slots=True)
class _Shared:
    """What both roles build the same way, before the pipeline."""

    url: str
    target: str
    bus: EventBus
    peers: HttpPeers
    incarnation: str
    max_call_s: float


def _shared(config: Config, transport: Transport, client: PeerClient, incarnation: str) -> _Shared:
    handoff = config.handoff
    # Numbered from this life's start: ids never repeat an earlier life's (SSE resume).
    bus = EventBus(replay=handoff.sse_buffer, first_seq=life_first_seq())
    bus.add_listener(_log_event)
    peers = HttpPeers(
        client,
        # An abort answers once in-flight writes drained: give it a transfer's time and then some.
        abort_timeout_s=config.transport.max_call_s + 5.0,
        watch_idle_s=2 * handoff.heartbeat_interval_s + 1.0,
    )
    return _Shared(
        url=config.server.public_url,
        target=transport.local_target,
        bus=bus,
        peers=peers,
        incarnation=incarnation,  # what signed peer requests and answers are bound to
        # The longest one engine call of this process can still write once started: declared
        # to the decode side, whose grace past the deadline it bounds.
        max_call_s=transport.max_call_s,
    )


def _heartbeats(config: Config, s: _Shared, side: _DecodeSide | _PrefillSide) -> Heartbeats:
    return Heartbeats(
        url=s.url,
        role=config.role,
        peers=s.peers,
        side=side,
        settings=HeartbeatSettings.of(config.handoff, config.peers),
        incarnation=s.incarnation,
    )


def build_decode(
    config: Config,
    transport: Transport,
    client: PeerClient,
    hosted: list[HostedMemory],
    transfer: TransferMemory | None,
    incarnation: str,
) -> DecodeRuntime:
    """The decode role's runtime over its one hosted stage and its landing arena (`transfer`;
    None in direct mode). Records are opened by the caller."""
    s = _shared(config, transport, client, incarnation)
    handoff = config.handoff
    memory = hosted[0].memory if hosted[0].pool.on_host else None
    if handoff.verify and memory is None:
        raise ConfigError("handoff.verify", "verification needs a host-readable decode pool")
    pipeline = DecodePipeline(
        hosted[0].layout,
        s.target,
        s.url,
        s.peers,
        s.bus,
        memory=memory,
        landing=transfer.landing(config, hosted[0]) if transfer is not None else None,
        default_prefill=config.peers.prefill,
        settings=handoff.decode_settings(),
        incarnation=s.incarnation,
    )
    beats = _heartbeats(config, s, _DecodeSide(pipeline))
    pipeline.on_peers = beats.joined
    return DecodeRuntime(
        config=config,
        url=s.url,
        target=s.target,
        bus=s.bus,
        hosted=hosted,
        heartbeats=beats,
        peers=s.peers,
        incarnation=s.incarnation,
        max_call_s=s.max_call_s,
        pipeline=pipeline,
        admission=Admission(pipeline, handoff.max_metadata_bytes),
    )


def build_prefill(
    config: Config,
    transport: Transport,
    client: PeerClient,
    hosted: list[HostedMemory],
    transfer: TransferMemory | None,
    incarnation: str,
) -> PrefillRuntime:
    """The prefill role's runtime over every stage hosted here and its staging buffer."""
    s = _shared(config, transport, client, incarnation)
    pipeline = PrefillPipeline(
        {
            h.layout.pp_rank: HostedStage(h.layout, h.memory if h.pool.on_host else None, h.memory)
            for h in hosted
        },
        transport,
        s.peers,
        s.bus,
        url=s.url,
        incarnation=s.incarnation,
        settings=config.prefill_settings(),
        staging=transfer.staging() if transfer is not None else None,
    )
    beats = _heartbeats(config, s, _PrefillSide(pipeline))
    pipeline.on_peers = beats.joined
    return PrefillRuntime(
        config=config,
        url=s.url,
        target=s.target,
        bus=s.bus,
        hosted=hosted,
        heartbeats=beats,
        peers=s.peers,
        incarnation=s.incarnation,
        max_call_s=s.max_call_s,
        pipeline=pipeline,
    )


@contextlib.asynccontextmanager
async def open_runtime(
    config: Config,
    transport: Transport,
    client: PeerClient,
    incarnation: str,
    buffers: Buffers | None = None,
    *,
    egress: Egress,
    ready: Callable[[Runtime], None] = lambda runtime: None,
) -> AsyncIterator[Runtime]:
    """The role's runtime, running, until the `async with` ends; then every resource it opened
    is closed once (see the module docstring). `ready(runtime)` runs once it is built and its
    records restored, before the app serves."""
    opening = asyncio.ensure_future(asyncio.to_thread(open_stages, config, transport, buffers))
    try:
        hosted = await asyncio.shield(opening)
    except asyncio.CancelledError:
        # Start-up abandoned: the thread runs on, so close what it opens once it is done.
        opening.add_done_callback(_close_opened)
        raise
    try:
        transfer = await asyncio.to_thread(open_transfer_memory, config, transport, hosted)
    except BaseException:
        await asyncio.to_thread(_close_pools, hosted)
        raise
    try:
        async with contextlib.AsyncExitStack() as stack:
            # Closed in reverse: the pipeline first (a decode's shutdown aborts are recorded
            # and their webhooks queued), then the records and webhooks, then the heartbeats —
            # which keep running while live handoffs are aborted, so a peer that stops
            # answering is declared lost instead of holding up the shutdown — and the peer calls.
            runtime: Runtime = (
                build_decode(config, transport, client, hosted, transfer, incarnation)
                if config.role == "decode"
                else build_prefill(config, transport, client, hosted, transfer, incarnation)
            )
            stack.push_async_callback(runtime.peers.close)
            # The heartbeats' own tasks end with `run()` (its `finally` closes them).
            beat = asyncio.get_running_loop().create_task(
                runtime.heartbeats.run(), name="kvhandoff-heartbeats"
            )
            stack.push_async_callback(_cancel, beat)
            if isinstance(runtime, DecodeRuntime):
                if config.records.persist:
                    runtime.admission.persistence = await stack.enter_async_context(
                        open_persistence(config, runtime.pipeline, runtime.bus, egress)
                    )
                stack.push_async_callback(runtime.pipeline.close, config.handoff.shutdown_grace_s)
            else:
                stack.push_async_callback(runtime.pipeline.close)
            ready(runtime)
            yield runtime
    finally:
        if transfer is not None:
            await asyncio.to_thread(transfer.close)
        await asyncio.to_thread(_close_pools, hosted)


async def _cancel(task: asyncio.Task[None]) -> None:
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


# ---------------------------------------------------------------------------------------------
# In the app


def install_runtime(app: web.Application, buffers: Buffers | None = None) -> None:
    """Run the role's runtime with the app: one cleanup context opens the transport, then the
    runtime over it (`open_runtime`), and closes both in reverse; /readyz waits for both."""
    hooks = _hooks(app)

    async def runtime_ctx(app: web.Application) -> AsyncIterator[None]:
        def ready(runtime: Runtime) -> None:
            app[RUNTIME] = runtime
            if isinstance(runtime, DecodeRuntime):
                app[DECODE] = runtime
                if runtime.persistence is not None:
                    app[PERSISTENCE] = runtime.persistence
            else:
                app[PREFILL] = runtime
            for hook in hooks:
                hook(runtime)

        async with (
            transport_opened(app) as transport,
            open_runtime(
                app[CONFIG],
                transport,
                app[PEERS],
                app[INCARNATION],
                buffers,
                egress=app[EGRESS],
                ready=ready,
            ),
        ):
            yield

    app.cleanup_ctx.append(runtime_ctx)
    app.on_shutdown.append(_closing)
    readiness = app[READINESS]
    readiness.add("transport", lambda: TRANSPORT in app)
    readiness.add("handoffs", lambda: RUNTIME in app)
    config = app[CONFIG]
    if config.role == "decode" and config.records.persist:
        # Not ready until restored, nor after a write failed: routers must go elsewhere.
        readiness.add("records", lambda: _records_ok(app))
    readiness.peers = lambda: _peers_ready(app)
    if config.role == "decode" and config.peers.prefill:
        # A handoff without its own `prefill` list goes to the configured ones: with none of
        # them reachable now (the heartbeats ping them whether or not anything is in flight),
        # this decode cannot do its job and routers must go elsewhere.
        readiness.add("peers", lambda: any(p.up for p in _peers_ready(app) if p.configured))


def on_runtime(app: web.Application, hook: Callable[[Runtime], None]) -> None:
    """Call `hook(runtime)` once the role's runtime is built, before the app serves (whatever
    the order extensions were installed in)."""
    _hooks(app).append(hook)


def _hooks(app: web.Application) -> list[Callable[[Runtime], None]]:
    if _ON_RUNTIME not in app:
        app[_ON_RUNTIME] = []
    hooks: list[Callable[[Runtime], None]] = app[_ON_RUNTIME]
    return hooks


def _peers_ready(app: web.Application) -> list[PeerReady]:
    """The peers the heartbeats track (configured ones first), for `/readyz`."""
    if RUNTIME not in app:
        return []
    rows = [
        PeerReady(p.url, p.up, p.configured, p.last_heard_s)
        for p in app[RUNTIME].heartbeats.health()
    ]
    return sorted(rows, key=lambda p: (not p.configured, p.url))


def _records_ok(app: web.Application) -> bool:
    return PERSISTENCE in app and app[PERSISTENCE].broken is None


async def _closing(app: web.Application) -> None:
    # Runs before the server waits for open handlers: the watch streams must end first.
    if RUNTIME in app:
        app[RUNTIME].closing.set()


def _close_opened(opening: asyncio.Future[list[HostedMemory]]) -> None:
    if not opening.cancelled() and opening.exception() is None:
        _close_pools(opening.result())


def _close_pools(hosted: list[HostedMemory]) -> None:
    for h in hosted:
        h.pool.close()


def _log_event(event: Event) -> None:
    # An outcome that is not a completion says why in its own line: an operator following the
    # info log needs no second look-up to tell a timeout from a refused peer. Code and reason
    # may come from a peer: quoted (repr), so neither can forge a line of its own. (An abort
    # has no code: its tag is its kind.)
    if isinstance(event, HandoffFailed | HandoffAborted):
        code = f" code={event.code!r}" if isinstance(event, HandoffFailed) else ""
        what = (event_tag(event), event.role, event.handoff_id, code, event.reason)
        log.info("%s %s %s%s reason=%r", *what)
    elif isinstance(event, TERMINAL_EVENTS):
        log.info("%s %s %s", event_tag(event), event.role, event.handoff_id)
    elif log.isEnabledFor(logging.DEBUG):
        log.debug("%s %s %s", event_tag(event), event.role, event.handoff_id)
