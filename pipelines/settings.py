"""The two pipelines' settings, each with its defaults, written once.

`DecodeSettings` is taken by `kvhandoff.pipelines.decode.DecodePipeline`, `PrefillSettings` by
`kvhandoff.pipelines.prefill.PrefillPipeline`. The service's configuration
(`kvhandoff.service.config`) takes its defaults for the same knobs from here and builds these from
what a deployment set, so a default is never written twice (`tests/unit/test_settings.py` checks
it).
"""

from __future__ import annotations

import msgspec

from kvhandoff.transport.blocks import DEFAULT_MAX_BLOCKS_PER_BATCH

#: A handoff's deadline when its request names none (both sides: the prefill uses it until a
#: destination carries the real one).
DEFAULT_DEADLINE_S = 30.0


class DecodeSettings(msgspec.Struct, frozen=True, kw_only=True):
    default_deadline_s: float = DEFAULT_DEADLINE_S
    #: Handoffs in flight at once; a create beyond it is refused.
    max_live: int = 256
    #: A handoff's `verify` when its request leaves it unset.
    verify_default: bool = False
    #: The most a prefill may declare its engine calls run: the longest the decode waits past a
    #: deadline for a writer it cannot hear from.
    max_grace_s: float = 60.0
    #: Released handoffs kept in memory for reads, beyond which the oldest are forgotten.
    history: int = 10000


class PrefillSettings(msgspec.Struct, frozen=True, kw_only=True):
    default_deadline_s: float = DEFAULT_DEADLINE_S
    max_blocks_per_batch: int = DEFAULT_MAX_BLOCKS_PER_BATCH
    #: Bounded queues between a stage's chunking, planning and sending steps.
    queue_depth: int = 4


#: Every default, as one value each (what a constructor's `settings` defaults to).
DECODE_DEFAULTS = DecodeSettings()
PREFILL_DEFAULTS = PrefillSettings()
