"""The prefill stage worker: one PP stage of one handoff, from its ready signals to its landed
bytes and the arrival notice.

Run by the lifecycle (`pipeline.py`) inside the handoff's TaskGroup, one per stage hosted here:

    emit (ready signals -> layer-tagged KV / state chunks)
      -> pair (chunks -> validated transfer plans, pairing cached per layout pair)
      -> send (plans -> bounded concurrent batch writes) -> arrival notice to the decode side

A failing stage reports itself (its rank) and raises `StageFailed` to cancel its siblings.
Cancellation never abandons a batch the engine is still writing: the sender drains its in-flight
write and quiesces the lane before re-raising.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping

import msgspec
import numpy as np

from kvhandoff.pipelines.errors import InternalError, KVHandoffError
from kvhandoff.pipelines.events import (
    ChunksEmitted,
    Event,
    EventBus,
    HandoffFailed,
    StagePaired,
    StageTransferred,
)
from kvhandoff.pipelines.memory import source_digests
from kvhandoff.pipelines.messages import ArrivalMsg, DestinationMsg, StageFailedMsg
from kvhandoff.pipelines.pairing import Pairing, PairingCache
from kvhandoff.pipelines.planning import TransferPlan, plan, slot_indices, validate_request
from kvhandoff.pipelines.prefill.handoff import (
    END,
    ROLE,
    BlockWriter,
    Chunk,
    DecodePeer,
    DecodeSide,
    End,
    HostedStage,
    PrefillHandoff,
    Sender,
    StageFailed,
    StageSource,
    Staging,
    stage_source,
)
from kvhandoff.pipelines.prefill.landed import LandedSender
from kvhandoff.pipelines.prefill.writes import write_all
from kvhandoff.pipelines.states import StageState

log = logging.getLogger(__name__)


class StageRunner:
    """Runs stages of this process's handoffs; one per prefill pipeline."""

    def __init__(
        self,
        stages: Mapping[int, HostedStage],
        writer: BlockWriter,
        decode: DecodePeer,
        bus: EventBus,
        cache: PairingCache,
        *,
        sender: Sender,
        max_blocks_per_batch: int,
        queue_depth: int,
        staging: Staging | None = None,
    ) -> None:
        self.stages = stages
        self._writer = writer
        self._decode = decode
        self._bus = bus
        self.cache = cache
        self._sender = sender
        self._max_blocks = max_blocks_per_batch  # only to report batch counts
        self._queue_depth = queue_depth
        self._landed = LandedSender(
            staging, writer, decode, bus, sender, max_blocks_per_batch=max_blocks_per_batch
        )

    def _publish(self, event: Event) -> None:
        self._bus.publish(event)

    def close(self) -> None:
        self._landed.close()

    async def report_failure(
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
            sender_url=self._sender.url,
            sender_incarnation=self._sender.incarnation,
            decode_incarnation=dest.decode_incarnation,
            max_call_s=self._sender.max_call_s,
            pp_rank=rank,
            code=error.code,
            reason=error.message,
            context=error.context,
        )
        try:
            await self._decode.stage_failed(dest.decode_url, msg)
        except KVHandoffError as exc:  # the decode side will time the handoff out on its own
            log.warning("could not report failure of %s stage %d: %s", h.handoff_id, rank, exc)

    async def run(
        self, h: PrefillHandoff, rank: int, dest: DestinationMsg, side: DecodeSide
    ) -> None:
        """Send stage `rank` of `h` to `dest` and report its arrival, or report its failure
        to the decode and raise StageFailed."""
        stage = self.stages[rank]
        try:
            await self._run(h, rank, stage, dest, side)
        except* KVHandoffError as group:
            await self.report_failure(h, dest, rank, group.exceptions[0])  # type: ignore[arg-type]
            raise StageFailed from None
        except* Exception as group:
            # A bug in this stage: report it as this stage's failure (not a sibling's), so the
            # decode side names the stage that raised.
            log.error(
                "handoff %s stage %d crashed", h.handoff_id, rank, exc_info=group.exceptions[0]
            )
            error = InternalError(f"stage {rank} crashed: {group.exceptions[0]!r}", pp_rank=rank)
            await self.report_failure(h, dest, rank, error)
            raise StageFailed from None

    async def _run(
        self,
        h: PrefillHandoff,
        rank: int,
        stage: HostedStage,
        dest: DestinationMsg,
        side: DecodeSide,
    ) -> None:
        pairing = self.cache.get(stage.layout, side.layout)
        inp = await self._source(h, rank, pairing, dest)
        h.set_stage(rank, StageState.SENDING)
        if dest.mode == "landed":
            await self._landed.send(h, rank, stage, inp, dest, pairing, side)
            # Its last segment's notice was its arrival, and the decode committed it.
            h.set_stage(rank, StageState.NOTIFYING)
            h.set_stage(rank, StageState.ARRIVED)
            return
        chunks: asyncio.Queue[Chunk | End] = asyncio.Queue(self._queue_depth)
        plans: asyncio.Queue[TransferPlan | End] = asyncio.Queue(self._queue_depth)
        async with asyncio.TaskGroup() as tg:
            tg.create_task(self._emit(h, rank, stage, inp, chunks))
            tg.create_task(self._pair(h, rank, pairing, inp, dest, chunks, plans))
            sent = tg.create_task(self._send(h, rank, dest, side.target, plans))
        h.set_stage(rank, StageState.NOTIFYING)
        await self._arrive(h, rank, stage, inp, dest, pairing, sent.result())
        h.set_stage(rank, StageState.ARRIVED)

    async def _source(
        self, h: PrefillHandoff, rank: int, pairing: Pairing, dest: DestinationMsg
    ) -> StageSource:
        """What the stage sends, once the engine's first signal (which carries the source
        pages) is in: the positions after a prefix the decode holds, checked against `dest`."""
        await h.input_seen.setdefault(rank, asyncio.Event()).wait()
        given = h.inputs[rank]
        # Each range's source pages were checked as it came, the destination's pages on
        # receipt (`destinations.check_destination`); what this stage's pairing needs of
        # its slots, here.
        if given.ranged and pairing.num_slot_rows:
            slot_indices(pairing, dest.slots, "destination")
        if given.ranged and dest.mode != "landed":
            # Direct mode plans a stage whole: its ranges are sent once the last one is in,
            # as one stage (no overlap with chunked prefill; landed mode has it).
            await given.ended_event.wait()
        inp = stage_source(given, dest, rank)
        if not inp.ranged or dest.mode != "landed":
            validate_request(pairing, inp.src_pages, dest.dst_pages, inp.src_slots, dest.slots)
        return inp

    async def _arrive(
        self,
        h: PrefillHandoff,
        rank: int,
        stage: HostedStage,
        inp: StageSource,
        dest: DestinationMsg,
        pairing: Pairing,
        sent: tuple[int, int],
    ) -> None:
        """Direct mode: tell the decode the stage's `sent` (bytes, blocks) landed, with the
        source digests when it verifies."""
        digests = None
        if dest.verify and stage.memory is not None:
            # Off the event loop: hashing a large stage takes long enough to stall heartbeats.
            digests = await asyncio.to_thread(
                source_digests,
                pairing,
                stage.memory,
                inp.src_pages,
                inp.src_slots,
                np.arange(pairing.num_kv_pairs, dtype=np.int64),
                np.arange(pairing.num_slot_rows, dtype=np.int64),
            )
        await self._decode.arrived(
            dest.decode_url,
            ArrivalMsg(
                handoff_id=h.handoff_id,
                sender_url=self._sender.url,
                sender_incarnation=self._sender.incarnation,
                decode_incarnation=dest.decode_incarnation,
                max_call_s=self._sender.max_call_s,
                pp_rank=rank,
                bytes=sent[0],
                blocks=sent[1],
                digests=digests,
            ),
        )

    async def _emit(
        self,
        h: PrefillHandoff,
        rank: int,
        stage: HostedStage,
        inp: StageSource,
        out: asyncio.Queue[Chunk | End],
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
        if stage.layout.aux:  # aux rows belong to no layer: with the stage's last layers
            await out.put(Chunk(rank, "aux", ()))
        await out.put(END)

    async def _pair(
        self,
        h: PrefillHandoff,
        rank: int,
        pairing: Pairing,
        inp: StageSource,
        dest: DestinationMsg,
        chunks: asyncio.Queue[Chunk | End],
        out: asyncio.Queue[TransferPlan | End],
    ) -> None:
        while not isinstance(chunk := await chunks.get(), End):
            if chunk.kind == "kv":
                p = plan(
                    pairing,
                    inp.src_pages,
                    dest.dst_pages,
                    inp.src_slots,
                    dest.slots,
                    layers=chunk.layers,
                    include_state=False,
                )
            elif chunk.kind == "aux":
                p = plan(pairing, [], [], inp.src_slots, dest.slots, layers=(), include_aux=True)
            else:
                p = plan(pairing, [], [], inp.src_slots, dest.slots, layers=chunk.layers)
            self._publish(
                StagePaired(
                    handoff_id=h.handoff_id,
                    role=ROLE,
                    pp_rank=rank,
                    kv_pairs=int(p.kv_rows.shape[0]),
                    state_pairs=p.slot_blocks,
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
        target: str,  # the signed layout's (`DecodeSide.target`), not the destination's
        plans: asyncio.Queue[TransferPlan | End],
    ) -> tuple[int, int]:
        total_bytes = total_blocks = 0
        # Each transfer's event waits for the next plan, so the stage's last one says `final`.
        done: StageTransferred | None = None
        while True:
            p = await plans.get()
            final = isinstance(p, End)
            if done is not None:
                self._publish(msgspec.structs.replace(done, final=final))
                done = None
            if isinstance(p, TransferPlan) and len(p):
                t0 = time.perf_counter()
                assert h.deadline_mono is not None
                await write_all(self._writer, target, p.blocks, h.deadline_mono)
                batches = -(-len(p) // self._max_blocks)
                total_bytes += p.total_bytes
                total_blocks += len(p)
                h.bytes_sent += p.total_bytes
                done = StageTransferred(
                    handoff_id=h.handoff_id,
                    role=ROLE,
                    pp_rank=rank,
                    blocks=len(p),
                    bytes=p.total_bytes,
                    batches=batches,
                    seconds=time.perf_counter() - t0,
                    final=False,
                )
            if final:
                return total_bytes, total_blocks
