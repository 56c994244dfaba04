"""The prefill side of a handoff: per-stage pipelines from stage completion to landed bytes.

Called by the service's engine-facing route (`ready`), its peer routes (`deliver`, `abort`) and
its heartbeat task (`peer_lost`, `reconcile`). For each handoff, one `asyncio.TaskGroup` runs,
per PP stage hosted here, three tasks joined by bounded queues:

    emit (ready signals -> layer-tagged KV / state chunks)
      -> pair (chunks -> validated transfer plans, pairing cached per layout pair)
      -> send (plans -> bounded concurrent batch writes) -> arrival notice to the decode side

A failing stage cancels its siblings and names itself (its rank) in the failure it reports.
Cancellation (abort, deadline, lost peer) never abandons a batch the engine is still writing:
senders drain their in-flight writes before re-raising, so "quiesced" really means no write of
this handoff can still land. A destination is bound to the decode life that issued it and to this
prefill's life; its deadline is measured from its receipt on this host's monotonic clock.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Collection, Mapping
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import numpy.typing as npt

from pipelines.errors import (
    ConflictError,
    DeadlineExceeded,
    InternalError,
    InvalidInput,
    KVHandoffError,
    NotFoundError,
)
from pipelines.events import (
    ChunksEmitted,
    Event,
    EventBus,
    HandoffAborted,
    HandoffFailed,
    StagePaired,
    StageReady,
    StageTransferred,
)
from pipelines.layout import StageLayout
from pipelines.memory import EntryMemory, source_digests
from pipelines.messages import (
    AbortAck,
    ArrivalMsg,
    DestinationMsg,
    HeartbeatAck,
    StageFailedMsg,
)
from pipelines.pairing import Pairing, PairingCache
from pipelines.peercache import new_incarnation
from pipelines.planning import TransferPlan, plan, validate_pages_for_layout, validate_request
from pipelines.states import StageState, advance
from transport.blocks import Blocks

log = logging.getLogger(__name__)
I64 = npt.NDArray[np.int64]
ROLE = "prefill"


class BlockWriter(Protocol):
    """What the pipeline needs from a transport."""

    async def write(self, peer: str, blocks: Blocks, *, start_by: float | None = None) -> None: ...

    async def quiesce(self, peer: str | None = None) -> None: ...

    @property
    def max_call_s(self) -> float:
        """The longest one engine call can still write once started."""
        ...


class DecodePeer(Protocol):
    """Prefill → decode calls, implemented by the service over HTTP (or in-process)."""

    async def decode_layout(self, dest: DestinationMsg) -> StageLayout:
        """The decode layout `dest` names (its fingerprint and address key), placed."""
        ...

    async def arrived(self, decode_url: str, msg: ArrivalMsg) -> None: ...

    async def stage_failed(self, decode_url: str, msg: StageFailedMsg) -> None: ...


@dataclass(frozen=True)
class HostedStage:
    """One PP stage registered in this process: its placed layout and a view of its memory."""

    layout: StageLayout
    memory: EntryMemory | None = None


@dataclass(frozen=True)
class ReadySignal:
    layers: frozenset[int] | None  # None: every layer of the stage not sent yet


class _End:
    """Marks the end of a stage's chunk or plan stream."""


END = _End()


@dataclass(frozen=True)
class Chunk:
    """Layer-tagged work for one stage: KV pages of `layers`, or state slots of `layers`."""

    pp_rank: int
    kind: str  # "kv" or "state"
    layers: tuple[int, ...]


@dataclass
class _StageInput:
    src_pages: I64
    src_slot: int | None
    signals: asyncio.Queue[ReadySignal]


@dataclass
class PrefillHandoff:
    """One handoff as this prefill process sees it."""

    handoff_id: str
    created_at: float
    destination: asyncio.Future[DestinationMsg]
    inputs: dict[int, _StageInput] = field(default_factory=dict)
    # Set when a stage's first ready signal (which carries its source pages) arrives.
    input_seen: dict[int, asyncio.Event] = field(default_factory=dict)
    stage_state: dict[int, StageState] = field(default_factory=dict)
    task: asyncio.Task[None] | None = None
    bytes_sent: int = 0
    # The deadline on this host's monotonic clock, measured when the destination arrived.
    deadline_mono: float | None = None

    def set_stage(self, rank: int, state: StageState) -> None:
        current = self.stage_state.get(rank, StageState.WAITING)
        self.stage_state[rank] = advance(
            current, state, f"handoff {self.handoff_id!r} stage {rank}"
        )

    def settled(self, ranks: list[int]) -> bool:
        """Every stage of `ranks` has its bytes landed (its arrival notice may be on its way) or
        has ended: none can still write."""
        return all(
            self.stage_state.get(r, StageState.WAITING)
            in (StageState.NOTIFYING, StageState.ARRIVED)
            or self.stage_state.get(r, StageState.WAITING).final
            for r in ranks
        )

    @property
    def decode_url(self) -> str | None:
        return self.destination.result().decode_url if self.destination.done() else None


