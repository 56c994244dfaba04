"""The landed sender: one stage's bytes as packed segments into granted landing windows.

Called by the stage worker (`stage.py`) for a destination in landed mode. Per segment:

    ready layers -> a window (granted with the destination, with the last segment's answer, or
    asked for) -> gather the pieces that fit it into this process's staging buffer, digesting
    them in the same pass (`staged.py`: chunk by chunk through a private chunk, never a re-read
    of the registered buffer) -> a few large transfers into the window -> the segment's notice;
    the decode commits it once the digest matches (the last notice is the stage's arrival)

Per-request work (validation, pairing) was done once per stage by the caller; a segment costs
in proportion to its own pieces. A rejected segment (its window did not match its digest) is
sent again into a fresh window, `RESENDS_PER_SEGMENT` times (the decode counts the same, per
segment); one more rejection fails the stage. The staging extent of a
segment is given back only once its transfer ended (drained on cancellation), so a copy or an
engine call never reads memory another segment already took.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from dataclasses import dataclass

import numpy as np

from kvhandoff.pipelines.awaiting import drain
from kvhandoff.pipelines.chunked import Scratch
from kvhandoff.pipelines.digest import segment_seed
from kvhandoff.pipelines.errors import (
    DeadlineExceeded,
    DigestMismatch,
    InternalError,
)
from kvhandoff.pipelines.events import EventBus, StagePaired, StageTransferred
from kvhandoff.pipelines.messages import (
    RESENDS_PER_SEGMENT,
    ArenaSpan,
    DestinationMsg,
    Grant,
    SegmentAck,
    SegmentMsg,
    WindowRequest,
)
from kvhandoff.pipelines.packing import Pieces, Side, piece_bytes, source_side
from kvhandoff.pipelines.pairing import Pairing
from kvhandoff.pipelines.prefill.handoff import (
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
from kvhandoff.pipelines.prefill.readiness import Layers, fold_signals, stage_packer
from kvhandoff.pipelines.prefill.staged import (
    BLOCK_BYTES,
    check_grant,
    gather_segment,
    staged_blocks,
)
from kvhandoff.pipelines.prefill.writes import write_all
from kvhandoff.pipelines.stage_packer import StagePacker

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
    nbytes: int  # the pieces' bytes (counted once, at the cut)


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
        self._scratch = Scratch()  # per-thread private chunks of the one-pass gathers

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
        packer = stage_packer(rank, stage, inp, dest, pairing, staging)
        assert staging is not None and stage.regions is not None  # checked by `stage_packer`
        grants: deque[Grant] = deque(g for g in dest.grants if g.pp_rank == rank)
        layers = Layers.of(stage)
        flight: deque[asyncio.Task[int]] = deque()  # segments in flight, in the order cut
        sent = 0
        last_cut = False
        try:
            while not last_cut:
                await fold_signals(self._bus, h, rank, inp, packer, layers)
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
                nbytes = self._paired(h, rank, pairing, pieces)
                # Built per segment: a stage signalled by page range grows its page array (and
                # learns its slot with the last range) while earlier segments travel.
                src = source_side(pairing, stage.regions, inp.src_pages, inp.src_slots)
                after = set(flight) if last_cut else set()
                segment = _Segment(
                    rank, pieces, grant, last_cut, src, after, arena, side.target, nbytes
                )
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
        return seg.nbytes

    def _paired(self, h: PrefillHandoff, rank: int, pairing: Pairing, pieces: Pieces) -> int:
        """Publish the pairing of a segment just cut; its byte count."""
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
        return nbytes

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
        nbytes = seg.nbytes
        # Every write goes through here: none lands outside the arena the decode published.
        check_grant(grant, seg.arena, rank, nbytes)
        t0 = time.perf_counter()
        seg_digest, blocks = await self._write(h, dest, pairing, staging, seg, grant, nbytes)
        if seg.after:
            await asyncio.gather(*seg.after)  # an earlier segment's failure fails this stage
        notice = self._notice(
            h,
            rank,
            dest,
            last=seg.last,
            grant_id=grant.grant_id,
            pieces=seg.pieces,
            nbytes=nbytes,
            blocks=blocks,
            seg_digest=seg_digest,
        )
        if seg.last:
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
                    blocks=blocks,
                    bytes=nbytes,
                    batches=-(-blocks // self._max_blocks),
                    seconds=time.perf_counter() - t0,
                    final=seg.last,
                )
            )
        return ack

    async def _write(
        self,
        h: PrefillHandoff,
        dest: DestinationMsg,
        pairing: Pairing,
        staging: Staging,
        seg: _Segment,
        grant: Grant,
        nbytes: int,
    ) -> tuple[str, int]:
        """Stage the segment (one pass: gather and digest) and write it into `grant`; its
        digest and block count once the transfer ended."""
        assert h.deadline_mono is not None
        extent = await staging.arena.take(nbytes, h.handoff_id, until_mono=h.deadline_mono)
        try:
            packed = staging.buffer[extent.offset : extent.offset + nbytes]
            # The grant, the handoff and the pieces are bound into the digest: bytes of this
            # segment cannot pass for another grant's.
            p = seg.pieces
            seed = segment_seed(
                dest.decode_incarnation,
                h.handoff_id,
                seg.rank,
                grant.grant_id,
                p.rows,
                p.starts,
                p.ends,
            )
            seg_digest = await gather_segment(
                pairing, seg.src, p, packed, dest.digest, seed, self._scratch
            )
            blocks = staged_blocks(staging.arena.addr(extent), grant.addr, nbytes)
            await write_all(self._writer, seg.target, blocks, h.deadline_mono)
        finally:
            staging.arena.give_back(extent)  # the copy and the transfer have ended
        return seg_digest, len(blocks)

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
