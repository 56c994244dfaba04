"""A decode handoff's outcome: decided once, announced at once, then handed to the release.

Called by the decode pipeline (`kvhandoff.pipelines.decode`) for every way a handoff ends (SAFETY.md
L1): every stage arrived (`complete`), a stage or its peer failed (`fail`, `fail_stages`), an abort
(`abort`), its deadline passed (`expire`, armed by `open`). The table in `states.py` refuses a
second outcome. Announcing never frees pages: a failure starts the quiesce (`Releases.start`),
an abort's caller starts it, and a completion releases at once, because every writer has then
reported its writes done.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

from kvhandoff.pipelines.decode.handoff import ROLE, DecodeHandoff, publish
from kvhandoff.pipelines.decode.release import Releases
from kvhandoff.pipelines.decode.views import ErrorView
from kvhandoff.pipelines.errors import DeadlineExceeded, PeerUnreachable
from kvhandoff.pipelines.events import EventBus, HandoffAborted, HandoffCompleted, HandoffFailed
from kvhandoff.pipelines.states import HandoffState, StageState, advance, allowed


class Outcomes:
    def __init__(
        self,
        bus: EventBus,
        releases: Releases,
        *,
        clock: Callable[[], float] = time.time,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        self._bus = bus
        self._releases = releases
        self._clock = clock  # unix time of views and events
        self._monotonic = monotonic  # what durations are measured on
        self.live = 0  # handoffs without an outcome yet

    def open(self, h: DecodeHandoff) -> None:
        """Count `h` as live and arm its deadline (the loop's timers run on its monotonic
        clock: a step of the wall clock moves no deadline)."""
        self.live += 1
        deadline_s = h.deadline_at - h.created_at
        h.timer = asyncio.get_running_loop().call_later(deadline_s, self.expire, h)

    def complete(self, h: DecodeHandoff, *, verified: bool = False) -> None:
        """Every stage arrived: each one's writes drained, so nothing of it can still land."""
        self._finish(h, HandoffState.COMPLETED)
        publish(
            self._bus,
            h,
            HandoffCompleted(
                handoff_id=h.id,
                role=ROLE,
                bytes=sum(s.bytes for s in h.stages.values()),
                seconds=(h.finished_mono or h.created_mono) - h.created_mono,
                verified=verified,
                metadata=h.request.metadata,
            ),
        )
        self._releases.release(h, confirmed=True)

    def abort(self, h: DecodeHandoff, reason: str) -> None:
        """Announce `aborted` (the caller stops the writers: `Releases.start`)."""
        self._finish(h, HandoffState.ABORTED)
        publish(
            self._bus,
            h,
            HandoffAborted(handoff_id=h.id, role=ROLE, reason=reason, metadata=h.request.metadata),
        )

    def fail(
        self,
        h: DecodeHandoff,
        code: str,
        reason: str,
        pp_rank: int | None,
        context: dict[str, Any],
    ) -> None:
        """Announce `failed` naming the stage, and start stopping its writers."""
        if h.state.terminal:
            return  # the first outcome stands (e.g. an abort that reached the prefill first)
        self._finish(h, HandoffState.FAILED)
        h.error = ErrorView(code=code, reason=reason, pp_rank=pp_rank, context=context)
        publish(
            self._bus,
            h,
            HandoffFailed(
                handoff_id=h.id,
                role=ROLE,
                code=code,
                reason=reason,
                pp_rank=pp_rank,
                context=context,
                metadata=h.request.metadata,
            ),
        )
        self._releases.start(h, f"handoff failed: {reason}")

    def fail_stages(self, h: DecodeHandoff, url: str, ranks: list[int], reason: str) -> bool:
        """Stages `ranks` of prefill peer `url` will not arrive (`reason`): show them failed and
        fail `h` unless it already has an outcome. Returns whether this failed it."""
        self.mark_failed(h, ranks)
        if h.state.terminal:
            return False
        self.fail(
            h,
            PeerUnreachable.code,
            f"prefill peer {url} (stage{'s' if len(ranks) > 1 else ''} "
            f"{', '.join(map(str, ranks))}) {reason}",
            ranks[0],
            {"peer": url},
        )
        return True

    def expire(self, h: DecodeHandoff) -> None:
        """The deadline passed (its timer, armed by `open`)."""
        if not h.state.terminal:
            err = DeadlineExceeded("")
            waiting = sorted(r for r, s in h.stages.items() if not s.state.final)
            self.mark_failed(h, waiting)
            self.fail(
                h,
                err.code,
                f"deadline of {h.deadline_at - h.created_at:.3g} s passed with stages "
                f"{waiting} still to arrive",
                waiting[0] if waiting else None,
                {},
            )

    @staticmethod
    def mark_failed(h: DecodeHandoff, ranks: list[int]) -> None:
        """Show stages `ranks` failed (those whose state still allows it)."""
        for r in ranks:
            st = h.stages[r]
            if st.state != StageState.FAILED and StageState.FAILED in allowed(st.state):
                st.state = advance(st.state, StageState.FAILED, f"handoff {h.id!r} stage {r}")

    def _finish(self, h: DecodeHandoff, state: HandoffState) -> None:
        """Record the outcome (once: the table refuses a second)."""
        h.state = advance(h.state, state, f"handoff {h.id!r}")
        h.finished_at, h.finished_mono = self._clock(), self._monotonic()
        h.done.set()
        self.live -= 1
        if h.timer is not None:
            h.timer.cancel()
            # A held handoff is kept long after it ended (`history`): the cancelled timer's
            # context and arguments would be kept with it, for the collector to walk again.
            h.timer = None