class _StageFailed(Exception):
    """Raised inside the TaskGroup after a stage reported its failure, to cancel siblings."""


class PrefillPipeline:
    def __init__(
        self,
        stages: Mapping[int, HostedStage],
        writer: BlockWriter,
        decode: DecodePeer,
        bus: EventBus,
        *,
        url: str = "",
        incarnation: str | None = None,
        max_call_s: float | None = None,
        cache: PairingCache | None = None,
        default_deadline_s: float = 30.0,
        max_blocks_per_batch: int = 2048,
        queue_depth: int = 4,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.stages = dict(stages)
        self.url = url  # this service's public URL: the sender of its notices
        self.incarnation = incarnation or new_incarnation()
        # The longest one engine call of this process can still write once started (the
        # transport's bound): declared to the decode side, which waits that long past the
        # deadline for a writer it cannot hear from.
        self.max_call_s = writer.max_call_s if max_call_s is None else max_call_s
        self._writer = writer
        self._decode = decode
        self._bus = bus
        self.cache = cache or PairingCache()
        self._default_deadline_s = default_deadline_s
        self._max_blocks = max_blocks_per_batch  # only to report batch counts
        self._queue_depth = queue_depth
        self._clock = clock
        self.handoffs: dict[str, PrefillHandoff] = {}
        # Recently finished ids, so a late or repeated signal is refused rather than waiting for
        # a destination that will never come.
        self._finished: OrderedDict[str, str] = OrderedDict()
        # Told the decode service of every delivered destination (the heartbeats watch it).
        self.on_peers: Callable[[list[str]], None] = lambda peers: None

    # ----------------------------------------------------------------- inputs

    def ready(
        self,
        handoff_id: str,
        pp_rank: int,
        src_pages: Collection[int] | I64 | None,
        src_slot: int | None,
        layers: Collection[int] | None = None,
    ) -> None:
        """The engine finished `layers` (None: all) of stage `pp_rank` for this request.

        The first signal of a stage must carry its source pages (and slot, for hybrid models);
        later ones may repeat them or leave them out. Raises InvalidInput / NotFoundError /
        ConflictError before anything changes.
        """
        stage = self.stages.get(pp_rank)
        if stage is None:
            raise NotFoundError(
                f"stage {pp_rank} is not hosted here (hosted: {sorted(self.stages)})",
                field="pp_rank",
                pp_rank=pp_rank,
            )
        self._refuse_finished(handoff_id)
        layer_set = None if layers is None else frozenset(int(x) for x in layers)
        if layer_set is not None:
            own = {e.layer_id for e in stage.layout.kv} | {s.layer_id for s in stage.layout.state}
            foreign = sorted(layer_set - own)
            if foreign:
                raise InvalidInput(
                    f"layer {foreign[0]} is not a layer of stage {pp_rank}",
                    field="layers",
                    layer_id=foreign[0],
                    pp_rank=pp_rank,
                )
        h = self.handoffs.get(handoff_id)
        current = h.inputs.get(pp_rank) if h else None
        if current is None:
            if src_pages is None:
                raise InvalidInput(
                    "src_pages is required on a stage's first ready signal", field="src_pages"
                )
            pages = validate_pages_for_layout(
                stage.layout, np.asarray(src_pages), src_slot, side="source", unique=False
            )
        else:
            if src_pages is not None and not np.array_equal(
                np.asarray(src_pages), current.src_pages
            ):
                raise ConflictError(
                    f"stage {pp_rank} of handoff {handoff_id!r} already reported other src_pages",
                    field="src_pages",
                    pp_rank=pp_rank,
                )
            if src_slot is not None and src_slot != current.src_slot:
                raise ConflictError(
                    f"stage {pp_rank} of handoff {handoff_id!r} already reported src_slot "
                    f"{current.src_slot}",
                    field="src_slot",
                    pp_rank=pp_rank,
                )
            pages = current.src_pages
        if h is None:
            h = self._open(handoff_id)
        if current is None:
            current = _StageInput(pages, src_slot, asyncio.Queue(len(stage.layout.kv) + 64))
            h.inputs[pp_rank] = current
            if h.stage_state.get(pp_rank, StageState.WAITING) == StageState.WAITING:
                h.set_stage(pp_rank, StageState.READY)
            h.input_seen.setdefault(pp_rank, asyncio.Event()).set()
        try:
            current.signals.put_nowait(ReadySignal(layer_set))
        except asyncio.QueueFull:
            raise ConflictError(
                f"stage {pp_rank} of handoff {handoff_id!r} has too many pending ready signals",
                field="layers",
            ) from None
        self._publish(
            StageReady(
                handoff_id=handoff_id,
                role=ROLE,
                pp_rank=pp_rank,
                num_pages=int(pages.shape[0]),
                layers=None if layer_set is None else sorted(layer_set),
            )
        )

    def deliver(self, msg: DestinationMsg) -> None:
        """The decode service says where this handoff's bytes go. Refused (changing nothing)
        when it was issued for another life of this service."""
        if msg.prefill_incarnation != self.incarnation:
            raise ConflictError(
                f"the destination of {msg.handoff_id!r} was issued for prefill incarnation "
                f"{msg.prefill_incarnation}, this is {self.incarnation} (did it restart?)",
                field="prefill_incarnation",
            )
        self._refuse_finished(msg.handoff_id)
        missing = [r for r in msg.pp_ranks if r not in self.stages]
        if missing:
            raise NotFoundError(
                f"stage {missing[0]} is not hosted here (hosted: {sorted(self.stages)})",
                field="pp_ranks",
                pp_rank=missing[0],
            )
        h = self.handoffs.get(msg.handoff_id) or self._open(msg.handoff_id)
        if h.destination.done():
            if h.destination.result() == msg:
                return  # a retried delivery
            raise ConflictError(
                f"handoff {msg.handoff_id!r} already has another destination", field="handoff_id"
            )
        h.deadline_mono = time.monotonic() + msg.deadline_in_s
        h.destination.set_result(msg)
        self.on_peers([msg.decode_url])

    async def abort(
        self, handoff_id: str, reason: str, decode_incarnation: str | None = None
    ) -> AbortAck:
        """Stop a handoff; returns once no write of it can still land. With
        `decode_incarnation`, a handoff bound to another decode life is refused."""
        h = self.handoffs.get(handoff_id)
        if h is None:
            self._remember(handoff_id, "aborted")
            return self._ack(handoff_id, [])
        dest = h.destination.result() if h.destination.done() else None
        if (
            decode_incarnation is not None
            and dest is not None
            and dest.decode_incarnation != decode_incarnation
        ):
            raise ConflictError(
                f"handoff {handoff_id!r} belongs to decode incarnation "
                f"{dest.decode_incarnation}, not {decode_incarnation}",
                field="decode_incarnation",
            )
        running = [r for r, s in h.stage_state.items() if not s.final]
        if h.task is not None:
            h.task.cancel()
            await asyncio.wait([h.task])
        for rank in running:
            if not h.stage_state[rank].final:
                h.set_stage(rank, StageState.STOPPED)
        self._close(h, "aborted")
        self._publish(HandoffAborted(handoff_id=handoff_id, role=ROLE, reason=reason))
        return self._ack(handoff_id, sorted(running))

    def _ack(self, handoff_id: str, stopped: list[int]) -> AbortAck:
        return AbortAck(
            handoff_id=handoff_id,
            quiesced=True,
            stages=stopped,
            incarnation=self.incarnation,
            max_call_s=self.max_call_s,
        )

    async def peer_lost(self, decode_url: str, reason: str) -> list[str]:
        """A decode service went silent: stop sending to it. Returns the stopped handoff ids."""
        victims = [h.handoff_id for h in self.handoffs.values() if h.decode_url == decode_url]
        for handoff_id in victims:
            await self.abort(handoff_id, reason)
        return victims

    async def reconcile(self, decode_url: str, ack: HeartbeatAck, sent: list[str]) -> list[str]:
        """A heartbeat answer from `decode_url`: stop every handoff bound to another life of it
        (it restarted: the pages we would write are no longer that handoff's), and every handoff
        in `sent` that it no longer runs while a stage here may still write. Returns their ids."""
        theirs = set(ack.live)
        victims = []
        for h in list(self.handoffs.values()):
            dest = h.destination.result() if h.destination.done() else None
            if dest is None or dest.decode_url != decode_url:
                continue
            if dest.decode_incarnation != ack.incarnation:
                victims.append((h.handoff_id, f"decode {decode_url} restarted"))
            elif (
                h.handoff_id in sent and h.handoff_id not in theirs and not h.settled(dest.pp_ranks)
            ):
                victims.append((h.handoff_id, f"decode {decode_url} no longer has it"))
        for handoff_id, why in victims:
            await self.abort(handoff_id, why)
        return [hid for hid, _ in victims]

    def live_with(self, decode_url: str) -> list[str]:
        """Handoffs bound to `decode_url` (a heartbeat answer)."""
        return self.live_by_decode().get(decode_url, [])

    def live_by_decode(self) -> dict[str, list[str]]:
        """Live handoff ids per decode URL: whom the heartbeat task must keep pinging."""
        out: dict[str, list[str]] = {}
        for h in self.handoffs.values():
            url = h.decode_url
            if url is not None:
                out.setdefault(url, []).append(h.handoff_id)
        return out

    async def close(self) -> None:
        for h in list(self.handoffs.values()):
            await self.abort(h.handoff_id, "service shutting down")

    # ----------------------------------------------------------------- internals

    def _refuse_finished(self, handoff_id: str) -> None:
        outcome = self._finished.get(handoff_id)
        if outcome is not None:
            raise ConflictError(
                f"handoff {handoff_id!r} already {outcome} on this prefill service",
                field="handoff_id",
            )

    def _open(self, handoff_id: str) -> PrefillHandoff:
        loop = asyncio.get_running_loop()
        h = PrefillHandoff(handoff_id, self._clock(), loop.create_future())
        self.handoffs[handoff_id] = h
        h.task = loop.create_task(self._run(h), name=f"prefill:{handoff_id}")
        return h

    def _remember(self, handoff_id: str, outcome: str) -> None:
        self._finished[handoff_id] = outcome
        while len(self._finished) > 65536:
            self._finished.popitem(last=False)

    def _close(self, h: PrefillHandoff, outcome: str) -> None:
        if self.handoffs.get(h.handoff_id) is h:
            del self.handoffs[h.handoff_id]
            self._remember(h.handoff_id, outcome)

    def _publish(self, event: Event) -> None:
        self._bus.publish(event)

    async def _run(self, h: PrefillHandoff) -> None:
        loop = asyncio.get_running_loop()
        # Until the destination names a deadline, the default one bounds the wait for it.
        fallback = loop.time() + self._default_deadline_s
        dest: DestinationMsg | None = None
        outcome = "failed"
        try:
            async with asyncio.timeout_at(fallback) as scope:
                dest = await h.destination
                assert h.deadline_mono is not None
                # loop.time() is the monotonic clock the deadline was measured on.
                scope.reschedule(loop.time() + max(0.0, h.deadline_mono - time.monotonic()))
                dst_layout = await self._decode.decode_layout(dest)
                async with asyncio.TaskGroup() as tg:
                    for rank in dest.pp_ranks:
                        tg.create_task(self._stage(h, rank, dest, dst_layout))
            outcome = "completed"
        except* _StageFailed:
            pass  # the failing stage already told the decode side
        except* TimeoutError:
            await self._fail_all(h, dest, DeadlineExceeded("handoff deadline passed on prefill"))
        except* KVHandoffError as group:
            await self._fail_all(h, dest, group.exceptions[0])  # type: ignore[arg-type]
        except* Exception as group:
            # must still fail the handoff on both sides instead of leaving it to the deadline.
            log.error("handoff %s crashed", h.handoff_id, exc_info=group.exceptions[0])
            await self._fail_all(h, dest, InternalError(f"prefill pipeline crashed: {group!r}"))
        finally:
            if not asyncio.current_task().cancelling():  # type: ignore[union-attr]
                self._close(h, outcome)

    async def _fail_all(
        self, h: PrefillHandoff, dest: DestinationMsg | None, error: KVHandoffError
    ) -> None:
        for rank in dest.pp_ranks if dest else sorted(h.inputs):
            if not h.stage_state.get(rank, StageState.WAITING).final:
                await self._report_failure(h, dest, rank, error)

    async def _report_failure(
        self, h: PrefillHandoff, dest: DestinationMsg | None, rank: int, error: KVHandoffError
    ) -> None:
        h.set_stage(rank, StageState.FAILED)
        error.context.setdefault("pp_rank", rank)
        self._publish(
            HandoffFailed(
                handoff_id=h.handoff_id,
                role=ROLE,
                code=error.code,
                reason=error.message,
                pp_rank=rank,
                context=error.context,
            )
        )
        if dest is None:
            return
        msg = StageFailedMsg(
            handoff_id=h.handoff_id,
            sender_url=self.url,
            sender_incarnation=self.incarnation,
            decode_incarnation=dest.decode_incarnation,
            max_call_s=self.max_call_s,
            pp_rank=rank,
            code=error.code,
            reason=error.message,
            context=error.context,
        )
        try:
            await self._decode.stage_failed(dest.decode_url, msg)
        except KVHandoffError as exc:  # the decode side will time the handoff out on its own
            log.warning("could not report failure of %s stage %d: %s", h.handoff_id, rank, exc)

    async def _stage(
        self, h: PrefillHandoff, rank: int, dest: DestinationMsg, dst_layout: StageLayout
    ) -> None:
        stage = self.stages[rank]
        try:
            pairing = self.cache.get(stage.layout, dst_layout)
            # Wait for the engine's first signal: it carries the source pages.
            await h.input_seen.setdefault(rank, asyncio.Event()).wait()
            inp = h.inputs[rank]
            validate_request(pairing, inp.src_pages, dest.dst_pages, inp.src_slot, dest.dst_slot)
            h.set_stage(rank, StageState.SENDING)
            chunks: asyncio.Queue[Chunk | _End] = asyncio.Queue(self._queue_depth)
            plans: asyncio.Queue[TransferPlan | _End] = asyncio.Queue(self._queue_depth)
            async with asyncio.TaskGroup() as tg:
                tg.create_task(self._emit(h, rank, stage, inp, chunks))
                tg.create_task(self._pair(h, rank, pairing, inp, dest, chunks, plans))
                sent = tg.create_task(self._send(h, rank, dest, plans))
            total_bytes, total_blocks = sent.result()
            h.set_stage(rank, StageState.NOTIFYING)
            digests = None
            if dest.verify and stage.memory is not None:
                # Off the event loop: hashing a large stage takes long enough to stall heartbeats.
                digests = await asyncio.to_thread(
                    source_digests,
                    pairing,
                    stage.memory,
                    inp.src_pages,
                    inp.src_slot,
                    np.arange(pairing.num_kv_pairs, dtype=np.int64),
                    np.arange(pairing.num_state_pairs, dtype=np.int64),
                )
            await self._decode.arrived(
                dest.decode_url,
                ArrivalMsg(
                    handoff_id=h.handoff_id,
                    sender_url=self.url,
                    sender_incarnation=self.incarnation,
                    decode_incarnation=dest.decode_incarnation,
                    max_call_s=self.max_call_s,
                    pp_rank=rank,
                    bytes=total_bytes,
                    blocks=total_blocks,
                    digests=digests,
                ),
            )
            h.set_stage(rank, StageState.ARRIVED)
        except* KVHandoffError as group:
            await self._report_failure(h, dest, rank, group.exceptions[0])  # type: ignore[arg-type]
            raise _StageFailed from None
        except* Exception as group:
            # A bug in this stage: report it as this stage's failure (not a sibling's), so the
            # decode side names the stage that raised.
            log.error(
                "handoff %s stage %d crashed", h.handoff_id, rank, exc_info=group.exceptions[0]
            )
            error = InternalError(f"stage {rank} crashed: {group.exceptions[0]!r}", pp_rank=rank)
            await self._report_failure(h, dest, rank, error)
            raise _StageFailed from None

    async def _emit(
        self,
        h: PrefillHandoff,
        rank: int,
        stage: HostedStage,
        inp: _StageInput,
        out: asyncio.Queue[Chunk | _End],
    ) -> None:
        kv_layers = {e.layer_id for e in stage.layout.kv}
        state_layers = {s.layer_id for s in stage.layout.state}
        pending = kv_layers | state_layers
        while pending:
            signal = await inp.signals.get()
            now = pending if signal.layers is None else pending & signal.layers
            pending = pending - now
            kv, st = sorted(now & kv_layers), sorted(now & state_layers)
            self._publish(
                ChunksEmitted(
                    handoff_id=h.handoff_id, role=ROLE, pp_rank=rank, kv_layers=kv, state_layers=st
                )
            )
            # KV first: it is the bulk, and state slots are final only when the stage is done.
            if kv:
                await out.put(Chunk(rank, "kv", tuple(kv)))
            if st:
                await out.put(Chunk(rank, "state", tuple(st)))
        await out.put(END)

    async def _pair(
        self,
        h: PrefillHandoff,
        rank: int,
        pairing: Pairing,
        inp: _StageInput,
        dest: DestinationMsg,
        chunks: asyncio.Queue[Chunk | _End],
        out: asyncio.Queue[TransferPlan | _End],
    ) -> None:
        while not isinstance(chunk := await chunks.get(), _End):
            if chunk.kind == "kv":
                p = plan(
                    pairing,
                    inp.src_pages,
                    dest.dst_pages,
                    inp.src_slot,
                    dest.dst_slot,
                    layers=chunk.layers,
                    include_state=False,
                )
            else:
                p = plan(pairing, [], [], inp.src_slot, dest.dst_slot, layers=chunk.layers)
            self._publish(
                StagePaired(
                    handoff_id=h.handoff_id,
                    role=ROLE,
                    pp_rank=rank,
                    kv_pairs=int(p.kv_rows.shape[0]),
                    state_pairs=p.state_blocks,
                    blocks=len(p),
                    bytes=p.total_bytes,
                )
            )
            await out.put(p)
        await out.put(END)

    async def _send(
        self,
        h: PrefillHandoff,
        rank: int,
        dest: DestinationMsg,
        plans: asyncio.Queue[TransferPlan | _End],
    ) -> tuple[int, int]:
        total_bytes = total_blocks = 0
        while True:
            p = await plans.get()
            final = isinstance(p, _End)
            if isinstance(p, TransferPlan) and len(p):
                t0 = time.perf_counter()
                assert h.deadline_mono is not None
                batches = await self._write_all(dest, p, h.deadline_mono)
                total_bytes += p.total_bytes
                total_blocks += len(p)
                h.bytes_sent += p.total_bytes
                self._publish(
                    StageTransferred(
                        handoff_id=h.handoff_id,
                        role=ROLE,
                        pp_rank=rank,
                        blocks=len(p),
                        bytes=p.total_bytes,
                        batches=batches,
                        seconds=time.perf_counter() - t0,
                        final=False,
                    )
                )
            if final:
                return total_bytes, total_blocks

    async def _write_all(self, dest: DestinationMsg, p: TransferPlan, start_by: float) -> int:
        """Write one plan (the transport splits it under its block cap and bounds in-flight
        batches per peer). On cancellation or error, leave only once the engine can no longer
        write anything of it: the write task is drained, then the peer's lane quiesced.

        No batch starts after the handoff's deadline, even if this loop stalls: the decode side
        relies on that to know when a stage it cannot reach any more has stopped writing."""
        target = dest.decode_target
        write = self._writer.write(target, p.blocks, start_by=start_by)
        task = asyncio.get_running_loop().create_task(write)
        try:
            await asyncio.shield(task)
        except BaseException:
            # Cancelled (abort, deadline, lost peer) or failed: make sure nothing still lands.
            task.cancel()
            await _drain({task})
            await _settle(self._writer.quiesce(target))
            raise
        return -(-len(p) // self._max_blocks)


async def _drain(tasks: set[asyncio.Task[None]]) -> None:
    """Wait until every task is done, even if this task is cancelled meanwhile; then re-raise."""
    cancelled = False
    while pending := {t for t in tasks if not t.done()}:
        try:
            await asyncio.wait(pending)
        except asyncio.CancelledError:
            cancelled = True
    if cancelled:
        raise asyncio.CancelledError


async def _settle(awaitable: Awaitable[None]) -> None:
    """Await to the end even if cancelled meanwhile; then re-raise the cancellation. A failure
    of the awaited call is raised too: the caller must not report "quiesced" on it."""
    task = asyncio.ensure_future(awaitable)
    try:
        await _drain({task})
    finally:
        if task.done() and not task.cancelled() and task.exception() is not None:
            raise task.exception()  # type: ignore[misc]
