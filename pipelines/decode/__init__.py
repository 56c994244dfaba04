"""The decode side: a handoff's lifecycle (`pipeline`), the handoff as held (`handoff`) and as
routers and engines read it (`views`), its outcome (`outcomes`), its lease after the outcome
(`release`, `leases`), the prefill stages' layouts and lost peers (`prefill_peers`), heartbeat
answers (`heartbeats`), checks of prefill notices (`notices`), sending destinations
(`delivery`) and the landed segment exchange (`segments`, over `landing`). Imports the shared
modules of `pipelines`, never the prefill side."""

from kvhandoff.pipelines.decode.handoff import DecodeHandoff
from kvhandoff.pipelines.decode.pipeline import DecodePipeline, PrefillPeer
from kvhandoff.pipelines.states import HandoffState

__all__ = ["DecodeHandoff", "DecodePipeline", "HandoffState", "PrefillPeer"]
