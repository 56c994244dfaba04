"""The decode side of a handoff's lifecycle: create it, deliver its destinations, take in its
stages' notices, and turn each into an outcome (`outcomes.py`) when one is due.

Called by the service's router-facing routes (`create`, `get`, `page`, `wait`, `abort`), its peer
routes (`arrived`, `stage_failed`), its heartbeat task (`peer_lost`, `peer_back`, `reconcile`,
`live_by_prefill`, `live_with`) and its start-up and shutdown (`adopt`, `close`). A handoff is
created here with its destination; every check that can fail (pages, fencing, prefill layouts,
pairing: `prefill_peers.py`) runs before the destination is sent, so a rejected handoff never
moves a byte. Destinations are sent by `delivery.py`, landed segments taken in by
`segments.py`. The outcome is announced as soon as it is known; what happens to the pages after
it (stopping the writers, the lease's release, `handoff.released`) is `release.py`'s. The handoff as
held: `handoff.py`; states and their legal changes: `states.py`; the safety argument:
SAFETY.md.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Coroutine, Iterable
from typing import Any

import msgspec

from kvhandoff.pipelines.decode.arrivals import StageNotices
from kvhandoff.pipelines.decode.delivery import Delivery, PrefillPeer
from kvhandoff.pipelines.decode.handoff import I64, ROLE, DecodeHandoff, DecodeStage, publish
from kvhandoff.pipelines.decode.heartbeats import PrefillWatch
from kvhandoff.pipelines.decode.history import HandoffHistory
from kvhandoff.pipelines.decode.landing import Landing
from kvhandoff.pipelines.decode.leases import Leases, slot_claims
from kvhandoff.pipelines.decode.outcomes import Outcomes
from kvhandoff.pipelines.decode.prefill_peers import PrefillDirectory, Stages
from kvhandoff.pipelines.decode.queries import DecodeQueries
from kvhandoff.pipelines.decode.release import Releases
from kvhandoff.pipelines.decode.segments import SegmentExchange
from kvhandoff.pipelines.decode.views import (
    FencedPages,
    HandoffArchive,
    HandoffPage,
    HandoffRequest,
    HandoffView,
)
from kvhandoff.pipelines.errors import (
    CapacityExceeded,
    ConflictError,
    InvalidInput,
)
from kvhandoff.pipelines.events import (
    EventBus,
    HandoffCreated,
)
from kvhandoff.pipelines.layout import StageLayout
from kvhandoff.pipelines.memory import EntryMemory
from kvhandoff.pipelines.messages import (
    ArenaSpan,
    ArrivalMsg,
    HeartbeatAck,
    SegmentAck,
    SegmentMsg,
    StageFailedMsg,
    TransferMode,
    WindowAnswer,
    WindowRequest,
)
from kvhandoff.pipelines.pairing import PairingCache
from kvhandoff.pipelines.peercache import new_incarnation
from kvhandoff.pipelines.planning import validate_pages_for_layout
from kvhandoff.pipelines.settings import DECODE_DEFAULTS, DecodeSettings
from kvhandoff.pipelines.states import HandoffState, ReleaseState

# What the service, routers' clients and tests import from here (the handoff record moved to
# `handoff`, the states to `states`).
__all__ = ["DecodeHandoff", "DecodePipeline", "HandoffState", "PrefillPeer"]

log = logging.getLogger(__name__)


class DecodePipeline:
    def __init__(
        self,
        layout: StageLayout,
        target: str,
        url: str,
        prefill: PrefillPeer,
        bus: EventBus,
        *,
        memory: EntryMemory | None = None,
        landing: Landing | None = None,
        cache: PairingCache | None = None,
        default_prefill: list[str] | None = None,
        settings: DecodeSettings = DECODE_DEFAULTS,
        incarnation: str | None = None,
        clock: Callable[[], float] = time.time,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        self.layout = layout
        self.target = target
        self.url = url
        self.incarnation = incarnation or new_incarnation()
        self._prefill = prefill
        self._bus = bus
        self._memory = memory
        # Landed mode when present: prefills write only into its windows; pages change only
        # by its commits (SAFETY.md S1). Direct mode (None): prefills write into the pages.
        self._landing = landing
        self.cache = cache or PairingCache()
        self._default_prefill = list(default_prefill or [])
        self._max_live = settings.max_live
        self._default_deadline_s = settings.default_deadline_s
        self._verify_default = settings.verify_default
        self._history = settings.history
        self._clock = clock  # unix time of views, events and records
        self._monotonic = monotonic  # what bounds are measured on
        num_pages = min((e.num_items for e in layout.kv), default=0)
        num_slots = min((s.num_slots for s in layout.state), default=0)
        self.leases = Leases(num_pages, num_slots)
        self._handoffs: dict[str, DecodeHandoff] = {}
        self._seq = 0
        self._tasks: set[asyncio.Task[None]] = set()
        self._assemble(settings.max_grace_s)
        self._watch = PrefillWatch(self._handoffs, self._peers, self._outcomes, self._releases)
        #: What the service reads of the handoffs held here (`queries.py`): snapshots only.
        self.query = DecodeQueries(
            self._handoffs, self.leases, self._peers, landing, archived=self._past.archived
        )
        # Told the peers of every new handoff (the heartbeats start watching them at once).
        self.on_peers: Callable[[list[str]], None] = lambda peers: None

    def _assemble(self, max_grace_s: float) -> None:
        """The parts a handoff passes through, each given what it may touch."""
        prefill, bus, landing = self._prefill, self._bus, self._landing
        clock, monotonic = self._clock, self._monotonic
        self._peers = PrefillDirectory(
            self.layout, prefill, self.cache, max_grace_s=max_grace_s, clock=clock
        )
        # Everything about a lease after its handoff's outcome.
        self._releases = Releases(
            self.leases,
            prefill,
            bus,
            incarnation=self.incarnation,
            max_grace_s=max_grace_s,
            spawn=self._spawn,
            lost=self._peers.is_lost,
            landing=landing,
            clock=clock,
            monotonic=monotonic,
        )
        self._outcomes = Outcomes(bus, self._releases, clock=clock, monotonic=monotonic)
        self._past = HandoffHistory(self._handoffs, self._releases)
        self._delivery = Delivery(
            url=self.url,
            incarnation=self.incarnation,
            target=self.target,
            layout=self.layout,
            prefill=prefill,
            peers=self._peers,
            outcomes=self._outcomes,
            landing=landing,
            monotonic=monotonic,
        )
        self._notices = StageNotices(
            self._handoffs,
            self.layout,
            self.incarnation,
            self.cache,
            bus,
            self._outcomes,
            self._releases,
            landed=landing is not None,
            memory=self._memory,
            spawn=self._spawn,
        )
        self._segments = (
            None
            if landing is None
            else SegmentExchange(
                landing,
                self.layout,
                self.cache,
                bus,
                self._outcomes,
                self._releases,
                self._notices.arrive,
            )
        )

    # ----------------------------------------------------------------- router-facing

    async def create(self, req: HandoffRequest) -> tuple[HandoffView, bool]:
        """Create a handoff (or return the existing one for an identical request).

        Returns (view, created). Raises InvalidInput, PairingError or ConflictError having
        changed nothing.
        """
        if not req.prefill:
            if not self._default_prefill:
                raise InvalidInput(
                    "name the prefill services (no peers.prefill is configured)", field="prefill"
                )
            req = msgspec.structs.replace(req, prefill=self._default_prefill)
        existing = self._past.existing(req)
        if existing is not None:
            return existing, False
        dst_pages = validate_pages_for_layout(
            self.layout, req.dst_pages, req.slots, side="destination", unique=True
        )
        evicted = self._past.evicted
        stages = await self._peers.stages_of(req.prefill)
        # Another create of this id may have won meanwhile: it is held here, or it was evicted
        # to the archive since (only then is the archive read again).
        existing = self._past.existing(req, archive=self._past.evicted != evicted)
        if existing is not None:
            return existing, False
        live = self._outcomes.live
        if live >= self._max_live:  # checked after the await: creates run concurrently
            raise CapacityExceeded(
                f"{live} handoffs are in flight (handoff.max_concurrent = {self._max_live})",
                live=live,
            )
        if self._landing is not None:  # raises (changing nothing) if a page cannot fit a window
            pairings = {r: self.cache.get(lay, self.layout) for r, (_, _, lay) in stages.items()}
            peers = {r: url for r, (url, _, _) in stages.items()}
            self._landing.open(req.id, dst_pages, pairings, peers)
        # I1: leased before anything is sent; nothing awaited from here on.
        try:
            self.leases.acquire(req.id, dst_pages, slot_claims(self.layout, req.slots))
        except BaseException:
            if self._landing is not None:
                self._landing.forget(req.id)
            raise
        h = self._new_handoff(req, dst_pages, stages)
        self._handoffs[req.id] = self._releases.unreleased[req.id] = h  # held; unreleased
        self._outcomes.open(h)  # counted live, its deadline armed
        self._past.evict(self._history)
        publish(
            self._bus,
            h,
            HandoffCreated(
                handoff_id=h.id,
                role=ROLE,
                num_pages=int(dst_pages.shape[0]),
                pp_size=len(h.stages),
                metadata=req.metadata,
            ),
        )
        h.delivery = self._spawn(self._delivery.deliver(h))  # forgotten as it ends
        self.on_peers(h.peers)
        return h.view(), True

    def _new_handoff(self, req: HandoffRequest, dst_pages: I64, stages: Stages) -> DecodeHandoff:
        self._seq += 1
        return DecodeHandoff.admitted(
            req,
            self._seq,
            dst_pages,
            {r: DecodeStage(u, i.incarnation, y, i.max_call_s) for r, (u, i, y) in stages.items()},
            now=self._clock(),
            mono=self._monotonic(),
            deadline_s=req.deadline_s or self._default_deadline_s,
            verify=self._verify_default if req.verify is None else req.verify,
            host_readable=self._memory is not None or self._landing is not None,
        )

    def get(self, handoff_id: str, *, timeline: bool = True) -> HandoffView:
        return self._past.get(handoff_id, timeline=timeline)

    async def wait(
        self, handoff_id: str, timeout_s: float, *, released: bool = False
    ) -> HandoffView:
        """The handoff once it has an outcome (or, with `released`, once its pages are free),
        or as it is after `timeout_s` (a router's long poll; `history.py`)."""
        return await self._past.wait(handoff_id, timeout_s, released=released)

    def page(
        self, state: HandoffState | None = None, limit: int = 100, cursor: int = 0
    ) -> HandoffPage:
        """Handoffs in creation order after `cursor`, optionally of one state."""
        return self._past.page(state, limit, cursor)

    async def abort(self, handoff_id: str, reason: str = "aborted by request") -> HandoffView:
        """Abort a handoff; returns once its pages are released (no write of it can land).

        The outcome `aborted` is announced at once. On a failed handoff whose pages are not
        released yet, this retries stopping its writers now and waits for the release instead
        of refusing. A completed (or failed and released) handoff is a ConflictError, as is one
        of an earlier life of this service that did not end aborted.
        """
        h = self._handoffs.get(handoff_id)
        if h is None:
            view = self._past.archived(handoff_id)
            if view.state == HandoffState.ABORTED:
                return view
            raise ConflictError(
                f"handoff {handoff_id!r} is already {view.state.value}",
                field="id",
                state=view.state,
            )
        if h.state == HandoffState.FAILED and h.release != ReleaseState.RELEASED:
            h.progress.set()  # the quiesce retries unanswered peers now
        elif h.state.terminal and h.state != HandoffState.ABORTED:
            raise ConflictError(
                f"handoff {handoff_id!r} is already {h.state.value}", field="id", state=h.state
            )
        elif not h.state.terminal:
            self._outcomes.abort(h, reason)
        task = self._releases.start(h, reason)
        if task is not None:
            # Shielded: a caller that stops waiting (a timeout, a closed connection) must not cut
            # the quiesce short and free the pages while a stage may still write.
            await asyncio.shield(task)
        return h.view()

    # ----------------------------------------------------------------- peer-facing

    def arrived(self, msg: ArrivalMsg) -> None:
        """Stage `msg.pp_rank` says every byte landed (`arrivals.py`: refused, changing nothing,
        unless from the stage's own prefill life and accounting for exactly its bytes)."""
        self._notices.arrived(msg)

    def stage_failed(self, msg: StageFailedMsg) -> None:
        """Stage `msg.pp_rank` failed and says no write of it can still land (from its own
        prefill life only)."""
        self._notices.stage_failed(msg)

    async def window(self, msg: WindowRequest) -> WindowAnswer:
        """Stage `msg.pp_rank` asks for a window for its next segment (landed mode): granted
        when the arena has room within a short wait, else none (it asks again)."""
        h, _ = self._notices.landed_stage(msg)
        return await self._need_segments().window(h, msg)

    async def segment(self, msg: SegmentMsg) -> SegmentAck:
        """A segment of stage `msg.pp_rank` landed in its window: committed into the pages once
        its digest matches (`segments.py`); the last one is the stage's arrival."""
        h, stage = self._notices.landed_stage(msg)
        return await self._need_segments().segment(h, stage, msg)

    @property
    def peer_layout(self) -> StageLayout:
        """What peers learn of this decode's memory (`GET /v1/layout`, destinations): its
        pages' addresses only in direct mode, where prefills write into them."""
        return self._delivery.peer_layout

    @property
    def mode(self) -> TransferMode:
        """The one transfer mode this decode serves (a landing arena: landed)."""
        return "direct" if self._landing is None else "landed"

    def arena_span(self) -> ArenaSpan | None:
        """The landing arena peers may write into (None in direct mode): published in the
        layout and in every destination, where a prefill checks every grant lies."""
        return self._delivery.arena

    def _need_segments(self) -> SegmentExchange:
        if self._segments is None:
            raise ConflictError(
                "this decode service runs direct mode (transfer.mode): it grants no windows",
                field="mode",
            )
        return self._segments

    # ----------------------------------------------------------------- heartbeat-facing

    def live_by_prefill(self) -> dict[str, list[str]]:
        """Whom to ping, and per peer what its answer is checked against (`PrefillWatch`)."""
        return self._watch.live_by_prefill()

    def live_with(self, url: str) -> list[str]:
        """Every unreleased handoff with a stage on prefill `url` (a heartbeat answer)."""
        return self._watch.live_with(url)

    def peer_lost(self, url: str, reason: str) -> list[str]:
        """Prefill `url` is gone: fail the handoffs waiting on it (`PrefillWatch.peer_lost`)."""
        return self._watch.peer_lost(url, reason)

    def peer_back(self, url: str) -> None:
        self._watch.peer_back(url)

    def reconcile(self, url: str, ack: HeartbeatAck, sent: list[str]) -> list[str]:
        """Apply prefill `url`'s heartbeat answer (`PrefillWatch.reconcile`)."""
        return self._watch.reconcile(url, ack, sent)

    # ----------------------------------------------------------------- restart and shutdown

    def adopt(self, archive: HandoffArchive, fenced: Iterable[FencedPages]) -> None:
        """After a restart (call before serving): answer for ids this process does not hold from
        `archive`, and keep each `fenced` handoff's pages leased until its `release_at`, so no
        new handoff gets pages an earlier process's prefill stages may still write."""
        self._past.archive = archive
        self._releases.restore(self.layout, archive, fenced)

    async def close(self, timeout_s: float | None = None) -> None:
        """Abort every live handoff and wait until every handoff's pages are released — never
        sooner, so no prefill stage can write into pages this service gives back — then stop
        the remaining background tasks.

        `timeout_s` bounds the wait of a service that is stopping (its prefill peers may be gone
        too, and then only the deadline plus the declared engine bound would free the pages).
        What is unreleased by then stays leased: its quiesce is cancelled, which releases
        nothing. The caller must then close the transport that receives the writes before the
        memory is reused; the service does (pools are unregistered and the engine closed right
        after this returns), so no write can land afterwards, and the handoff's record, still
        unreleased, keeps the pages fenced if the service starts again on them (direct mode;
        landed, no commit runs once this returns, so nothing is left to fence)."""
        live = [h.id for h in self._handoffs.values() if not h.state.terminal]
        aborts = asyncio.gather(
            *(self.abort(hid, "decode service shutting down") for hid in live),
            return_exceptions=True,
        )
        try:
            async with asyncio.timeout(timeout_s):
                results = await asyncio.shield(aborts)
                for hid, result in zip(live, results):
                    if isinstance(result, BaseException):
                        log.warning("abort of %s on shutdown failed: %r", hid, result)
                quiescing = [h.quiesce for h in self._handoffs.values() if h.quiesce is not None]
                await asyncio.shield(asyncio.gather(*quiescing, return_exceptions=True))
        except TimeoutError:
            unreleased = [
                h.id for h in self._handoffs.values() if h.release != ReleaseState.RELEASED
            ]
            log.warning(
                "stopping with %d handoff(s) unreleased after %g s (%s): their pages stay "
                "leased until this service's transport is closed",
                len(unreleased),
                timeout_s,
                ", ".join(unreleased[:8]),
            )
        for task in list(self._tasks):
            task.cancel()  # finished ones are unaffected; a cancelled quiesce releases nothing
        await asyncio.gather(*self._tasks, aborts, return_exceptions=True)
        self._releases.close()
        if self._landing is not None:
            await self._landing.drain()  # a cancelled caller's commit may still be copying
            self._landing.close()

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task
