"""The decode side of a handoff: create, deliver destinations, aggregate arrivals, finish.

Called by the service's router-facing routes (`create`, `get`, `list`, `abort`), its peer routes
(`arrived`, `stage_failed`) and its heartbeat task (`peer_lost`). A handoff is created here with
its destination; every check that can fail (pages, fencing, prefill layouts, pairing) runs before
the destination is sent, so a rejected handoff never moves a byte. Terminal states are final, and
the pages' lease is held until no write of the handoff can still land.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Annotated, Any, Protocol

import msgspec
import numpy as np
import numpy.typing as npt
from msgspec import Meta, Struct

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
    StageArrived,
)
from pipelines.layout import StageLayout
from pipelines.leases import Leases
from pipelines.memory import EntryMemory, destination_digests
from pipelines.messages import (
    AbortAck,
    AbortMsg,
    ArrivalMsg,
    DestinationMsg,
    LayoutInfo,
    StageFailedMsg,
)
from pipelines.pairing import PairingCache, pairing_report
from pipelines.planning import validate_pages_for_layout

log = logging.getLogger(__name__)
I64 = npt.NDArray[np.int64]
ROLE = "decode"

#: A handoff id is a URL path segment (`/v1/handoffs/{id}`): no "/", and not "." or "..",
#: which standard clients resolve away (RFC 3986 dot-segments). No lookahead: JSON Schema users.
HANDOFF_ID_PATTERN = (
    r"^(?:[A-Za-z0-9._:@-]{3,256}|[A-Za-z0-9_:@-][A-Za-z0-9._:@-]?|\.[A-Za-z0-9_:@-])$"
)
HandoffId = Annotated[str, Meta(min_length=1, max_length=256, pattern=HANDOFF_ID_PATTERN)]


class HandoffState(StrEnum):
    PENDING = "pending"
    TRANSFERRING = "transferring"
    COMPLETED = "completed"
    FAILED = "failed"
    ABORTED = "aborted"

    @property
    def terminal(self) -> bool:
        return self in (HandoffState.COMPLETED, HandoffState.FAILED, HandoffState.ABORTED)


class HandoffRequest(Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Router → decode: move one request's KV cache and state into these decode pages."""

    id: HandoffId  # the router's request id
    # Base URLs of the prefill services hosting the request's PP stages (together, every stage
    # once); empty: the decode service's configured `peers.prefill`.
    prefill: list[Annotated[str, Meta(pattern=r"^https?://")]] = []
    dst_pages: list[Annotated[int, Meta(ge=0)]]
    dst_slot: Annotated[int, Meta(ge=0)] | None = None
    deadline_s: Annotated[float, Meta(gt=0, le=3600)] | None = None
    verify: bool | None = None
    metadata: dict[str, Any] = {}
    #: Receives this handoff's lifecycle events as signed webhooks (the service checks the host).
    callback_url: Annotated[str, Meta(pattern=r"^https?://", max_length=2048)] | None = None


class PrefillPeer(Protocol):
    """Decode → prefill calls, implemented by the service over HTTP."""

    async def layout(self, url: str) -> LayoutInfo: ...

    async def deliver(self, url: str, msg: DestinationMsg) -> None: ...

    async def abort(self, url: str, msg: AbortMsg) -> AbortAck: ...


class StageView(Struct, frozen=True):
    pp_rank: int
    peer: str
    state: str  # "waiting", "arrived", "failed"
    bytes: int


class ErrorView(Struct, frozen=True, omit_defaults=True):
    code: str
    reason: str
    pp_rank: int | None = None
    context: dict[str, Any] = {}


class HandoffView(Struct, frozen=True, omit_defaults=True):
    id: str
    state: HandoffState
    created_at: float
    deadline_at: float
    num_pages: int
    dst_slot: int | None
    prefill: list[str]
    verify: bool
    bytes: int
    stages: list[StageView]
    finished_at: float | None = None
    error: ErrorView | None = None
    metadata: dict[str, Any] = {}
    timeline: list[Event] = []


class HandoffPage(Struct, frozen=True):
    items: list[HandoffView]
    next_cursor: int | None


