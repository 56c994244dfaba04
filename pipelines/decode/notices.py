"""What the decode side checks of a prefill's notices before it believes them.

Called by `StageNotices` (`arrivals.py`: who may speak for a stage, what an arrival
must account for) and its verification task (what the landed bytes must hash to). Each check
raises, or returns a problem, naming the stage and the field; none changes anything.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt

from kvhandoff.pipelines.errors import ConflictError, InvalidInput
from kvhandoff.pipelines.layout import StageLayout
from kvhandoff.pipelines.memory import EntryMemory, destination_digests
from kvhandoff.pipelines.messages import ArrivalMsg, SegmentMsg, StageFailedMsg, WindowRequest
from kvhandoff.pipelines.pairing import Pairing
from kvhandoff.pipelines.slots import SlotsLike

I64 = npt.NDArray[np.int64]


def check_sender(
    handoff_id: str,
    rank: int,
    peer: str,
    peer_incarnation: str,
    decode_incarnation: str,
    msg: ArrivalMsg | StageFailedMsg | SegmentMsg | WindowRequest,
) -> None:
    """Only the stage's own prefill life (`peer`, `peer_incarnation`) may speak for stage
    `rank`, and only to this decode life. Raises ConflictError naming the field."""
    if msg.decode_incarnation != decode_incarnation:
        raise ConflictError(
            f"the notice is for decode incarnation {msg.decode_incarnation}, this is "
            f"{decode_incarnation} (the decode restarted)",
            field="decode_incarnation",
            pp_rank=rank,
        )
    if msg.sender_url != peer or msg.sender_incarnation != peer_incarnation:
        raise ConflictError(
            f"stage {rank} of handoff {handoff_id!r} is assigned to {peer} (incarnation "
            f"{peer_incarnation}), not {msg.sender_url} ({msg.sender_incarnation})",
            field="sender_url" if msg.sender_url != peer else "sender_incarnation",
            pp_rank=rank,
        )


def check_accounting(pairing: Pairing, dst_pages: I64, msg: ArrivalMsg) -> None:
    """The arrival must account for exactly the bytes this destination expects of the stage,
    computed from the cached pairs and the pages (so 0 bytes never completes a stage that has
    pages) plus one row per slot row (the destination's slots were required at create), in a
    block count the pages allow. Raises InvalidInput naming `bytes` or `blocks`."""
    n = int(dst_pages.shape[0])
    expected = pairing.kv_bytes_per_page * n
    state_blocks = pairing.num_slot_rows
    if state_blocks:
        expected += pairing.slot_bytes
    if msg.bytes != expected:
        raise InvalidInput(
            f"stage {msg.pp_rank} reports {msg.bytes} bytes; this destination expects {expected}",
            field="bytes",
            pp_rank=msg.pp_rank,
            expected=expected,
        )
    # One block per pair and run of consecutive pages at least; one per pair and page at most.
    runs = 0 if n == 0 else int(np.count_nonzero(np.diff(dst_pages) != 1)) + 1
    lo = pairing.num_kv_pairs * runs + state_blocks
    hi = pairing.num_kv_pairs * n + state_blocks
    if not lo <= msg.blocks <= hi:
        raise InvalidInput(
            f"stage {msg.pp_rank} reports {msg.blocks} blocks; this destination takes {lo} to {hi}",
            field="blocks",
            pp_rank=msg.pp_rank,
        )


def first_mismatch(
    layout: StageLayout,
    memory: EntryMemory,
    digests: dict[int, dict[str, str] | None],
    dst_pages: I64,
    dst_slots: SlotsLike,
) -> tuple[str, int, dict[str, Any]] | None:
    """The first stage (by rank) whose landed bytes differ from the digests it sent, or that
    sent none: (reason, rank, context naming the layer and group/kind or the field). Reads
    decode memory: call it off the event loop."""
    for rank, sent in sorted(digests.items()):
        if sent is None:
            return (
                f"stage {rank} sent no digests to verify against (its memory is not host-readable)",
                rank,
                {"field": "digests"},
            )
        landed = destination_digests(layout, memory, set(sent), dst_pages, dst_slots)
        for key, digest in sorted(sent.items()):
            if landed.get(key) != digest:
                kind, _, where = key.partition(":")
                ctx: dict[str, Any]
                if kind == "aux":
                    ctx = {"aux": int(where)}
                else:
                    layer, which = where.split(":", 1)
                    ctx = {"layer_id": int(layer)}
                    if kind == "state":
                        ctx["kind"] = which
                    else:
                        ctx["group"] = int(which)
                return (
                    f"bytes landed for {kind} {where} differ from what stage {rank} sent",
                    rank,
                    ctx,
                )
    return None
