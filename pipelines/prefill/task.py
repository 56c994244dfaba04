"""One handoff's task on the prefill side: wait for its destination, then run one stage worker
per stage it names (`stage.py`) in one `asyncio.TaskGroup`, and end it with one outcome.

Started by `PrefillPipeline._open` for every handoff opened here. A failing stage cancels its
siblings; a deadline, a refused destination or a crash fails every stage not final yet on both
sides (the decode is told), so no handoff is left to the decode's deadline. Cancelled (abort,
lost peer), it closes nothing itself: the canceller does, once no write can still land.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from kvhandoff.pipelines.errors import DeadlineExceeded, InternalError, KVHandoffError
from kvhandoff.pipelines.messages import DestinationMsg
from kvhandoff.pipelines.prefill.destinations import DecodeLives, check_decode_side
from kvhandoff.pipelines.prefill.handoff import PrefillHandoff, StageFailed
from kvhandoff.pipelines.prefill.stage import StageRunner
from kvhandoff.pipelines.states import StageState

log = logging.getLogger(__name__)


async def run_handoff(
    h: PrefillHandoff,
    runner: StageRunner,
    lives: DecodeLives,
    default_deadline_s: float,
    close: Callable[[PrefillHandoff, str], None],
) -> None:
    """Run `h` to its outcome, then `close(h, outcome)` unless cancelled."""
    loop = asyncio.get_running_loop()
    # Until the destination names a deadline, the default one bounds the wait for it.
    fallback = loop.time() + default_deadline_s
    dest: DestinationMsg | None = None
    outcome = "failed"
    try:
        async with asyncio.timeout_at(fallback) as scope:
            dest = await h.destination
            assert h.deadline_mono is not None
            # loop.time() is the monotonic clock the deadline was measured on.
            scope.reschedule(loop.time() + max(0.0, h.deadline_mono - time.monotonic()))
            side = lives.side(dest)
            check_decode_side(dest, side, lives.layout(dest))
            if len(dest.pp_ranks) == 1:
                # One stage here (PP = 1, or each stage its own process): it runs in this task,
                # as a group of one would (its failure and cancellation are the handoff's), without
                # a second task per handoff.
                await runner.run(h, dest.pp_ranks[0], dest, side)
            else:
                async with asyncio.TaskGroup() as tg:
                    for rank in dest.pp_ranks:
                        tg.create_task(runner.run(h, rank, dest, side))
        outcome = "completed"
    except* StageFailed:
        pass  # the failing stage already told the decode side
    except* TimeoutError:
        await fail_all(runner, h, dest, DeadlineExceeded("handoff deadline passed on prefill"))
    except* KVHandoffError as group:
        await fail_all(runner, h, dest, group.exceptions[0])  # type: ignore[arg-type]
    except* Exception as group:
        # must still fail the handoff on both sides instead of leaving it to the deadline.
        log.error("handoff %s crashed", h.handoff_id, exc_info=group.exceptions[0])
        error = InternalError(f"prefill pipeline crashed: {group!r}")
        await fail_all(runner, h, dest, error)
    finally:
        if not asyncio.current_task().cancelling():  # type: ignore[union-attr]
            close(h, outcome)


async def fail_all(
    runner: StageRunner, h: PrefillHandoff, dest: DestinationMsg | None, error: KVHandoffError
) -> None:
    """Fail every stage of `h` not final yet, telling the decode (when a destination came)."""
    for rank in dest.pp_ranks if dest else sorted(h.inputs):
        if not h.stage_state.get(rank, StageState.WAITING).final:
            await runner.report_failure(h, dest, rank, error)
