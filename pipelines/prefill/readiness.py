"""What of a landed stage is ready to pack: the packer that cuts it into segments
(`stage_packer`) and the engine's ready signals folded into it (`fold_signals`), by layer or by
page range. Called by the landed sender (`landed.py`) before it cuts each segment.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvhandoff.pipelines.errors import InternalError, InvalidInput
from kvhandoff.pipelines.events import ChunksEmitted, EventBus
from kvhandoff.pipelines.messages import DestinationMsg
from kvhandoff.pipelines.pairing import Pairing
from kvhandoff.pipelines.prefill.handoff import (
    ROLE,
    HostedStage,
    PrefillHandoff,
    StageSource,
    Staging,
)
from kvhandoff.pipelines.stage_packer import StagePacker


@dataclass
class Layers:
    """A stage's layers: its KV layers, and those no by-layer signal has named yet."""

    kv: set[int]
    pending: set[int]

    @classmethod
    def of(cls, stage: HostedStage) -> Layers:
        kv = {e.layer_id for e in stage.layout.kv}
        return cls(kv, kv | {s.layer_id for s in stage.layout.state})


def stage_packer(
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


async def fold_signals(
    bus: EventBus,
    h: PrefillHandoff,
    rank: int,
    inp: StageSource,
    packer: StagePacker,
    layers: Layers,
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
        bus.publish(
            ChunksEmitted(
                handoff_id=h.handoff_id,
                role=ROLE,
                pp_rank=rank,
                kv_layers=sorted(now & layers.kv),
                state_layers=sorted(now - layers.kv),
            )
        )
