"""The landed sender: one stage's bytes as packed segments into granted landing windows.

Called by the stage worker (`stage.py`) for a destination in landed mode. Per segment:

    ready layers -> a window (granted with the destination, with the last segment's answer, or
    asked for) -> gather the pieces that fit it into a private scratch buffer and digest them
    there -> copy them into this process's staging buffer -> a few large transfers into the
    window -> the segment's notice; the decode commits it once the digest matches (the last
    notice is the stage's arrival)

The digest is taken of the scratch, never of the staging buffer: that buffer is registered, and
the Mooncake handshake hands its address to any client of the port. A client writing over it
can only make the bytes sent differ from the digest (a refused segment), never choose both.

Per-request work (validation, pairing) was done once per stage by the caller; a segment costs
in proportion to its own pieces. A rejected segment (its window did not match its digest) is
sent again into a fresh window, `RESENDS_PER_SEGMENT` times (the decode counts the same, per
segment); one more rejection fails the stage. The staging extent of a
segment is given back only once its transfer ended (drained on cancellation), so a copy or an
engine call never reads memory another segment already took.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

import numpy as np

from pipelines.awaiting import drain, finish
from pipelines.digest import digest, segment_seed
from pipelines.errors import (
    ConflictError,
    DeadlineExceeded,
    DigestMismatch,
    InternalError,
    InvalidInput,
)
from pipelines.events import ChunksEmitted, EventBus, StagePaired, StageTransferred
from pipelines.messages import (
    RESENDS_PER_SEGMENT,
    ArenaSpan,
    DestinationMsg,
    Grant,
    SegmentAck,
    SegmentMsg,
    WindowRequest,
)
from pipelines.packing import (
    Pieces,
    Side,
    copy_out,
    gather,
    piece_bytes,
    settle,
    source_side,
)
from pipelines.pairing import Pairing
from pipelines.prefill.handoff import (
    ROLE,
    BlockWriter,
    DecodePeer,
    DecodeSide,
    HostedStage,
    PrefillHandoff,
    Sender,
    StageSource,
    Staging,
)
from pipelines.prefill.writes import write_all
from pipelines.stage_packer import StagePacker
from transport.blocks import Blocks

#: Segments travel in blocks of this size: Mooncake TCP's throughput peaks near 256 KiB-1 MiB
#: blocks here, and a segment of a few large blocks costs a few per-block overheads, not one
#: per page.
BLOCK_BYTES = 1 << 20
#: Below this many bytes a gather and its digest run on the event loop: a thread hop costs
#: more than the copy.
INLINE_BYTES = 256 * 1024
#: Segments of one stage in flight at once: the next is gathered and written while the last
#: one's notice and commit run, so the engine is not idle for a round trip per segment.
IN_FLIGHT = 2


@dataclass(frozen=True)
class _Segment:
    rank: int
    pieces: Pieces
    grant: Grant
    last: bool
    src: Side  # the stage's memory, pages and slot as of this segment's cut
    after: set[asyncio.Task[int]]  # the last segment's notice waits for these (earlier ones)
    arena: ArenaSpan  # the decode's published landing arena: every grant must lie inside
    target: str  # the transport target that decode life published: every write goes there


@dataclass
class _Layers:
    """A stage's layers: its KV layers, and those no by-layer signal has named yet."""

    kv: set[int]
    pending: set[int]

    @classmethod
    def of(cls, stage: HostedStage) -> _Layers:
        kv = {e.layer_id for e in stage.layout.kv}
        return cls(kv, kv | {s.layer_id for s in stage.layout.state})


async def _settle(flight: deque[asyncio.Task[int]]) -> None:
    """Leave only once no segment of this stage can still copy or write."""
    for task in flight:
        task.cancel()
    await drain(set(flight))
    for task in flight:  # the error that left first is the stage's; these are noise
        if not task.cancelled():
            task.exception()


