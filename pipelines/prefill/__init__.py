"""The prefill side: the lifecycle of a handoff on the stages hosted here (`pipeline`), its
records and the protocols it needs (`handoff`), and the stage worker that moves a stage's bytes
(`stage`). Imports the shared modules of `pipelines`, never the decode side."""

from kvhandoff.pipelines.prefill.handoff import (
    BlockWriter,
    DecodePeer,
    HostedStage,
    PrefillHandoff,
    Staging,
)
from kvhandoff.pipelines.prefill.pipeline import PrefillPipeline

__all__ = [
    "BlockWriter",
    "DecodePeer",
    "HostedStage",
    "PrefillHandoff",
    "PrefillPipeline",
    "Staging",
]
