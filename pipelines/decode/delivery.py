"""Delivery: sending each prefill service the destination of its stages, once per handoff.

Called by `DecodePipeline.create` (one task per handoff, owned by the pipeline). A delivery that
fails fails the handoff naming the peer and its stages; one that may have reached its peer, even
failed or cancelled, still bounds how long that peer may write (SAFETY.md I5). In landed mode the
destination carries the first windows, withheld from a peer that is lost or hung.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any, Protocol

from kvhandoff.pipelines.decode.handoff import DecodeHandoff
from kvhandoff.pipelines.decode.landing import WINDOW_WAIT_S, Landing
from kvhandoff.pipelines.decode.outcomes import Outcomes
from kvhandoff.pipelines.decode.prefill_peers import PrefillDirectory
from kvhandoff.pipelines.errors import KVHandoffError
from kvhandoff.pipelines.layout import StageLayout
from kvhandoff.pipelines.messages import (
    AbortAck,
    AbortMsg,
    ArenaSpan,
    DestinationMsg,
    LayoutInfo,
    layout_json,
)
from kvhandoff.pipelines.states import HandoffState, advance


class PrefillPeer(Protocol):
    """Decode → prefill calls, implemented by the service over HTTP (or in-process)."""

    async def layout(self, url: str) -> LayoutInfo: ...

    async def deliver(self, url: str, msg: DestinationMsg) -> None: ...

    async def abort(self, url: str, msg: AbortMsg) -> AbortAck: ...


class Delivery:
    """Builds and sends a handoff's destinations; remembers the calls still unanswered."""

    def __init__(
        self,
        *,
        url: str,
        incarnation: str,
        target: str,
        layout: StageLayout,
        prefill: PrefillPeer,
        peers: PrefillDirectory,
        outcomes: Outcomes,
        landing: Landing | None,
        monotonic: Callable[[], float],
    ) -> None:
        self._url = url
        self._incarnation = incarnation
        self._target = target
        self._layout = layout
        self._prefill = prefill
        self._peers = peers
        self._outcomes = outcomes
        self._landing = landing
        self._monotonic = monotonic
        # What peers learn of this decode's memory: its pages' addresses only in direct mode,
        # where prefills write into them.
        self.peer_layout = layout if landing is None else layout.unplaced()
        # Encoded once: every destination carries these same bytes (a prefill compares them).
        self._peer_layout_json = layout_json(self.peer_layout)
        #: The landing arena peers may write into (None in direct mode): in every destination,
        #: where a prefill checks every grant lies.
        self.arena = (
            None
            if landing is None
            else ArenaSpan(addr=landing.arena.base_addr, length=landing.arena.capacity_bytes)
        )
        # When each destination call to a prefill peer still unanswered began (by peer).
        self._delivering: dict[str, list[float]] = {}

    async def deliver(self, h: DecodeHandoff) -> None:
        """Send each prefill service the destination of its stages; a failure fails `h`. Run
        as `h.delivery`, which it clears as it ends: a done delivery and none mean the same to
        every reader (nothing in flight), and a held handoff need not keep a finished task (its
        context, its coroutine) for the rest of its stay."""
        try:
            await self._deliver(h)
        finally:
            h.delivery = None  # nothing runs between this and the task's end

    async def _deliver(self, h: DecodeHandoff) -> None:
        by_peer: dict[str, list[int]] = {}
        for rank, st in h.stages.items():
            by_peer.setdefault(st.peer, []).append(rank)
        failure: KVHandoffError | None = None
        try:
            if len(by_peer) == 1:  # one prefill process (PP=1, or its stages together)
                await self._deliver_to(h, *next(iter(by_peer.items())))
            else:
                async with asyncio.TaskGroup() as tg:
                    for peer, ranks in by_peer.items():
                        tg.create_task(self._deliver_to(h, peer, ranks))
        except* KVHandoffError as group:
            failure = group.exceptions[0]  # type: ignore[assignment]
        if failure is not None:
            self._failed(h, failure, by_peer)
        elif h.state == HandoffState.PENDING:
            h.state = advance(h.state, HandoffState.TRANSFERRING, f"handoff {h.id!r}")

    def _failed(
        self, h: DecodeHandoff, failure: KVHandoffError, by_peer: dict[str, list[int]]
    ) -> None:
        peer = str(failure.context.get("peer"))
        ranks = sorted(by_peer.get(peer, []))
        # The peer may have restarted with other stages: fetch its layouts afresh next time.
        for url in by_peer:
            self._peers.forget(url)
        self._outcomes.mark_failed(h, ranks)
        self._outcomes.fail(
            h,
            failure.code,
            f"delivering the destination to {peer} (stage{'s' if len(ranks) > 1 else ''} "
            f"{', '.join(map(str, ranks))}) failed: {failure.message}",
            ranks[0] if ranks else None,
            failure.context,
        )

    def destination(
        self, h: DecodeHandoff, peer: str, ranks: list[int], remaining_s: float
    ) -> DestinationMsg:
        """The destination of stages `ranks` of `h` on prefill `peer`."""
        return DestinationMsg(
            handoff_id=h.id,
            decode_url=self._url,
            decode_incarnation=self._incarnation,
            prefill_incarnation=h.stages[ranks[0]].incarnation,
            decode_target=self._target,
            decode_layout=self._peer_layout_json,
            pp_ranks=sorted(ranks),
            dst_pages=h.request.dst_pages,
            prefix_pages=h.request.prefix_pages,
            fan_out=h.request.fan_out,
            dst_slot=h.request.dst_slot,
            dst_slots=dict(h.request.dst_slots),
            dst_aux=h.request.dst_aux,
            deadline_in_s=remaining_s,
            verify=h.verify,
            **self._landed_fields(h, peer, ranks),
        )

    async def _deliver_to(self, h: DecodeHandoff, peer: str, ranks: list[int]) -> None:
        """Send prefill `peer` the destination of stages `ranks`, and bound when it received it."""
        remaining_s = max(0.0, h.deadline_mono - self._monotonic())
        msg = self.destination(h, peer, ranks, remaining_s)
        what = f"handoff {h.id!r} destination to {peer}"
        for rank in ranks:
            h.stages[rank].sending(what)
        accepted = False
        started = self._monotonic()
        self._delivering.setdefault(peer, []).append(started)
        try:
            await self._prefill.deliver(peer, msg)
            accepted = True
        except KVHandoffError as exc:
            exc.context.setdefault("peer", peer)
            exc.context.setdefault("pp_ranks", sorted(ranks))
            raise
        finally:
            pending = self._delivering[peer]
            pending.remove(started)
            if not pending:
                del self._delivering[peer]
            # The prefill counts `remaining_s` from its receipt, so queueing and transit make
            # its deadline later than ours: by at most until now (SAFETY.md I5). A call that
            # failed or was cancelled may still have reached it: the same bound, the best known.
            until = self._monotonic() + remaining_s
            for rank in ranks:
                h.stages[rank].delivery_ended(accepted=accepted, writable_until=until, what=what)
            if self._landing is not None:
                self._landing.delivery_ended(h.id, ranks, accepted=accepted)

    def _landed_fields(self, h: DecodeHandoff, peer: str, ranks: list[int]) -> dict[str, Any]:
        if self._landing is None:
            return {}
        # No first window to a peer that is lost or has left a destination unanswered (a hung
        # process): its stages ask for windows once it speaks, so none sits granted to a peer
        # that cannot use it.
        withhold = self._peers.is_lost(peer) or self._unanswered(peer)
        return {
            "mode": "landed",
            "digest": self._landing.algorithm,
            "window_bytes": self._landing.window_bytes,
            "grants": [] if withhold else self._landing.first_grants(h, sorted(ranks)),
            "arena": self.arena,
        }

    def _unanswered(self, peer: str) -> bool:
        """Whether a destination sent to `peer` has waited for its answer longer than a window
        request may (`WINDOW_WAIT_S`): a peer that answers at all answers within it."""
        started = self._delivering.get(peer)
        return started is not None and self._monotonic() - min(started) > WINDOW_WAIT_S