class ArchivedHandoff(Struct, frozen=True):
    """A handoff this process does not hold (an earlier process's, or evicted), as recorded."""

    request: HandoffRequest
    view: HandoffView


class HandoffArchive(Protocol):
    """Where the service keeps finished handoffs (`service.runtime.records`)."""

    def find(self, handoff_id: str) -> ArchivedHandoff | None: ...


class FencedPages(Struct, frozen=True):
    """Pages and slot an earlier process leased to `handoff_id`, writable by its prefill stages
    until `release_at` (unix seconds): its deadline plus the engine's timeout."""

    handoff_id: str
    dst_pages: list[int]
    dst_slot: int | None
    release_at: float


@dataclass
class _Stage:
    peer: str
    state: str = "waiting"
    bytes: int = 0
    digests: dict[str, str] | None = None


@dataclass
class DecodeHandoff:
    request: HandoffRequest
    seq: int
    dst_pages: I64
    created_at: float
    deadline_at: float
    verify: bool
    stages: dict[int, _Stage]
    state: HandoffState = HandoffState.PENDING
    finished_at: float | None = None
    error: ErrorView | None = None
    timeline: list[Event] = field(default_factory=list)
    stopping: bool = False  # an abort or failure is quiescing the prefill side (never cleared)
    aborting: bool = False  # an abort is in progress: it, not a failure, decides the outcome
    quiesced: asyncio.Event = field(default_factory=asyncio.Event)
    timer: asyncio.TimerHandle | None = None
    quiesce: asyncio.Task[None] | None = None  # the one task stopping the prefill side
    done: asyncio.Event = field(default_factory=asyncio.Event)  # set on reaching a terminal state

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
            finished_at=self.finished_at,
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
        quiesce_grace_s: float = 10.0,
        history: int = 10000,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.layout = layout
        self.target = target
        self.url = url
        self._prefill = prefill
        self._bus = bus
        self._memory = memory
        self.cache = cache or PairingCache()
        self._default_prefill = list(default_prefill or [])
        self._max_live = max_live
        self._default_deadline_s = default_deadline_s
        self._verify_default = verify_default
        self._grace_s = quiesce_grace_s
        self._history = history
        self._clock = clock
        num_pages = min((e.num_items for e in layout.kv), default=0)
        num_slots = min((s.num_slots for s in layout.state), default=0)
        self.leases = Leases(num_pages, num_slots)
        self.handoffs: dict[str, DecodeHandoff] = {}
        self._seq = 0
        self._live = 0  # handoffs not yet terminal
        self._layouts: dict[str, LayoutInfo] = {}
        self._lost_peers: set[str] = set()
        self._covered: set[tuple[tuple[int, str, str], ...]] = set()
        self._closing = False  # shutting down: one abort attempt per peer, no grace
        self._tasks: set[asyncio.Task[None]] = set()
        self._archive: HandoffArchive | None = None
        self._fence_timers: list[asyncio.TimerHandle] = []

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
        self._seq += 1
        h = DecodeHandoff(
            request=req,
            seq=self._seq,
            dst_pages=dst_pages,
            created_at=now,
            deadline_at=now + deadline_s,
            verify=self._verify_default if req.verify is None else req.verify,
            stages={rank: _Stage(peer) for rank, (peer, _) in stages.items()},
        )
        self.handoffs[req.id] = h
        self._live += 1
        self._evict()
        loop = asyncio.get_running_loop()
        h.timer = loop.call_later(deadline_s, self._expire, h)
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
        return h.view(), True

    def get(self, handoff_id: str) -> HandoffView:
        h = self.handoffs.get(handoff_id)
        return h.view() if h is not None else self._archived(handoff_id)

    async def wait(self, handoff_id: str, timeout_s: float) -> HandoffView:
        """The handoff once terminal, or as it is after `timeout_s` (a router's long poll)."""
        if handoff_id not in self.handoffs:
            return self._archived(handoff_id)  # archived handoffs are terminal
        h = self._get(handoff_id)
        if not h.state.terminal and timeout_s > 0:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(timeout_s):
                    await h.done.wait()
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
        """Abort a live handoff; returns once no write of it can still land on decode pages."""
        h = self.handoffs.get(handoff_id)
        view = h.view() if h is not None else self._archived(handoff_id)
        if view.state == HandoffState.ABORTED:
            return view
        if h is None or h.state.terminal:
            raise ConflictError(
                f"handoff {handoff_id!r} is already {view.state.value}",
                field="id",
                state=view.state,
            )
        h.aborting = True
        # The quiesce runs as its own task: a caller that stops waiting (a timeout, a closed
        # connection) must not cut it short and free the pages while a stage may still write.
        await asyncio.shield(self._stop(h, reason))
        return h.view()

    # ----------------------------------------------------------------- peer-facing

    def arrived(self, msg: ArrivalMsg) -> None:
        h = self._get(msg.handoff_id)
        stage = self._stage(h, msg.pp_rank)
        if h.state.terminal or h.stopping or stage.state != "waiting":
            return  # late or repeated notice: terminal states never change
        stage.state, stage.bytes, stage.digests = "arrived", msg.bytes, msg.digests
        h.state = HandoffState.TRANSFERRING
        arrived = sum(1 for s in h.stages.values() if s.state == "arrived")
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
            self._complete(h)

    def stage_failed(self, msg: StageFailedMsg) -> None:
        h = self._get(msg.handoff_id)
        stage = self._stage(h, msg.pp_rank)
        if h.state.terminal:
            return
        stage.state = "failed"
        self._fail(h, msg.code, f"stage {msg.pp_rank}: {msg.reason}", msg.pp_rank, msg.context)

    def peer_lost(self, url: str, reason: str) -> list[str]:
        """A prefill service went silent: fail every live handoff that waits on it."""
        self._lost_peers.add(url)
        self._layouts.pop(url, None)  # a restarted process registers memory at new addresses
        victims = []
        for h in list(self.handoffs.values()):
            if h.state.terminal:
                continue
            ranks = [r for r, s in h.stages.items() if s.peer == url and s.state == "waiting"]
            if ranks:
                victims.append(h.id)
                self._fail(
                    h,
                    PeerUnreachable.code,
                    f"prefill peer {url} (stage{'s' if len(ranks) > 1 else ''} "
                    f"{', '.join(map(str, ranks))}) {reason}",
                    ranks[0],
                    {"peer": url},
                )
        return victims

    def peer_back(self, url: str) -> None:
        self._lost_peers.discard(url)

    def live_by_prefill(self) -> dict[str, list[str]]:
        out: dict[str, list[str]] = {}
        for h in self.handoffs.values():
            if not h.state.terminal or not h.quiesced.is_set():
                for peer in h.peers:
                    out.setdefault(peer, []).append(h.id)
        return out

    def adopt(self, archive: HandoffArchive, fenced: Iterable[FencedPages]) -> None:
        """After a restart (call before serving): answer for ids this process does not hold from
        `archive`, and keep each `fenced` handoff's pages leased until its `release_at`, so no
        new handoff gets pages an earlier process's prefill stages may still write."""
        self._archive = archive
        loop = asyncio.get_running_loop()
        for f in fenced:
            delay = f.release_at - self._clock()
            if delay <= 0:
                continue
            try:
                pages = validate_pages_for_layout(
                    self.layout, f.dst_pages, f.dst_slot, side="destination", unique=True
                )
                self.leases.acquire(f.handoff_id, pages, f.dst_slot if self.layout.state else None)
            except KVHandoffError as exc:  # the pool shrank between runs: nothing there to fence
                log.warning("not fencing pages of restored handoff %s: %s", f.handoff_id, exc)
                continue
            self._fence_timers.append(loop.call_later(delay, self.leases.release, f.handoff_id))

    async def close(self) -> None:
        """Abort every live handoff (so no prefill stage keeps writing into pages this service
        is about to release), then stop the background tasks."""
        self._closing = True
        live = [h.id for h in self.handoffs.values() if not h.state.terminal]
        outcomes = await asyncio.gather(
            *(self.abort(hid, "decode service shutting down") for hid in live),
            return_exceptions=True,
        )
        for hid, outcome in zip(live, outcomes):
            if isinstance(outcome, BaseException):
                log.warning("abort of %s on shutdown failed: %r", hid, outcome)
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for timer in self._fence_timers:
            timer.cancel()

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
        return old.view

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

    async def _stages_of(self, urls: list[str]) -> dict[int, tuple[str, StageLayout]]:
        """Fetch (cached) layouts of the prefill peers, check they form one PP instance and
        pair with this decode layout. Raises before anything is leased or sent."""
        stages: dict[int, tuple[str, StageLayout]] = {}
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
                self._layouts[url] = info
            if info.role != "prefill":
                raise InvalidInput(f"{url} is a {info.role} service", field=f"prefill[{i}]")
            for st in info.stages:
                rank = st.layout.pp_rank
                if rank in stages:
                    raise InvalidInput(
                        f"stage {rank} is hosted by both {stages[rank][0]} and {url}",
                        field=f"prefill[{i}]",
                        pp_rank=rank,
                    )
                stages[rank] = (url, st.layout)
        sizes = {layout.pp_size for _, layout in stages.values()}
        if len(sizes) != 1 or sorted(stages) != list(range(next(iter(sizes)))):
            size = max(sizes) if sizes else 0
            missing = sorted(set(range(size)) - set(stages))
            raise InvalidInput(
                f"the prefill services host stages {sorted(stages)} of pp_size {sorted(sizes)}; "
                f"missing stages {missing}",
                field="prefill",
                pp_rank=missing[0] if missing else None,
            )
        for _, layout in stages.values():
            self.cache.get(layout, self.layout)  # PairingError names layer, group or kind
        self._check_coverage([layout for _, layout in stages.values()])
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

    def _stop(self, h: DecodeHandoff, reason: str) -> asyncio.Task[None]:
        """The one quiesce of `h` (started on the first abort or failure)."""
        if h.quiesce is None:
            h.stopping = True
            h.quiesce = self._spawn(self._quiesce(h, reason))
        return h.quiesce

    async def _deliver(self, h: DecodeHandoff) -> None:
        by_peer: dict[str, list[int]] = {}
        for rank, st in h.stages.items():
            by_peer.setdefault(st.peer, []).append(rank)

        async def one(peer: str, ranks: list[int]) -> None:
            await self._prefill.deliver(
                peer,
                DestinationMsg(
                    handoff_id=h.id,
                    decode_url=self.url,
                    decode_target=self.target,
                    decode_fingerprint=self.layout.fingerprint,
                    decode_address_key=self.layout.address_key,
                    pp_ranks=sorted(ranks),
                    dst_pages=h.request.dst_pages,
                    dst_slot=h.request.dst_slot,
                    deadline_at=h.deadline_at,
                    verify=h.verify,
                ),
            )

        failure: KVHandoffError | None = None
        try:
            async with asyncio.TaskGroup() as tg:
                for peer, ranks in by_peer.items():
                    tg.create_task(one(peer, ranks))
        except* KVHandoffError as group:
            failure = group.exceptions[0]  # type: ignore[assignment]
        if failure is not None:
            # The peer may have restarted with other stages: fetch its layout afresh next time.
            for peer in by_peer:
                self._layouts.pop(peer, None)
            self._fail(
                h,
                failure.code,
                f"delivering the destination failed: {failure.message}",
                None,
                failure.context,
            )
        elif h.state == HandoffState.PENDING:
            h.state = HandoffState.TRANSFERRING

    def _complete(self, h: DecodeHandoff) -> None:
        verified = False
        if h.verify and self._memory is not None:
            mismatch = self._verify(h)
            if mismatch is not None:
                key, rank = mismatch
                _, layer, which = key.split(":", 2)
                ctx: dict[str, Any] = {"layer_id": int(layer)}
                ctx["kind" if key.startswith("state") else "group"] = (
                    which if key.startswith("state") else int(which)
                )
                self._fail(
                    h,
                    "verification_failed",
                    f"bytes landed for {key.replace(':', ' ', 1)} differ from what stage {rank} "
                    "sent",
                    rank,
                    ctx,
                )
                return
            verified = True
        self._finish(h, HandoffState.COMPLETED)
        self.leases.release(h.id)  # every stage arrived: nothing of it can still land
        h.quiesced.set()
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

    def _verify(self, h: DecodeHandoff) -> tuple[str, int] | None:
        assert self._memory is not None
        for rank, st in sorted(h.stages.items()):
            if st.digests is None:
                return (f"stage:{rank}:digests", rank)
            landed = destination_digests(
                self.layout, self._memory, set(st.digests), h.dst_pages, h.request.dst_slot
            )
            for key, digest in sorted(st.digests.items()):
                if landed.get(key) != digest:
                    return key, rank
        return None

    def _finish(self, h: DecodeHandoff, state: HandoffState) -> None:
        h.state = state
        h.finished_at = self._clock()
        h.done.set()
        self._live -= 1
        if h.timer is not None:
            h.timer.cancel()

    def _fail(
        self,
        h: DecodeHandoff,
        code: str,
        reason: str,
        pp_rank: int | None,
        context: dict[str, Any],
    ) -> None:
        if h.state.terminal or h.aborting:
            return  # e.g. a destination refused because the abort reached the prefill first
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

    def _expire(self, h: DecodeHandoff) -> None:
        if not h.state.terminal and not h.stopping:
            err = DeadlineExceeded("")
            waiting = sorted(r for r, s in h.stages.items() if s.state == "waiting")
            self._fail(
                h,
                err.code,
                f"deadline of {h.deadline_at - h.created_at:.3g} s passed with stages "
                f"{waiting} still to arrive",
                waiting[0] if waiting else None,
                {},
            )

    async def _quiesce(self, h: DecodeHandoff, reason: str) -> None:
        """Stop every prefill stage of `h` that may still write, then release its lease, and
        end an aborted handoff as `aborted`.

        A peer that cannot be reached is retried until it answers, is declared lost by the
        heartbeat task, or the deadline plus the grace period has passed. Without its answer,
        the lease is kept until then anyway: a prefill process the heartbeats cannot hear (a
        stalled event loop, a partitioned control network beside a working RDMA one) may still
        be writing; but its transport starts no batch after the deadline, and a started one
        ends within the engine's timeout, which `quiesce_grace_s` covers.
        """
        give_up = max(h.deadline_at, self._clock()) + self._grace_s
        unconfirmed = False

        async def stop(peer: str) -> None:
            nonlocal unconfirmed
            delay = 0.05
            while True:
                try:
                    await self._prefill.abort(peer, AbortMsg(handoff_id=h.id, reason=reason))
                    return
                except KVHandoffError as exc:
                    if peer in self._lost_peers or self._clock() >= give_up or self._closing:
                        log.warning("handoff %s: not waiting for %s any more: %s", h.id, peer, exc)
                        unconfirmed = True
                        return
                await asyncio.sleep(delay)
                delay = min(delay * 2, 1.0)

        try:
            peers = [
                p
                for p in h.peers
                if any(s.peer == p and s.state == "waiting" for s in h.stages.values())
            ]
            await asyncio.gather(*(stop(p) for p in peers))
            if unconfirmed and not self._closing:
                await asyncio.sleep(max(0.0, give_up - self._clock()))
        finally:
            self.leases.release(h.id)
            h.quiesced.set()
            if h.aborting and not h.state.terminal:
                self._finish(h, HandoffState.ABORTED)
                self._publish(
                    h,
                    HandoffAborted(
                        handoff_id=h.id, role=ROLE, reason=reason, metadata=h.request.metadata
                    ),
                )

    def _publish(self, h: DecodeHandoff, event: Event) -> None:
        h.timeline.append(self._bus.publish(event))

    def _evict(self) -> None:
        """Forget the oldest finished handoffs beyond the history limit."""
        excess = len(self.handoffs) - self._history
        if excess > 0:
            # islice: stop at the few needed (dicts keep creation order, oldest first).
            for handoff_id in list(itertools.islice(self._oldest_finished(), excess)):
                del self.handoffs[handoff_id]

    def _oldest_finished(self) -> Iterator[str]:
        for h in self.handoffs.values():
            if h.state.terminal and h.quiesced.is_set():
                yield h.id
