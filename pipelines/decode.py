"""The decode side of a handoff: create, deliver destinations, aggregate arrivals, finish.

Called by the service's router-facing routes (`create`, `get`, `list`, `abort`), its peer routes
(`arrived`, `stage_failed`) and its heartbeat task (`peer_lost`, `reconcile`). A handoff is
created here with its destination; every check that can fail (pages, fencing, prefill layouts,
pairing) runs before the destination is sent, so a rejected handoff never moves a byte. The
outcome is announced as soon as it is known; the pages' lease is released (`handoff.released`)
only once no write of the handoff can still land. States and their legal changes: `states.py`;
the safety argument: SAFETY.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

import msgspec
import numpy as np
import numpy.typing as npt

from pipelines.decode_views import (
    ArchivedHandoff,
    ErrorView,
    FencedPages,
    HandoffArchive,
    HandoffPage,
    HandoffRequest,
    HandoffView,
    StageView,
)
from pipelines.errors import (
    CapacityExceeded,
    ConflictError,
    DeadlineExceeded,
    InvalidInput,
    KVHandoffError,
    NotFoundError,
    PairingError,
    PeerUnreachable,
)
from pipelines.events import (
    Event,
    EventBus,
    HandoffAborted,
    HandoffCompleted,
    HandoffCreated,
    HandoffFailed,
    HandoffReleased,
    StageArrived,
)
from pipelines.layout import StageLayout
from pipelines.leases import Leases
from pipelines.memory import EntryMemory
from pipelines.messages import (
    AbortAck,
    AbortMsg,
    ArrivalMsg,
    DestinationMsg,
    HeartbeatAck,
    LayoutInfo,
    StageFailedMsg,
)
from pipelines.notices import check_accounting, check_sender, first_mismatch
from pipelines.pairing import PairingCache, pairing_report
from pipelines.peercache import MAX_PEERS, PeerCache, new_incarnation
from pipelines.planning import validate_pages_for_layout
from pipelines.states import (
    TRANSITIONS,
    HandoffState,
    ReleaseState,
    StageState,
    advance,
)

log = logging.getLogger(__name__)
I64 = npt.NDArray[np.int64]
ROLE = "decode"


class PrefillPeer(Protocol):
    """Decode → prefill calls, implemented by the service over HTTP."""

    async def layout(self, url: str) -> LayoutInfo: ...

    async def deliver(self, url: str, msg: DestinationMsg) -> None: ...

    async def abort(self, url: str, msg: AbortMsg) -> AbortAck: ...


@dataclass
class _Stage:
    peer: str
    incarnation: str  # the prefill life this stage is bound to (from its layout)
    layout: StageLayout
    max_call_s: float  # the longest engine call its prefill declared
    state: StageState = StageState.WAITING
    bytes: int = 0
    digests: dict[str, str] | None = None
    delivered: bool = False  # its prefill service accepted the destination
    # No write of this stage can land any more: it arrived, reported its own failure, or its
    # prefill acknowledged an abort (or no longer has the handoff).
    stopped: bool = False


@dataclass
class DecodeHandoff:
    request: HandoffRequest
    seq: int
    dst_pages: I64
    created_at: float
    deadline_at: float  # unix seconds, for views and records
    verify: bool
    stages: dict[int, _Stage]
    # The same deadline on the monotonic clock: every bound is measured on it, so a step of the
    # wall clock (NTP) cannot shorten how long pages stay fenced.
    deadline_mono: float = 0.0
    state: HandoffState = HandoffState.PENDING
    release: ReleaseState = ReleaseState.HELD
    finished_at: float | None = None
    released_at: float | None = None
    verification: str | None = None
    error: ErrorView | None = None
    timeline: list[Event] = field(default_factory=list)
    timer: asyncio.TimerHandle | None = None
    quiesce: asyncio.Task[None] | None = None  # the one task that stops writers and releases
    done: asyncio.Event = field(default_factory=asyncio.Event)  # the outcome is known
    released: asyncio.Event = field(default_factory=asyncio.Event)  # the pages are free
    progress: asyncio.Event = field(default_factory=asyncio.Event)  # a stage stopped / hurry up

    @property
    def id(self) -> str:
        return self.request.id

    @property
    def peers(self) -> list[str]:
        return sorted({s.peer for s in self.stages.values()})

    def view(self, *, timeline: bool = True) -> HandoffView:
        return HandoffView(
            id=self.id,
            state=self.state,
            created_at=self.created_at,
            deadline_at=self.deadline_at,
            num_pages=int(self.dst_pages.shape[0]),
            dst_slot=self.request.dst_slot,
            prefill=list(self.request.prefill),
            verify=self.verify,
            bytes=sum(s.bytes for s in self.stages.values()),
            stages=[
                StageView(rank, s.peer, s.state, s.bytes) for rank, s in sorted(self.stages.items())
            ],
            released=self.release == ReleaseState.RELEASED,
            finished_at=self.finished_at,
            released_at=self.released_at,
            verification=self.verification,
            error=self.error,
            metadata=self.request.metadata,
            timeline=list(self.timeline) if timeline else [],
        )


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
        cache: PairingCache | None = None,
        default_prefill: list[str] | None = None,
        max_live: int = 256,
        default_deadline_s: float = 30.0,
        verify_default: bool = False,
        max_grace_s: float = 60.0,
        history: int = 10000,
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
        self.cache = cache or PairingCache()
        self._default_prefill = list(default_prefill or [])
        self._max_live = max_live
        self._default_deadline_s = default_deadline_s
        self._verify_default = verify_default
        # The ceiling on any prefill's declared engine-call bound (see `_grace_s`).
        self._max_grace_s = max_grace_s
        self._history = history
        self._clock = clock  # unix time of views, events and records
        self._monotonic = monotonic  # what bounds are measured on
        num_pages = min((e.num_items for e in layout.kv), default=0)
        num_slots = min((s.num_slots for s in layout.state), default=0)
        self.leases = Leases(num_pages, num_slots)
        self.handoffs: dict[str, DecodeHandoff] = {}
        self._seq = 0
        self._live = 0  # handoffs without an outcome yet
        self._layouts: PeerCache[LayoutInfo] = PeerCache(MAX_PEERS)
        self._lost_peers: PeerCache[float] = PeerCache(MAX_PEERS)  # url -> when declared lost
        self._covered: set[tuple[tuple[int, str, str], ...]] = set()
        self._tasks: set[asyncio.Task[None]] = set()
        self._archive: HandoffArchive | None = None
        # Restored handoffs whose pages an earlier life's prefill may still write, until when.
        self._fenced_until: dict[str, float] = {}
        self._fence_timers: list[asyncio.TimerHandle] = []
        # Told the peers of every new handoff (the heartbeats start watching them at once).
        self.on_peers: Callable[[list[str]], None] = lambda peers: None

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
        existing = self._existing(req)
        if existing is not None:
            return existing, False
        dst_pages = validate_pages_for_layout(
            self.layout, req.dst_pages, req.dst_slot, side="destination", unique=True
        )
        stages = await self._stages_of(req.prefill)
        existing = self._existing(req)  # another create of this id may have won meanwhile
        if existing is not None:
            return existing, False
        if self._live >= self._max_live:  # checked after the await: creates run concurrently
            raise CapacityExceeded(
                f"{self._live} handoffs are in flight (handoff.max_concurrent = {self._max_live})",
                live=self._live,
            )
        self.leases.acquire(req.id, dst_pages, req.dst_slot if self.layout.state else None)
        now = self._clock()
        deadline_s = req.deadline_s or self._default_deadline_s
        verify = self._verify_default if req.verify is None else req.verify
        self._seq += 1
        h = DecodeHandoff(
            request=req,
            seq=self._seq,
            dst_pages=dst_pages,
            created_at=now,
            deadline_at=now + deadline_s,
            deadline_mono=self._monotonic() + deadline_s,
            verify=verify,
            stages={
                rank: _Stage(url, info.incarnation, layout, info.max_call_s)
                for rank, (url, info, layout) in stages.items()
            },
            verification=(
                "skipped: the decode pool is not host-readable"
                if verify and self._memory is None
                else None
            ),
        )
        self.handoffs[req.id] = h
        self._live += 1
        self._evict()
        h.timer = asyncio.get_running_loop().call_later(deadline_s, self._expire, h)
        self._publish(
            h,
            HandoffCreated(
                handoff_id=h.id,
                role=ROLE,
                num_pages=int(dst_pages.shape[0]),
                pp_size=len(stages),
                metadata=req.metadata,
            ),
        )
        self._spawn(self._deliver(h))
        self.on_peers(h.peers)
        return h.view(), True

    def get(self, handoff_id: str) -> HandoffView:
        h = self.handoffs.get(handoff_id)
        return h.view() if h is not None else self._archived(handoff_id)

    async def wait(
        self, handoff_id: str, timeout_s: float, *, released: bool = False
    ) -> HandoffView:
        """The handoff once it has an outcome (or, with `released`, once its pages are free),
        or as it is after `timeout_s` (a router's long poll). A handoff of an earlier life of
        this service is answered from the archive as it was recorded."""
        if handoff_id not in self.handoffs:
            return self._archived(handoff_id)
        h = self._get(handoff_id)
        event = h.released if released else h.done
        if not event.is_set() and timeout_s > 0:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(timeout_s):
                    await event.wait()
        return h.view()

    def page(
        self, state: HandoffState | None = None, limit: int = 100, cursor: int = 0
    ) -> HandoffPage:
        """Handoffs in creation order after `cursor`, optionally of one state."""
        items: list[HandoffView] = []
        next_cursor = None
        for h in self.handoffs.values():
            if h.seq <= cursor or (state is not None and h.state != state):
                continue
            if len(items) == limit:
                next_cursor = self.handoffs[items[-1].id].seq
                break
            items.append(h.view(timeline=False))
        return HandoffPage(items=items, next_cursor=next_cursor)

    async def abort(self, handoff_id: str, reason: str = "aborted by request") -> HandoffView:
        """Abort a handoff; returns once its pages are released (no write of it can land).

        The outcome `aborted` is announced at once. On a failed handoff whose pages are not
        released yet, this retries stopping its writers now and waits for the release instead
        of refusing. A completed (or failed and released) handoff is a ConflictError, as is one
        of an earlier life of this service that did not end aborted.
        """
        h = self.handoffs.get(handoff_id)
        if h is None:
            view = self._archived(handoff_id)
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
            self._finish(h, HandoffState.ABORTED)
            self._publish(
                h,
                HandoffAborted(
                    handoff_id=h.id, role=ROLE, reason=reason, metadata=h.request.metadata
                ),
            )
        task = self._stop(h, reason)
        if task is not None:
            # Shielded: a caller that stops waiting (a timeout, a closed connection) must not cut
            # the quiesce short and free the pages while a stage may still write.
            await asyncio.shield(task)
        return h.view()

    # ----------------------------------------------------------------- peer-facing

    def arrived(self, msg: ArrivalMsg) -> None:
        """Stage `msg.pp_rank` says every byte landed. Refused (changing nothing) unless it comes
        from the stage's own prefill life to this decode life and accounts for exactly the bytes
        this destination expects; a replay is a ConflictError."""
        h = self._get(msg.handoff_id)
        stage = self._stage(h, msg.pp_rank)
        self._check_sender(h, msg.pp_rank, stage, msg)
        if stage.state == StageState.ARRIVED:
            raise ConflictError(
                f"stage {msg.pp_rank} of handoff {h.id!r} has already arrived (replay refused)",
                field="pp_rank",
                pp_rank=msg.pp_rank,
            )
        self._check_accounting(h, msg)
        self._confirm_stopped(h, stage)  # its sender has finished writing either way
        if h.state.terminal or stage.state.final:
            return  # a late notice: an outcome never changes
        stage.state = advance(stage.state, StageState.ARRIVED, f"handoff {h.id!r} stage")
        stage.bytes, stage.digests = msg.bytes, msg.digests
        if h.state == HandoffState.PENDING:
            h.state = advance(h.state, HandoffState.TRANSFERRING, f"handoff {h.id!r}")
        arrived = sum(1 for s in h.stages.values() if s.state == StageState.ARRIVED)
        self._publish(
            h,
            StageArrived(
                handoff_id=h.id,
                role=ROLE,
                pp_rank=msg.pp_rank,
                bytes=msg.bytes,
                arrived=arrived,
                expected=len(h.stages),
            ),
        )
        if arrived == len(h.stages):
            if h.verify and self._memory is not None:
                self._spawn(self._verify_then_complete(h))  # digests off the event loop
            else:
                self._complete(h)

    def stage_failed(self, msg: StageFailedMsg) -> None:
        """Stage `msg.pp_rank` failed and says no write of it can still land (from its own
        prefill life only)."""
        h = self._get(msg.handoff_id)
        stage = self._stage(h, msg.pp_rank)
        self._check_sender(h, msg.pp_rank, stage, msg)
        self._confirm_stopped(h, stage)
        if stage.state.final:
            return
        stage.state = advance(stage.state, StageState.FAILED, f"handoff {h.id!r} stage")
        self._fail(h, msg.code, f"stage {msg.pp_rank}: {msg.reason}", msg.pp_rank, msg.context)

    def peer_lost(self, url: str, reason: str) -> list[str]:
        """A prefill service went silent or refuses connections: fail every handoff that waits
        on one of its stages. Its writers are not confirmed stopped: their pages stay leased
        until the bound passes (or the peer answers an abort after all)."""
        self._lost_peers.put(url, self._clock())
        self._layouts.pop(url)  # a restarted process registers memory at new addresses
        return self._fail_peer_stages(url, f"prefill peer {url}", reason)

    def peer_back(self, url: str) -> None:
        self._lost_peers.pop(url)

    def reconcile(self, url: str, ack: HeartbeatAck, sent: list[str]) -> list[str]:
        """A heartbeat answer from prefill `url`: a stage bound to another life of it fails (the
        process restarted), and a handoff listed in `sent` (delivered before the ping) that the
        peer no longer runs fails at once. Returns the failed handoff ids."""
        victims = set(
            self._fail_peer_stages(
                url,
                f"prefill peer {url}",
                f"restarted (incarnation {ack.incarnation})",
                only=lambda s: s.incarnation != ack.incarnation,
            )
        )
        theirs = set(ack.live)
        for hid in sent:
            h = self.handoffs.get(hid)
            if h is None or hid in theirs:
                continue
            gone = [
                r
                for r, s in h.stages.items()
                if s.peer == url and s.delivered and s.incarnation == ack.incarnation
            ]
            for r in gone:
                # The peer ended its work on it: its task drained before it forgot the handoff.
                self._confirm_stopped(h, h.stages[r])
            waiting = [r for r in gone if not h.stages[r].state.final]
            if waiting and not h.state.terminal:
                victims.add(hid)
                self._mark_failed(h, waiting)
                self._fail(
                    h,
                    PeerUnreachable.code,
                    f"prefill peer {url} (stage{'s' if len(waiting) > 1 else ''} "
                    f"{', '.join(map(str, waiting))}) no longer has this handoff",
                    waiting[0],
                    {"peer": url},
                )
        return sorted(victims)

    def live_by_prefill(self) -> dict[str, list[str]]:
        """Whom the heartbeats must ping (every prefill with an unreleased handoff) and, per
        peer, the handoffs it has accepted the destination of (what the answer is checked
        against)."""
        out: dict[str, list[str]] = {}
        for h in self.handoffs.values():
            if h.release == ReleaseState.RELEASED:
                continue
            for peer in h.peers:
                ids = out.setdefault(peer, [])
                if all(s.delivered for s in h.stages.values() if s.peer == peer):
                    ids.append(h.id)
        return out

    def adopt(self, archive: HandoffArchive, fenced: Iterable[FencedPages]) -> None:
        """After a restart (call before serving): answer for ids this process does not hold from
        `archive`, and keep each `fenced` handoff's pages leased until its `release_at`, so no
        new handoff gets pages an earlier process's prefill stages may still write."""
        self._archive = archive
        loop = asyncio.get_running_loop()
        for f in fenced:
            self._fenced_until[f.handoff_id] = f.release_at
            delay = f.release_at - self._clock()
            if delay <= 0:
                self._release_restored(f.handoff_id, leased=False)
                continue
            try:
                pages = validate_pages_for_layout(
                    self.layout, f.dst_pages, f.dst_slot, side="destination", unique=True
                )
                self.leases.acquire(f.handoff_id, pages, f.dst_slot if self.layout.state else None)
            except InvalidInput as exc:  # the pool shrank between runs: nothing there to fence
                log.warning("not fencing pages of restored handoff %s: %s", f.handoff_id, exc)
                self._release_restored(f.handoff_id, leased=False)
                continue
            self._fence_timers.append(
                loop.call_later(delay, self._release_restored, f.handoff_id, True)
            )

    def _release_restored(self, handoff_id: str, leased: bool) -> None:
        """The bound of an earlier life's handoff passed: free its pages and say so, like any
        release (`handoff.released`, unconfirmed), so the record, webhooks and SSE readers see it
        and a later restart does not fence these pages again."""
        if leased:
            self.leases.release(handoff_id)
        old = self._archive.find(handoff_id) if self._archive is not None else None
        if old is None:
            return
        now = self._clock()
        self._bus.publish(
            HandoffReleased(
                handoff_id=handoff_id,
                role=ROLE,
                outcome=old.view.state.value,
                confirmed=False,
                seconds_after_outcome=max(0.0, now - (old.view.finished_at or now)),
                metadata=old.request.metadata,
            )
        )

    def live_with(self, url: str) -> list[str]:
        """Every unreleased handoff with a stage on prefill `url` (a heartbeat answer)."""
        return [
            h.id
            for h in self.handoffs.values()
            if h.release != ReleaseState.RELEASED and any(s.peer == url for s in h.stages.values())
        ]

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
        unreleased, keeps the pages fenced if the service starts again on them."""
        live = [h.id for h in self.handoffs.values() if not h.state.terminal]
        aborts = asyncio.gather(
            *(self.abort(hid, "decode service shutting down") for hid in live),
            return_exceptions=True,
        )
        try:
            async with asyncio.timeout(timeout_s):
                outcomes = await asyncio.shield(aborts)
                for hid, outcome in zip(live, outcomes):
                    if isinstance(outcome, BaseException):
                        log.warning("abort of %s on shutdown failed: %r", hid, outcome)
                quiescing = [h.quiesce for h in self.handoffs.values() if h.quiesce is not None]
                await asyncio.shield(asyncio.gather(*quiescing, return_exceptions=True))
        except TimeoutError:
            unreleased = [
                h.id for h in self.handoffs.values() if h.release != ReleaseState.RELEASED
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
        for timer in self._fence_timers:
            timer.cancel()

    # ----------------------------------------------------------------- checks

    def _check_sender(
        self, h: DecodeHandoff, rank: int, stage: _Stage, msg: ArrivalMsg | StageFailedMsg
    ) -> None:
        check_sender(h.id, rank, stage.peer, stage.incarnation, self.incarnation, msg)
        stage.max_call_s = max(stage.max_call_s, msg.max_call_s)

    def _check_accounting(self, h: DecodeHandoff, msg: ArrivalMsg) -> None:
        pairing = self.cache.get(h.stages[msg.pp_rank].layout, self.layout)
        check_accounting(pairing, h.dst_pages, h.request.dst_slot, msg)

    # ----------------------------------------------------------------- internals

    def _existing(self, req: HandoffRequest) -> HandoffView | None:
        h = self.handoffs.get(req.id)
        if h is not None:
            found: ArchivedHandoff | None = ArchivedHandoff(h.request, h.view())
        else:
            found = self._archive.find(req.id) if self._archive is not None else None
        if found is None:
            return None
        if found.request != req:
            raise ConflictError(
                f"handoff {req.id!r} exists with a different request body", field="id"
            )
        return found.view

    def _archived(self, handoff_id: str) -> HandoffView:
        old = self._archive.find(handoff_id) if self._archive is not None else None
        if old is None:
            raise NotFoundError(f"no handoff {handoff_id!r}", field="id")
        view = old.view
        if not view.released:
            # Recorded before its release: released once the fence of the restart has passed
            # (or at once when it was not fenced: its bound had passed before this life began).
            until = self._fenced_until.get(handoff_id)
            if until is None or self._clock() >= until:
                view = msgspec.structs.replace(view, released=True, released_at=until)
        return view

    def _get(self, handoff_id: str) -> DecodeHandoff:
        h = self.handoffs.get(handoff_id)
        if h is None:
            raise NotFoundError(f"no handoff {handoff_id!r}", field="id")
        return h

    def _stage(self, h: DecodeHandoff, rank: int) -> _Stage:
        stage = h.stages.get(rank)
        if stage is None:
            raise InvalidInput(
                f"handoff {h.id!r} has no stage {rank}", field="pp_rank", pp_rank=rank
            )
        return stage

    async def _stages_of(self, urls: list[str]) -> dict[int, tuple[str, LayoutInfo, StageLayout]]:
        """Fetch (cached) layouts of the prefill peers, check they form one PP instance and
        pair with this decode layout. Raises before anything is leased or sent."""
        stages: dict[int, tuple[str, LayoutInfo, StageLayout]] = {}
        index: dict[str, int] = {}  # each URL once, with the position it is first named at
        for i, url in enumerate(urls):
            index.setdefault(url, i)
        for url, i in index.items():
            info = self._layouts.get(url)
            if info is None:
                try:
                    info = await self._prefill.layout(url)
                except KVHandoffError as exc:
                    exc.context.setdefault("field", f"prefill[{i}]")
                    raise
                self._layouts.put(url, info)
                self._lost_peers.pop(url)  # it answered: no longer lost
            if info.role != "prefill":
                raise InvalidInput(f"{url} is a {info.role} service", field=f"prefill[{i}]")
            if info.max_call_s > self._max_grace_s:
                raise InvalidInput(
                    f"{url} declares engine calls of up to {info.max_call_s:g} s, more than this "
                    f"decode waits for a silent writer (handoff.max_grace_s = "
                    f"{self._max_grace_s:g})",
                    field=f"prefill[{i}]",
                )
            for st in info.stages:
                rank = st.layout.pp_rank
                if rank in stages:
                    raise InvalidInput(
                        f"stage {rank} is hosted by both {stages[rank][0]} and {url}",
                        field=f"prefill[{i}]",
                        pp_rank=rank,
                    )
                stages[rank] = (url, info, st.layout)
        sizes = {layout.pp_size for _, _, layout in stages.values()}
        if len(sizes) != 1 or sorted(stages) != list(range(next(iter(sizes)))):
            size = max(sizes) if sizes else 0
            missing = sorted(set(range(size)) - set(stages))
            raise InvalidInput(
                f"the prefill services host stages {sorted(stages)} of pp_size {sorted(sizes)}; "
                f"missing stages {missing}",
                field="prefill",
                pp_rank=missing[0] if missing else None,
            )
        for _, _, layout in stages.values():
            self.cache.get(layout, self.layout)  # PairingError names layer, group or kind
        self._check_coverage([layout for _, _, layout in stages.values()])
        return stages

    def _check_coverage(self, layouts: list[StageLayout]) -> None:
        """Together the stages must write every decode entry exactly once (cached per set)."""
        key = tuple(sorted((x.pp_rank, x.fingerprint, x.address_key) for x in layouts))
        if key in self._covered:
            return
        report = pairing_report(layouts, self.layout)
        if not report.ok:
            raise PairingError(list(report.problems))
        self._covered.add(key)

    def _spawn(self, coro: Any) -> asyncio.Task[None]:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def _stop(self, h: DecodeHandoff, reason: str) -> asyncio.Task[None] | None:
        """The one quiesce of `h` (started with its first failure or abort; none once it is
        released)."""
        if h.quiesce is None and h.release == ReleaseState.HELD:
            h.release = advance(h.release, ReleaseState.RELEASING, f"handoff {h.id!r} lease")
            h.quiesce = self._spawn(self._quiesce(h, reason))
        return h.quiesce

    async def _deliver(self, h: DecodeHandoff) -> None:
        by_peer: dict[str, list[int]] = {}
        for rank, st in h.stages.items():
            by_peer.setdefault(st.peer, []).append(rank)

        async def one(peer: str, ranks: list[int]) -> None:
            msg = DestinationMsg(
                handoff_id=h.id,
                decode_url=self.url,
                decode_incarnation=self.incarnation,
                prefill_incarnation=h.stages[ranks[0]].incarnation,
                decode_target=self.target,
                decode_fingerprint=self.layout.fingerprint,
                decode_address_key=self.layout.address_key,
                pp_ranks=sorted(ranks),
                dst_pages=h.request.dst_pages,
                dst_slot=h.request.dst_slot,
                deadline_in_s=max(0.0, h.deadline_mono - self._monotonic()),
                verify=h.verify,
            )
            try:
                await self._prefill.deliver(peer, msg)
            except KVHandoffError as exc:
                exc.context.setdefault("peer", peer)
                exc.context.setdefault("pp_ranks", sorted(ranks))
                raise
            for rank in ranks:
                h.stages[rank].delivered = True

        failure: KVHandoffError | None = None
        try:
            async with asyncio.TaskGroup() as tg:
                for peer, ranks in by_peer.items():
                    tg.create_task(one(peer, ranks))
        except* KVHandoffError as group:
            failure = group.exceptions[0]  # type: ignore[assignment]
        if failure is not None:
            peer = str(failure.context.get("peer"))
            ranks = sorted(by_peer.get(peer, []))
            # The peer may have restarted with other stages: fetch its layouts afresh next time.
            for url in by_peer:
                self._layouts.pop(url)
            self._mark_failed(h, ranks)
            self._fail(
                h,
                failure.code,
                f"delivering the destination to {peer} (stage{'s' if len(ranks) > 1 else ''} "
                f"{', '.join(map(str, ranks))}) failed: {failure.message}",
                ranks[0] if ranks else None,
                failure.context,
            )
        elif h.state == HandoffState.PENDING:
            h.state = advance(h.state, HandoffState.TRANSFERRING, f"handoff {h.id!r}")

    async def _verify_then_complete(self, h: DecodeHandoff) -> None:
        problem = await asyncio.to_thread(self._verify, h)
        if h.state.terminal:
            return  # a deadline or an abort came first
        if problem is not None:
            reason, rank, ctx = problem
            self._mark_failed(h, [rank])
            self._fail(h, "verification_failed", reason, rank, ctx)
            return
        h.verification = "passed"
        self._complete(h, verified=True)

    def _verify(self, h: DecodeHandoff) -> tuple[str, int, dict[str, Any]] | None:
        assert self._memory is not None
        digests = {rank: st.digests for rank, st in h.stages.items()}
        return first_mismatch(self.layout, self._memory, digests, h.dst_pages, h.request.dst_slot)

    def _complete(self, h: DecodeHandoff, *, verified: bool = False) -> None:
        self._finish(h, HandoffState.COMPLETED)
        self._publish(
            h,
            HandoffCompleted(
                handoff_id=h.id,
                role=ROLE,
                bytes=sum(s.bytes for s in h.stages.values()),
                seconds=(h.finished_at or 0.0) - h.created_at,
                verified=verified,
                metadata=h.request.metadata,
            ),
        )
        self._release(h, confirmed=True)  # every stage arrived: nothing of it can still land

    def _finish(self, h: DecodeHandoff, state: HandoffState) -> None:
        """Record the outcome (once: the table refuses a second)."""
        h.state = advance(h.state, state, f"handoff {h.id!r}")
        h.finished_at = self._clock()
        h.done.set()
        self._live -= 1
        if h.timer is not None:
            h.timer.cancel()

    def _release(self, h: DecodeHandoff, *, confirmed: bool) -> None:
        """The one place a lease is given back: after the outcome, once no write can land."""
        assert h.state.terminal, "a lease is released only after the outcome"
        h.release = advance(h.release, ReleaseState.RELEASED, f"handoff {h.id!r} lease")
        self.leases.release(h.id)
        h.released_at = self._clock()
        for st in h.stages.values():
            if not st.state.final:
                st.state = advance(st.state, StageState.STOPPED, f"handoff {h.id!r} stage")
        h.released.set()
        self._publish(
            h,
            HandoffReleased(
                handoff_id=h.id,
                role=ROLE,
                outcome=h.state.value,
                confirmed=confirmed,
                seconds_after_outcome=h.released_at - (h.finished_at or h.released_at),
                metadata=h.request.metadata,
            ),
        )

    def _fail(
        self,
        h: DecodeHandoff,
        code: str,
        reason: str,
        pp_rank: int | None,
        context: dict[str, Any],
    ) -> None:
        if h.state.terminal:
            return  # the first outcome stands (e.g. an abort that reached the prefill first)
        self._finish(h, HandoffState.FAILED)
        h.error = ErrorView(code=code, reason=reason, pp_rank=pp_rank, context=context)
        self._publish(
            h,
            HandoffFailed(
                handoff_id=h.id,
                role=ROLE,
                code=code,
                reason=reason,
                pp_rank=pp_rank,
                context=context,
                metadata=h.request.metadata,
            ),
        )
        self._stop(h, f"handoff failed: {reason}")

    def _mark_failed(self, h: DecodeHandoff, ranks: list[int]) -> None:
        for r in ranks:
            st = h.stages[r]
            if st.state != StageState.FAILED and StageState.FAILED in TRANSITIONS[st.state]:
                st.state = advance(st.state, StageState.FAILED, f"handoff {h.id!r} stage {r}")

    def _confirm_stopped(self, h: DecodeHandoff, stage: _Stage) -> None:
        if not stage.stopped:
            stage.stopped = True
            h.progress.set()

    def _fail_peer_stages(
        self,
        url: str,
        who: str,
        reason: str,
        only: Callable[[_Stage], bool] = lambda s: True,
    ) -> list[str]:
        victims = []
        for h in list(self.handoffs.values()):
            if h.release == ReleaseState.RELEASED:
                continue
            ranks = [
                r
                for r, s in sorted(h.stages.items())
                if s.peer == url and not s.state.final and only(s)
            ]
            if not ranks:
                continue
            h.progress.set()  # a quiesce retrying this peer reconsiders now
            self._mark_failed(h, ranks)
            if not h.state.terminal:
                victims.append(h.id)
                self._fail(
                    h,
                    PeerUnreachable.code,
                    f"{who} (stage{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}) "
                    f"{reason}",
                    ranks[0],
                    {"peer": url},
                )
        return victims

    def _expire(self, h: DecodeHandoff) -> None:
        if not h.state.terminal:
            err = DeadlineExceeded("")
            waiting = sorted(r for r, s in h.stages.items() if not s.state.final)
            self._mark_failed(h, waiting)
            self._fail(
                h,
                err.code,
                f"deadline of {h.deadline_at - h.created_at:.3g} s passed with stages "
                f"{waiting} still to arrive",
                waiting[0] if waiting else None,
                {},
            )

    def _grace_s(self, h: DecodeHandoff) -> float:
        """How long after the deadline an unconfirmed writer may still write: the longest
        engine call its prefill declared (none declared: the ceiling), at most the ceiling."""
        declared = [s.max_call_s for s in h.stages.values() if not s.stopped]
        longest = max(declared, default=0.0)
        return self._max_grace_s if longest <= 0 else min(longest, self._max_grace_s)

    async def _quiesce(self, h: DecodeHandoff, reason: str) -> None:
        """Stop every prefill stage of `h` that may still write, then release its lease.

        A peer that cannot be reached is retried (at once when `abort` hurries it) until it
        answers, is declared lost, or the bound passed. Without its answer the lease is kept
        until the bound: the deadline (after which no prefill batch starts: the prefill measures
        the deadline as a remaining duration from its receipt, so its own comes no later) plus
        the longest engine call the prefill declared. A process the heartbeats cannot hear (a
        stalled loop, a partitioned control network beside a working data one) may still write
        until then. Cancelled (the event loop ends), the lease is never released.
        """
        give_up = max(h.deadline_mono, self._monotonic()) + self._grace_s(h)

        async def stop(peer: str) -> None:
            delay = 0.05
            while not all(s.stopped for s in h.stages.values() if s.peer == peer):
                try:
                    # Past the bound the pages are free whatever the peer says: stop waiting.
                    async with asyncio.timeout(max(0.0, give_up - self._monotonic())):
                        ack = await self._prefill.abort(
                            peer,
                            AbortMsg(
                                handoff_id=h.id, reason=reason, decode_incarnation=self.incarnation
                            ),
                        )
                except TimeoutError:
                    log.warning("handoff %s: %s did not answer the abort by the bound", h.id, peer)
                    return
                except KVHandoffError as exc:
                    if peer in self._lost_peers or self._monotonic() >= give_up:
                        log.warning("handoff %s: not waiting for %s any more: %s", h.id, peer, exc)
                        return
                    h.progress.clear()
                    with contextlib.suppress(TimeoutError):
                        async with asyncio.timeout(delay):
                            await h.progress.wait()
                    delay = min(delay * 2, 1.0)
                    continue
                for st in h.stages.values():
                    if st.peer == peer and st.incarnation == ack.incarnation:
                        st.max_call_s = max(st.max_call_s, ack.max_call_s)
                        self._confirm_stopped(h, st)
                if not all(s.stopped for s in h.stages.values() if s.peer == peer):
                    return  # another life answered: the old one is not confirmed stopped

        await asyncio.gather(*(stop(p) for p in h.peers))
        while not all(s.stopped for s in h.stages.values()):
            left = give_up - self._monotonic()
            if left <= 0:
                break
            h.progress.clear()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(left):
                    await h.progress.wait()
        self._release(h, confirmed=all(s.stopped for s in h.stages.values()))

    def _publish(self, h: DecodeHandoff, event: Event) -> None:
        h.timeline.append(self._bus.publish(event))

    def _evict(self) -> None:
        """Forget the oldest released handoffs beyond the history limit."""
        excess = len(self.handoffs) - self._history
        if excess > 0:
            # islice: stop at the few needed (dicts keep creation order, oldest first).
            for handoff_id in list(itertools.islice(self._oldest_released(), excess)):
                del self.handoffs[handoff_id]

    def _oldest_released(self) -> Iterator[str]:
        for h in self.handoffs.values():
            if h.release == ReleaseState.RELEASED:
                yield h.id
