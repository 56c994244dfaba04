"""Stage notices on the decode side: who may report on a stage, and a stage's arrival or failure.

Called by `DecodePipeline` for its peer routes (`arrived`, `stage_failed`, and the checks before
a window or a segment: `landed_stage`) and by the segment exchange (`arrive`, with a stage's
last segment). A notice is refused, changing nothing, unless it names a stage of a handoff held
here and comes from that stage's own prefill life to this decode life (SAFETY.md I6); an arrival
must account for exactly the bytes its destination expects, and a replay is a ConflictError.
The last stage to arrive completes the handoff (after its digests match, where verified).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Any

from kvhandoff.pipelines.decode.handoff import ROLE, DecodeHandoff, DecodeStage, publish
from kvhandoff.pipelines.decode.notices import check_accounting, check_sender, first_mismatch
from kvhandoff.pipelines.decode.outcomes import Outcomes
from kvhandoff.pipelines.decode.release import Releases
from kvhandoff.pipelines.errors import ConflictError, InvalidInput, NotFoundError
from kvhandoff.pipelines.events import EventBus, StageArrived
from kvhandoff.pipelines.layout import StageLayout
from kvhandoff.pipelines.memory import EntryMemory
from kvhandoff.pipelines.messages import ArrivalMsg, SegmentMsg, StageFailedMsg, WindowRequest
from kvhandoff.pipelines.pairing import PairingCache
from kvhandoff.pipelines.states import HandoffState, StageState, advance

Notice = ArrivalMsg | StageFailedMsg | SegmentMsg | WindowRequest


class StageNotices:
    """Takes in what prefill stages say of the handoffs held in `handoffs`."""

    def __init__(
        self,
        handoffs: dict[str, DecodeHandoff],
        layout: StageLayout,
        incarnation: str,
        cache: PairingCache,
        bus: EventBus,
        outcomes: Outcomes,
        releases: Releases,
        *,
        landed: bool,
        memory: EntryMemory | None,
        spawn: Callable[[Coroutine[Any, Any, None]], asyncio.Task[None]],
    ) -> None:
        self._handoffs = handoffs
        self._layout = layout
        self._incarnation = incarnation
        self._cache = cache
        self._bus = bus
        self._outcomes = outcomes
        self._releases = releases
        self.landed = landed
        self._memory = memory
        self._spawn = spawn

    def arrived(self, msg: ArrivalMsg) -> None:
        """Stage `msg.pp_rank` says every byte landed (direct mode; see the module)."""
        h, stage = self._sent_by_stage(msg)
        self._refuse_replay(h, msg.pp_rank, stage)
        if self.landed:
            raise ConflictError(
                f"handoff {h.id!r} is landed: a stage arrives with its last segment",
                field="pp_rank",
                pp_rank=msg.pp_rank,
            )
        pairing = self._cache.get(stage.layout, self._layout)
        check_accounting(pairing, h.dst_pages, msg)
        self._releases.confirm_stopped(h, stage)  # its sender has finished writing either way
        if h.state.terminal or stage.state.final:
            return  # a late notice: an outcome never changes
        self.arrive(h, msg.pp_rank, stage, msg.bytes, msg.digests)

    def stage_failed(self, msg: StageFailedMsg) -> None:
        """Stage `msg.pp_rank` failed and says no write of it can still land."""
        h, stage = self._sent_by_stage(msg)
        self._releases.confirm_stopped(h, stage)
        if stage.state.final:
            return
        stage.state = advance(stage.state, StageState.FAILED, f"handoff {h.id!r} stage")
        self._outcomes.fail(
            h, msg.code, f"stage {msg.pp_rank}: {msg.reason}", msg.pp_rank, msg.context
        )

    def landed_stage(self, msg: SegmentMsg | WindowRequest) -> tuple[DecodeHandoff, DecodeStage]:
        """The handoff and stage a window request or segment is for, while it still takes bytes."""
        h, stage = self._sent_by_stage(msg)
        self._refuse_replay(h, msg.pp_rank, stage)
        if h.state.terminal or stage.state.final:
            raise ConflictError(
                f"handoff {h.id!r} is already {h.state.value}: nothing more lands",
                field="handoff_id",
                pp_rank=msg.pp_rank,
            )
        return h, stage

    def arrive(
        self,
        h: DecodeHandoff,
        rank: int,
        stage: DecodeStage,
        nbytes: int,
        digests: dict[str, str] | None = None,
    ) -> None:
        """Stage `rank` has every byte in place: count it, and complete `h` with the last."""
        stage.state = advance(stage.state, StageState.ARRIVED, f"handoff {h.id!r} stage")
        stage.bytes, stage.digests = nbytes, digests
        if h.state == HandoffState.PENDING:
            h.state = advance(h.state, HandoffState.TRANSFERRING, f"handoff {h.id!r}")
        arrived = sum(1 for s in h.stages.values() if s.state == StageState.ARRIVED)
        event = StageArrived(
            handoff_id=h.id,
            role=ROLE,
            pp_rank=rank,
            bytes=nbytes,
            arrived=arrived,
            expected=len(h.stages),
        )
        publish(self._bus, h, event)
        if arrived < len(h.stages):
            return
        if self.landed:
            # Every byte was committed by `Landing.commit` only after its digest matched.
            h.verification = "passed"
            self._outcomes.complete(h, verified=True)
        elif h.verify and self._memory is not None:
            self._spawn(self._verify_then_complete(h))  # digests off the event loop
        else:
            self._outcomes.complete(h)

    async def _verify_then_complete(self, h: DecodeHandoff) -> None:
        problem = await asyncio.to_thread(self._verify, h)
        if h.state.terminal:
            return  # a deadline or an abort came first
        if problem is not None:
            reason, rank, ctx = problem
            self._outcomes.mark_failed(h, [rank])
            self._outcomes.fail(h, "verification_failed", reason, rank, ctx)
            return
        h.verification = "passed"
        self._outcomes.complete(h, verified=True)

    def _verify(self, h: DecodeHandoff) -> tuple[str, int, dict[str, Any]] | None:
        assert self._memory is not None
        digests = {rank: st.digests for rank, st in h.stages.items()}
        return first_mismatch(self._layout, self._memory, digests, h.dst_pages, h.request.slots)

    def _sent_by_stage(self, msg: Notice) -> tuple[DecodeHandoff, DecodeStage]:
        """The handoff and stage `msg` names, if its sender may speak for that stage."""
        h = self._handoffs.get(msg.handoff_id)
        if h is None:
            raise NotFoundError(f"no handoff {msg.handoff_id!r}", field="id")
        rank = msg.pp_rank
        stage = h.stages.get(rank)
        if stage is None:
            raise InvalidInput(
                f"handoff {h.id!r} has no stage {rank}", field="pp_rank", pp_rank=rank
            )
        check_sender(h.id, rank, stage.peer, stage.incarnation, self._incarnation, msg)
        stage.max_call_s = max(stage.max_call_s, msg.max_call_s)
        return h, stage

    @staticmethod
    def _refuse_replay(h: DecodeHandoff, rank: int, stage: DecodeStage) -> None:
        if stage.state == StageState.ARRIVED:
            raise ConflictError(
                f"stage {rank} of handoff {h.id!r} has already arrived (replay refused)",
                field="pp_rank",
                pp_rank=rank,
            )
