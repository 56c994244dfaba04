"""The landed segment exchange, decode side: windows asked for, segments committed or refused.

Called by `DecodePipeline.window` and `DecodePipeline.segment` (the peer routes), after the
pipeline checked who sent the notice and that its stage still takes bytes. A segment is committed
into the pages only once its digest matches (`Landing.commit`, SAFETY.md S1-S4); a mismatch is
sent again once while the handoff is live, else the handoff fails naming the stage and layers;
the last segment is the stage's arrival.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from kvhandoff.pipelines.decode.handoff import ROLE, DecodeHandoff, DecodeStage, publish
from kvhandoff.pipelines.decode.landing import Landing, Verdict
from kvhandoff.pipelines.decode.outcomes import Outcomes
from kvhandoff.pipelines.decode.release import Releases
from kvhandoff.pipelines.errors import InvalidInput
from kvhandoff.pipelines.events import EventBus, SegmentCommitted, SegmentRejected
from kvhandoff.pipelines.layout import StageLayout
from kvhandoff.pipelines.messages import SegmentAck, SegmentMsg, WindowAnswer, WindowRequest
from kvhandoff.pipelines.packing import layer_range
from kvhandoff.pipelines.pairing import PairingCache

#: A stage all of whose bytes are in place: (handoff, rank, stage, bytes) -> counted, and the
#: handoff completed with its last stage (`StageNotices.arrive`).
Arrive = Callable[[DecodeHandoff, int, DecodeStage, int], None]


class SegmentExchange:
    """Grants windows of a landed decode's arena and commits the segments written into them."""

    def __init__(
        self,
        landing: Landing,
        layout: StageLayout,
        cache: PairingCache,
        bus: EventBus,
        outcomes: Outcomes,
        releases: Releases,
        arrive: Arrive,
    ) -> None:
        self._landing = landing
        self._layout = layout
        self._cache = cache
        self._bus = bus
        self._outcomes = outcomes
        self._releases = releases
        self._arrive = arrive

    async def window(self, h: DecodeHandoff, msg: WindowRequest) -> WindowAnswer:
        """A window for stage `msg.pp_rank`'s next segment when the arena has room within a
        short wait, else none (it asks again)."""
        return WindowAnswer(grant=await self._landing.grant(h, msg.pp_rank, msg.bytes))

    async def segment(self, h: DecodeHandoff, stage: DecodeStage, msg: SegmentMsg) -> SegmentAck:
        """Commit a segment that landed in its window (see the module's docstring)."""
        t0 = time.perf_counter()
        # A stage with nothing to send (no pages, no slot) arrives with an empty last notice.
        empty = not msg.rows and msg.bytes == 0 and msg.last
        verdict = Verdict.COMMITTED if empty else await self._landing.commit(h, msg.pp_rank, msg)
        if verdict is not Verdict.COMMITTED:
            return self._rejected(h, stage, msg, resend=verdict is Verdict.REFUSED)
        if not empty:
            self._committed(h, msg, time.perf_counter() - t0)
        if not msg.last:
            return SegmentAck(committed=True, next_grant=self._landing.next_grant(h, msg.pp_rank))
        return self._last(h, stage, msg.pp_rank)

    def _rejected(
        self, h: DecodeHandoff, stage: DecodeStage, msg: SegmentMsg, *, resend: bool
    ) -> SegmentAck:
        """The window did not hash to its digest: sent again once while `h` is live, else `h`
        fails naming the stage and its layers."""
        rank = msg.pp_rank
        layers = layer_range(self._cache.get(stage.layout, self._layout), msg.rows)
        resend = resend and not h.state.terminal
        publish(
            self._bus,
            h,
            SegmentRejected(
                handoff_id=h.id,
                role=ROLE,
                pp_rank=rank,
                bytes=msg.bytes,
                layers=layers,
                resend=resend,
            ),
        )
        reason = f"the window of stage {rank} ({layers}) did not match its digest"
        if resend:
            return SegmentAck(
                committed=False, reason=reason, next_grant=self._landing.next_grant(h, rank)
            )
        if not h.state.terminal:
            self._outcomes.mark_failed(h, [rank])
            self._outcomes.fail(
                h, "digest_mismatch", reason, rank, {"layers": layers, "pp_rank": rank}
            )
        return SegmentAck(committed=False, reason=reason)

    def _committed(self, h: DecodeHandoff, msg: SegmentMsg, commit_s: float) -> None:
        rank = msg.pp_rank
        publish(
            self._bus,
            h,
            SegmentCommitted(
                handoff_id=h.id,
                role=ROLE,
                pp_rank=rank,
                bytes=msg.bytes,
                committed=self._landing.committed(h.id, rank),
                expected=self._landing.expected(h.id, rank),
                commit_s=commit_s,
            ),
        )

    def _last(self, h: DecodeHandoff, stage: DecodeStage, rank: int) -> SegmentAck:
        """The stage says this was its last segment: it arrives once every byte is committed."""
        expected = self._landing.expected(h.id, rank)
        if not self._landing.complete(h, rank):
            raise InvalidInput(
                f"stage {rank} says its last segment landed, but "
                f"{self._landing.committed(h.id, rank)} of {expected} bytes are committed",
                field="last",
                pp_rank=rank,
            )
        self._releases.confirm_stopped(h, stage)  # its sender has finished writing
        if not h.state.terminal and not stage.state.final:
            self._arrive(h, rank, stage, expected)
        return SegmentAck(committed=True)
