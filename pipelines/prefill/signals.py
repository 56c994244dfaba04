"""The steps of an engine's ready signal (`PrefillPipeline.ready`), each a check that changes
nothing or the one change a signal makes: its stage's input, opened once and then fed.

A signal is checked whole before anything changes: the stage is hosted here, its layers are
the stage's, its pages and slots are the stage's first (validated against the stage's layout)
or the same as before. Only then is the handoff opened (or bound to its decode) and the signal
queued for the stage worker (`stage.py`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Collection, Mapping

import numpy as np

from kvhandoff.pipelines.errors import ConflictError, InvalidInput, NotFoundError
from kvhandoff.pipelines.planning import validate_pages_for_layout
from kvhandoff.pipelines.prefill.handoff import (
    I64,
    HostedStage,
    PrefillHandoff,
    ReadySignal,
    StageInput,
)
from kvhandoff.pipelines.slots import RequestSlots
from kvhandoff.pipelines.states import StageState


def hosted_stage(stages: Mapping[int, HostedStage], pp_rank: int) -> HostedStage:
    """The stage a signal names, if this process hosts it."""
    stage = stages.get(pp_rank)
    if stage is None:
        raise NotFoundError(
            f"stage {pp_rank} is not hosted here (hosted: {sorted(stages)})",
            field="pp_rank",
            pp_rank=pp_rank,
        )
    return stage


def stage_layers(
    stage: HostedStage, pp_rank: int, layers: Collection[int] | None
) -> frozenset[int] | None:
    """The layers a by-layer signal names (None: all), each a layer of the stage."""
    if layers is None:
        return None
    layer_set = frozenset(int(x) for x in layers)
    own = {e.layer_id for e in stage.layout.kv} | {s.layer_id for s in stage.layout.state}
    foreign = sorted(layer_set - own)
    if foreign:
        raise InvalidInput(
            f"layer {foreign[0]} is not a layer of stage {pp_rank}",
            field="layers",
            layer_id=foreign[0],
            pp_rank=pp_rank,
        )
    return layer_set


def layer_pages(
    handoff_id: str,
    pp_rank: int,
    stage: HostedStage,
    current: StageInput | None,
    src_pages: Collection[int] | I64 | None,
    slots: RequestSlots,
) -> I64:
    """A by-layer signal's source pages: required and validated on the stage's first signal,
    the same as before (or left out) on later ones."""
    if current is not None and current.ranged:
        raise InvalidInput(
            f"stage {pp_rank} of handoff {handoff_id!r} is signalled by page range: "
            "give pages_from",
            field="pages_from",
            pp_rank=pp_rank,
        )
    if current is None:
        if src_pages is None:
            raise InvalidInput(
                "src_pages is required on a stage's first ready signal", field="src_pages"
            )
        return validate_pages_for_layout(
            stage.layout, np.asarray(src_pages), slots, side="source", unique=False
        )
    if src_pages is not None and not np.array_equal(np.asarray(src_pages), current.src_pages):
        raise ConflictError(
            f"stage {pp_rank} of handoff {handoff_id!r} already reported other src_pages",
            field="src_pages",
            pp_rank=pp_rank,
        )
    if not slots.empty and slots != current.src_slots:
        raise ConflictError(
            f"stage {pp_rank} of handoff {handoff_id!r} already reported other slots "
            f"({current.src_slots})",
            field="src_slot",
            pp_rank=pp_rank,
        )
    return current.src_pages


def stage_input(
    h: PrefillHandoff, pp_rank: int, current: StageInput | None, new: Callable[[], StageInput]
) -> StageInput:
    """The stage's input, opened (`new()`) by its first signal, which makes the stage ready."""
    if current is not None:
        return current
    current = new()
    h.inputs[pp_rank] = current
    if h.stage_state.get(pp_rank, StageState.WAITING) == StageState.WAITING:
        h.set_stage(pp_rank, StageState.READY)
    h.input_seen.setdefault(pp_rank, asyncio.Event()).set()
    return current


def queue_signal(
    handoff_id: str, pp_rank: int, current: StageInput, signal: ReadySignal, field: str
) -> None:
    """Queue `signal` for the stage worker; a stage whose queue is full is refused."""
    try:
        current.signals.put_nowait(signal)
    except asyncio.QueueFull:
        raise ConflictError(
            f"stage {pp_rank} of handoff {handoff_id!r} has too many pending ready signals",
            field=field,
        ) from None