class LandedSender:
    """Sends stages of this process's handoffs in landed mode; one per prefill pipeline."""

    def __init__(
        self,
        staging: Staging | None,
        writer: BlockWriter,
        decode: DecodePeer,
        bus: EventBus,
        sender: Sender,
        *,
        max_blocks_per_batch: int,
    ) -> None:
        self._staging = staging
        self._writer = writer
        self._decode = decode
        self._bus = bus
        self._sender = sender
        self._max_blocks = max_blocks_per_batch
        self._local = threading.local()  # per-thread scratch buffers (`_scratch`)

    def close(self) -> None:
        """The pipeline closed: drop the staging buffer (the service frees its pool next)."""
        if self._staging is not None:
            self._staging.arena.close()
        self._staging = None

    async def send(
        self,
        h: PrefillHandoff,
        rank: int,
        stage: HostedStage,
        inp: StageSource,
        dest: DestinationMsg,
        pairing: Pairing,
        side: DecodeSide,
    ) -> int:
        """Send every byte of stage `rank` as segments into windows inside `side.arena` (the
        decode's landing arena) on `side.target`; returns the stage's byte count once its last
        segment was committed (that notice was its arrival)."""
        staging, arena = self._staging, side.arena
        if arena is None:
            raise InternalError("a landed destination without an arena passed its checks")
        packer = self._packer(rank, stage, inp, dest, pairing, staging)
        assert staging is not None and stage.regions is not None  # checked by `_packer`
        grants: deque[Grant] = deque(g for g in dest.grants if g.pp_rank == rank)
        layers = _Layers.of(stage)
        flight: deque[asyncio.Task[int]] = deque()  # segments in flight, in the order cut
        sent = 0
        last_cut = False
        try:
            while not last_cut:
                await self._fold_signals(h, rank, inp, packer, layers)
                if packer.ready_bytes == 0:
                    break  # done, and the last signal brought nothing more (a zero-page end)
                grant = await self._window(h, rank, dest, packer, queued=grants)
                pieces = packer.next_segment(grant.length)
                if pieces is None:
                    raise InternalError(
                        f"a {grant.length}-byte window holds no piece of stage {rank}",
                        pp_rank=rank,
                    )
                last_cut = packer.done
                self._paired(h, rank, pairing, pieces)
                # Built per segment: a stage signalled by page range grows its page array (and
                # learns its slot with the last range) while earlier segments travel.
                src = source_side(pairing, stage.regions, inp.src_pages, inp.src_slots)
                after = set(flight) if last_cut else set()
                segment = _Segment(rank, pieces, grant, last_cut, src, after, arena, side.target)
                flight.append(
                    asyncio.ensure_future(
                        self._segment(h, dest, pairing, staging, segment, grants, packer)
                    )
                )
                # The next segment is gathered and written while this one's notice and commit
                # run; beyond IN_FLIGHT, wait for the oldest (its answer brings a window).
                while len(flight) >= IN_FLIGHT or (last_cut and flight):
                    sent += await flight.popleft()
            while flight:  # the end came with nothing to cut: every segment is committed first
                sent += await flight.popleft()
        finally:
            await _settle(flight)
        if not last_cut:
            await self._arrive_empty(h, rank, dest)
        return sent

    def _packer(
        self,
        rank: int,
        stage: HostedStage,
        inp: StageSource,
        dest: DestinationMsg,
        pairing: Pairing,
        staging: Staging | None,
    ) -> StagePacker:
        """What cuts the stage into segments, once this process can send it at all."""
        if staging is None:
            raise InvalidInput(
                "the decode asks for landed transfers, but this prefill has no staging buffer "
                "(transfer.staging_bytes = 0)",
                field="mode",
                pp_rank=rank,
            )
        if stage.regions is None:
            raise InternalError(f"stage {rank} has no memory to gather from", pp_rank=rank)
        # Every slot row's index was validated on both sides (`StageRunner.run`), so the
        # stage sends its slot rows (with the last range, by page range).
        # By page range, the stage's pages are known only as they come: the decode's count is
        # what the ranges must add up to (`make_pages_ready` refuses more, or a short last).
        n = len(dest.dst_pages) if inp.ranged else int(inp.src_pages.shape[0])
        packer = StagePacker(pairing, n, True, ranged=inp.ranged)
        if packer.largest_item > min(dest.window_bytes, staging.arena.capacity_bytes):
            raise InvalidInput(
                f"stage {rank} has a {packer.largest_item}-byte page or slot; the decode's "
                f"windows hold {dest.window_bytes} and this staging buffer "
                f"{staging.arena.capacity_bytes} bytes",
                field="window_bytes",
                pp_rank=rank,
            )
        return packer

    async def _fold_signals(
        self,
        h: PrefillHandoff,
        rank: int,
        inp: StageSource,
        packer: StagePacker,
        layers: _Layers,
    ) -> None:
        """Fold in every ready signal already queued; wait for one while nothing is ready."""
        while not inp.signals.empty() or (packer.ready_bytes == 0 and not packer.done):
            signal = await inp.signals.get()
            if signal.pages_end is not None:
                packer.make_pages_ready(signal.pages_end, last=signal.last, pp_rank=rank)
                now = (layers.kv | layers.pending) if signal.last else set(layers.kv)
            else:
                wanted = layers.pending if signal.layers is None else signal.layers
                now = layers.pending & wanted  # a new set: `pending` shrinks
                layers.pending -= now
                packer.make_ready(now)
            self._bus.publish(
                ChunksEmitted(
                    handoff_id=h.handoff_id,
                    role=ROLE,
                    pp_rank=rank,
                    kv_layers=sorted(now & layers.kv),
                    state_layers=sorted(now - layers.kv),
                )
            )

    async def _arrive_empty(self, h: PrefillHandoff, rank: int, dest: DestinationMsg) -> None:
        """Nothing left to move with a last notice (no pages and no slot here, or a last page
        range of no pages after the others were committed): the stage still arrives, and says
        so as a final transfer of no bytes (an engine adapter waits for `final`)."""
        t0 = time.perf_counter()
        h.last_notice_sent.add(rank)
        await self._decode.segment(dest.decode_url, self._notice(h, rank, dest, last=True))
        self._bus.publish(
            StageTransferred(
                handoff_id=h.handoff_id,
                role=ROLE,
                pp_rank=rank,
                blocks=0,
                bytes=0,
                batches=0,
                seconds=time.perf_counter() - t0,
                final=True,
            )
        )

    async def _segment(
        self,
        h: PrefillHandoff,
        dest: DestinationMsg,
        pairing: Pairing,
        staging: Staging,
        seg: _Segment,
        grants: deque[Grant],
        packer: StagePacker,
    ) -> int:
        """Land one segment, sending it once more into a fresh window if its digest was
        refused; its byte count once committed. The last segment's notice waits for every
        earlier one to be committed: the decode takes it as the stage's arrival."""
        rank = seg.rank
        ack = await self._land(h, rank, dest, pairing, staging, seg, seg.grant)
        for _ in range(RESENDS_PER_SEGMENT):
            if ack.committed:
                break
            retry = ack.next_grant or await self._window(h, rank, dest, packer, seg.pieces)
            ack = await self._land(h, rank, dest, pairing, staging, seg, retry)
        if not ack.committed:
            raise DigestMismatch(
                f"stage {rank}: a segment was refused {1 + RESENDS_PER_SEGMENT} times by its "
                f"digest ({ack.reason})",
                pp_rank=rank,
            )
        if ack.next_grant is not None:
            grants.append(ack.next_grant)
        return int(piece_bytes(pairing, seg.pieces).sum())

    def _paired(self, h: PrefillHandoff, rank: int, pairing: Pairing, pieces: Pieces) -> None:
        kv = int(np.count_nonzero(pieces.rows < pairing.num_kv_pairs))
        nbytes = int(piece_bytes(pairing, pieces).sum())
        self._bus.publish(
            StagePaired(
                handoff_id=h.handoff_id,
                role=ROLE,
                pp_rank=rank,
                kv_pairs=kv,
                state_pairs=len(pieces) - kv,
                blocks=-(-nbytes // BLOCK_BYTES),
                bytes=nbytes,
            )
        )

    async def _window(
        self,
        h: PrefillHandoff,
        rank: int,
        dest: DestinationMsg,
        packer: StagePacker,
        pieces: Pieces | None = None,
        queued: deque[Grant] | None = None,
    ) -> Grant:
        """A window for the next segment: one `queued` (granted with an earlier segment's ack),
        else asked for until the decode grants one (a full arena answers none: this is the
        backpressure), bounded by the handoff's deadline. A grant that comes with an ack while
        asking is taken at once: the decode counts it against this peer's share, and may grant
        nothing more until it is used."""
        assert h.deadline_mono is not None
        want = (int(piece_bytes(packer.pairing, pieces).sum()) if pieces is not None else 0) or min(
            max(packer.ready_bytes, packer.largest_item), dest.window_bytes
        )
        msg = WindowRequest(
            handoff_id=h.handoff_id,
            sender_url=self._sender.url,
            sender_incarnation=self._sender.incarnation,
            decode_incarnation=dest.decode_incarnation,
            max_call_s=self._sender.max_call_s,
            pp_rank=rank,
            bytes=max(1, want),
        )
        while True:
            if queued:
                return queued.popleft()
            if time.monotonic() >= h.deadline_mono:
                raise DeadlineExceeded(
                    f"stage {rank} waited for a landing window until its deadline"
                )
            answer = await self._decode.window(dest.decode_url, msg)
            if answer.grant is not None:
                if queued:  # both came: the other is used by the next segment
                    queued.append(answer.grant)
                    return queued.popleft()
                return answer.grant

    async def _land(
        self,
        h: PrefillHandoff,
        rank: int,
        dest: DestinationMsg,
        pairing: Pairing,
        staging: Staging,
        seg: _Segment,
        grant: Grant,
    ) -> SegmentAck:
        """Gather, digest and write one segment into `grant`; then notify the decode (the last
        segment once the segments before it were committed)."""
        assert h.deadline_mono is not None
        pieces, last, src = seg.pieces, seg.last, seg.src
        nbytes = int(piece_bytes(pairing, pieces).sum())
        # Every write goes through here: none lands outside the arena the decode published.
        check_grant(grant, seg.arena, rank, nbytes)
        t0 = time.perf_counter()
        extent = await staging.arena.take(nbytes, h.handoff_id, until_mono=h.deadline_mono)
        try:
            packed = staging.buffer[extent.offset : extent.offset + nbytes]
            # The grant, the handoff and the pieces are bound into the digest: bytes of this
            # segment cannot pass for another grant's.
            seed = segment_seed(
                dest.decode_incarnation,
                h.handoff_id,
                rank,
                grant.grant_id,
                pieces.rows,
                pieces.starts,
                pieces.ends,
            )
            args = (pairing, src, pieces, packed, dest.digest, seed)
            if nbytes <= INLINE_BYTES:
                seg_digest = self._gather_digest(*args)
            else:
                seg_digest = await finish(asyncio.to_thread(self._gather_digest, *args))
            blocks = staged_blocks(staging.arena.addr(extent), grant.addr, nbytes)
            await write_all(self._writer, seg.target, blocks, h.deadline_mono)
        finally:
            staging.arena.give_back(extent)  # the copy and the transfer have ended
        if seg.after:
            await asyncio.gather(*seg.after)  # an earlier segment's failure fails this stage
        notice = self._notice(
            h,
            rank,
            dest,
            last=last,
            grant_id=grant.grant_id,
            pieces=pieces,
            nbytes=nbytes,
            blocks=len(blocks),
            seg_digest=seg_digest,
        )
        if last:
            h.last_notice_sent.add(rank)
        ack = await self._decode.segment(dest.decode_url, notice)
        if ack.committed:
            # Published once the decode committed it: "transferred" means in its pages.
            h.bytes_sent += nbytes
            self._bus.publish(
                StageTransferred(
                    handoff_id=h.handoff_id,
                    role=ROLE,
                    pp_rank=rank,
                    blocks=len(blocks),
                    bytes=nbytes,
                    batches=-(-len(blocks) // self._max_blocks),
                    seconds=time.perf_counter() - t0,
                    final=last,
                )
            )
        return ack

    def _gather_digest(
        self, pairing: Pairing, src: Side, pieces: Pieces, packed: Any, algo: Any, seed: int
    ) -> str:
        """Gather the pieces into this thread's scratch, digest them there, then copy them into
        `packed` (their staging extent): what was digested is what this process read from its
        own pages, whatever a Mooncake client writes into the registered staging buffer."""
        nbytes = int(packed.shape[0])
        scratch = self._scratch(packed, nbytes)[:nbytes]
        gather(pairing, src, pieces, scratch)
        seg_digest = digest(scratch, algo, seed=seed)
        copy_out(scratch, 0, nbytes, packed)
        settle(packed)  # the transport reads the extent through its own engine
        return seg_digest

    def _scratch(self, like: Any, nbytes: int) -> Any:
        """This thread's scratch buffer (unregistered, on the staging buffer's device), at
        least `nbytes` long, reused by every segment the thread gathers: one gather runs start
        to end in one thread, and a fresh buffer per segment costs a page fault per page."""
        buf = getattr(self._local, "scratch", None)
        if buf is None or buf.shape[0] < nbytes:
            size = max(nbytes, BLOCK_BYTES)
            buf = (
                np.empty(size, dtype=np.uint8)
                if isinstance(like, np.ndarray)
                else like.new_empty(size)
            )
            self._local.scratch = buf
        return buf

    def _notice(
        self,
        h: PrefillHandoff,
        rank: int,
        dest: DestinationMsg,
        *,
        last: bool,
        grant_id: int = 0,
        pieces: Pieces | None = None,
        nbytes: int = 0,
        blocks: int = 0,
        seg_digest: str = "",
    ) -> SegmentMsg:
        return SegmentMsg(
            handoff_id=h.handoff_id,
            sender_url=self._sender.url,
            sender_incarnation=self._sender.incarnation,
            decode_incarnation=dest.decode_incarnation,
            max_call_s=self._sender.max_call_s,
            pp_rank=rank,
            grant_id=grant_id,
            rows=[] if pieces is None else pieces.rows.tolist(),
            starts=[] if pieces is None else pieces.starts.tolist(),
            ends=[] if pieces is None else pieces.ends.tolist(),
            bytes=nbytes,
            blocks=blocks,
            digest=seg_digest,
            last=last,
        )


def check_grant(grant: Grant, arena: ArenaSpan, rank: int, nbytes: int = 0) -> None:
    """Refuse (naming the grant) a window of another stage, or one not wholly inside the landing
    arena its decode published, or too small for `nbytes`: no destination or answer can make
    this prefill write elsewhere in the decode's memory."""
    end = arena.addr + arena.length
    if grant.pp_rank != rank:
        raise ConflictError(
            f"grant {grant.grant_id} is for stage {grant.pp_rank}, not {rank}",
            field="grants",
            pp_rank=rank,
        )
    if not (arena.addr <= grant.addr and grant.addr + max(grant.length, nbytes) <= end):
        raise ConflictError(
            f"grant {grant.grant_id} ({grant.length} bytes at {grant.addr:#x}) does not lie "
            f"inside the decode's landing arena ({arena.length} bytes at {arena.addr:#x})",
            field="grants",
            pp_rank=rank,
        )
    if nbytes > grant.length:
        raise ConflictError(
            f"grant {grant.grant_id} holds {grant.length} bytes, the segment {nbytes}",
            field="grants",
            pp_rank=rank,
        )


def staged_blocks(src_addr: int, dst_addr: int, nbytes: int) -> Blocks:
    starts = np.arange(0, nbytes, BLOCK_BYTES, dtype=np.uint64)
    lengths = np.minimum(np.uint64(nbytes) - starts, np.uint64(BLOCK_BYTES))
    return Blocks(starts + np.uint64(src_addr), starts + np.uint64(dst_addr), lengths)
