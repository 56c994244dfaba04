"""The prefill side of a handoff: its lifecycle, from the engine's ready signals and the decode's
destination to an outcome on every stage hosted here.

Called by the service's engine-facing route (`ready`), its peer routes (`deliver`, `abort`) and
its heartbeat task (`peer_lost`, `reconcile`). For each handoff one `asyncio.TaskGroup` runs one
stage worker (`stage.py`) per PP stage hosted here; a failing stage cancels its siblings.
Cancellation (abort, deadline, lost peer) never abandons a batch the engine is still writing, so
"quiesced" really means no write of this handoff can still land. A destination is bound to the
decode life that issued it and to this prefill's life; its deadline is measured from its receipt
on this host's monotonic clock.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Collection, Mapping

import numpy as np

from kvhandoff.pipelines.errors import (
    ConflictError,
    EngineAborted,
)
from kvhandoff.pipelines.events import (
    DestinationReceived,
    Event,
    EventBus,
    HandoffAborted,
    StageReady,
)
from kvhandoff.pipelines.messages import (
    AbortAck,
    DestinationMsg,
    HeartbeatAck,
    TransferMode,
)
from kvhandoff.pipelines.pairing import PairingCache
from kvhandoff.pipelines.peercache import new_incarnation
from kvhandoff.pipelines.prefill.destinations import DecodeLives, check_addressed, check_destination
from kvhandoff.pipelines.prefill.handoff import (
    I64,
    ROLE,
    BlockWriter,
    DecodePeer,
    HostedStage,
    PrefillHandoff,
    ReadySignal,
    StageInput,
    Staging,
)
from kvhandoff.pipelines.prefill.queries import PrefillQueries
from kvhandoff.pipelines.prefill.ranges import check_range
from kvhandoff.pipelines.prefill.scopes import Finished, OpenHandoffs
from kvhandoff.pipelines.prefill.signals import (
    hosted_stage,
    layer_pages,
    queue_signal,
    stage_input,
    stage_layers,
)
from kvhandoff.pipelines.prefill.stage import StageRunner
from kvhandoff.pipelines.prefill.task import fail_all, run_handoff
from kvhandoff.pipelines.settings import PREFILL_DEFAULTS, PrefillSettings
from kvhandoff.pipelines.slots import NO_SLOTS, RequestSlots, SlotsLike, as_slots
from kvhandoff.pipelines.states import StageState
from kvhandoff.pipelines.urls import canonical_url

log = logging.getLogger(__name__)

#: Ready signals a stage signalled by page range may have pending (one per prefill chunk):
#: bounded, so an engine cannot grow a stage's queue without end, and far above the chunks of
#: any prompt (a 1M-token prompt in 8K-token chunks is 128).
RANGED_QUEUE_DEPTH = 4096


class PrefillPipeline:
    def __init__(
        self,
        stages: Mapping[int, HostedStage],
        writer: BlockWriter,
        decode: DecodePeer,
        bus: EventBus,
        *,
        url: str = "",
        incarnation: str | None = None,
        max_call_s: float | None = None,
        cache: PairingCache | None = None,
        settings: PrefillSettings = PREFILL_DEFAULTS,
        staging: Staging | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.stages = dict(stages)
        # The one transfer mode this prefill serves, by its configuration: landed with a
        # staging buffer (the only memory it registers then), else direct. A destination
        # naming the other mode is refused: no decode (nor a forged destination) chooses it.
        self.mode: TransferMode = "landed" if staging is not None else "direct"
        self.url = url  # this service's public URL: the sender of its notices
        self.incarnation = incarnation or new_incarnation()
        # The longest one engine call of this process can still write once started (the
        # transport's bound): declared to the decode side, which waits that long past the
        # deadline for a writer it cannot hear from.
        self.max_call_s = writer.max_call_s if max_call_s is None else max_call_s
        self._decode = decode
        self._bus = bus
        self.cache = cache or PairingCache()
        self._default_deadline_s = settings.default_deadline_s
        self._clock = clock
        self._runner = StageRunner(
            self.stages,
            writer,
            decode,
            bus,
            self.cache,
            sender=self,
            max_blocks_per_batch=settings.max_blocks_per_batch,
            queue_depth=settings.queue_depth,
            staging=staging,
        )
        self._handoffs = OpenHandoffs()  # by the decode each id belongs to (`scopes.py`)
        #: What the service reads of the handoffs open here (`queries.py`): values only.
        self.query = PrefillQueries(self._handoffs, staging)
        # Recently finished handoffs, so a late or repeated signal is refused rather than
        # waiting for a destination that will never come.
        self._finished = Finished()
        # What each decode life named in its first destination: later ones are held to it.
        self._lives = DecodeLives()
        # Told the decode service of every delivered destination (the heartbeats watch it).
        self.on_peers: Callable[[list[str]], None] = lambda peers: None

    # ----------------------------------------------------------------- inputs

    def ready(
        self,
        handoff_id: str,
        pp_rank: int,
        src_pages: Collection[int] | I64 | None,
        src_slots: SlotsLike,
        layers: Collection[int] | None = None,
        *,
        decode_url: str | None = None,
        pages_from: int | None = None,
        last_pages: bool | None = None,
    ) -> None:
        """The engine finished `layers` (None: all) of stage `pp_rank` for this request.

        By layer: the first signal of a stage must carry its source pages (and slots, for hybrid
        models: `src_slots` is a `RequestSlots`, or the single slot of every component; and
        the aux row on the last stage of a layout with aux entries); later ones may repeat them
        or leave them out.

        By page range (chunked prefill; `pages_from` given): `src_pages` are the request's
        pages at positions `pages_from..` and are ready for every layer of the stage. Ranges
        come in order without gaps or overlaps, each saying whether it is the last
        (`last_pages`); the slots come with the last one only. A stage is signalled one way.

        `decode_url` names the decode service the request's id belongs to (ids are unique per
        decode only); without it the id must be unique across the decodes using this prefill,
        and a ready whose id two of them use now is refused. Raises InvalidInput /
        NotFoundError / ConflictError before anything changes (the steps: `signals.py`)."""
        stage = hosted_stage(self.stages, pp_rank)
        scope = None if decode_url is None else canonical_url(decode_url)
        slots = as_slots(src_slots)
        if pages_from is not None or last_pages is not None:
            self._ready_range(
                scope, handoff_id, pp_rank, stage, src_pages, slots, layers, pages_from, last_pages
            )
            return
        layer_set = stage_layers(stage, pp_rank, layers)
        h = self._handoffs.for_ready(scope, handoff_id)
        if h is None:  # an open handoff of this id is not the ended one
            self._finished.refuse(scope, handoff_id)
        current = h.inputs.get(pp_rank) if h else None
        pages = layer_pages(handoff_id, pp_rank, stage, current, src_pages, slots)
        # Checked: from here on the signal changes the handoff.
        h = self._opened(h, scope, handoff_id)
        current = stage_input(
            h,
            pp_rank,
            current,
            lambda: StageInput(pages, slots, asyncio.Queue(len(stage.layout.kv) + 64)),
        )
        queue_signal(handoff_id, pp_rank, current, ReadySignal(layer_set), "layers")
        self._publish(
            StageReady(
                handoff_id=handoff_id,
                role=ROLE,
                pp_rank=pp_rank,
                num_pages=int(pages.shape[0]),
                layers=None if layer_set is None else sorted(layer_set),
            )
        )

    def _ready_range(
        self,
        scope: str | None,
        handoff_id: str,
        pp_rank: int,
        stage: HostedStage,
        src_pages: Collection[int] | I64 | None,
        src_slots: RequestSlots,
        layers: Collection[int] | None,
        pages_from: int | None,
        last_pages: bool | None,
    ) -> None:
        """A page-range signal (see `ready`), checked by `check_range` before anything
        changes."""
        h = self._handoffs.for_ready(scope, handoff_id)
        if h is None:  # an open handoff of this id is not the ended one
            self._finished.refuse(scope, handoff_id)
        current = h.inputs.get(pp_rank) if h else None
        known = h.known_destination if h is not None else None
        pages, at, end, last_pages = check_range(
            handoff_id,
            pp_rank,
            stage,
            current,
            known,
            src_pages,
            src_slots,
            layers,
            pages_from,
            last_pages,
        )
        if current is not None and current.signals.full():
            raise ConflictError(
                f"stage {pp_rank} of handoff {handoff_id!r} has too many pending ready signals",
                field="pages_from",
                pp_rank=pp_rank,
            )
        h = self._opened(h, scope, handoff_id)
        current = stage_input(h, pp_rank, current, _ranged_input)
        current.add_range(pages, src_slots, last=last_pages)
        current.signals.put_nowait(ReadySignal(None, pages_end=end, last=last_pages))
        self._publish(
            StageReady(
                handoff_id=handoff_id,
                role=ROLE,
                pp_rank=pp_rank,
                num_pages=int(pages.shape[0]),
                pages_from=at,
                last_pages=last_pages,
            )
        )

    def _opened(
        self, h: PrefillHandoff | None, scope: str | None, handoff_id: str
    ) -> PrefillHandoff:
        """The handoff a checked signal is for: opened by the first, bound to its decode by the
        first that names it."""
        if h is None:
            return self._open(scope, handoff_id)
        if h.scope is None and scope is not None:
            self._handoffs.rescope(h, scope)
        return h

    def deliver(self, msg: DestinationMsg) -> None:
        """The decode service says where this handoff's bytes go. Refused (changing nothing)
        when it was issued for another life of this service."""
        check_addressed(msg, self.incarnation, self.mode, self.stages)
        layout = self._lives.layout(msg)
        check_destination(msg, layout)
        scope = canonical_url(msg.decode_url)
        outcome = self._finished.claim(scope, msg.handoff_id)
        if outcome is not None:
            raise ConflictError(
                f"handoff {msg.handoff_id!r} already {outcome} on this prefill service",
                field="handoff_id",
            )
        # Its own, or one signalled ready before naming no decode, or a new one.
        found = self._handoffs.get(scope, msg.handoff_id) or self._handoffs.get(
            None, msg.handoff_id
        )
        h = self._opened(found, scope, msg.handoff_id)
        if h.destination.cancelled():
            # Its task was cancelled (an abort or the engine giving up is stopping it, not
            # closed yet): `result()` would raise CancelledError out of the HTTP handler, and
            # aiohttp drops the connection without an answer.
            raise ConflictError(
                f"handoff {msg.handoff_id!r} is being stopped on this prefill service",
                field="handoff_id",
            )
        if h.destination.done():
            if h.destination.result() == msg:
                return  # a retried delivery
            raise ConflictError(
                f"handoff {msg.handoff_id!r} already has another destination", field="handoff_id"
            )
        h.deadline_mono = time.monotonic() + msg.deadline_in_s
        self._lives.pin(msg, layout)
        h.destination.set_result(msg)
        self._publish(
            DestinationReceived(
                handoff_id=msg.handoff_id,
                role=ROLE,
                pp_ranks=list(msg.pp_ranks),
                decode_url=msg.decode_url,
                num_pages=len(msg.dst_pages),
                prefix_pages=msg.prefix_pages,
                fan_out=msg.fan_out,
            )
        )
        self.on_peers([msg.decode_url])

    async def abort(
        self,
        handoff_id: str,
        reason: str,
        decode_incarnation: str | None = None,
        *,
        decode_url: str | None = None,
    ) -> AbortAck:
        """Stop a handoff of decode `decode_url` (its signed sender; None: unsigned, found by
        id and `decode_incarnation`); returns once no write of it can still land. With
        `decode_incarnation`, a handoff bound to another decode life is refused. A handoff not
        open here is remembered as aborted, so a later ready signal for it is refused."""
        scope = None if decode_url is None else canonical_url(decode_url)
        h = self._handoffs.for_abort(scope, handoff_id, decode_incarnation)
        if h is None:
            self._finished.remember(scope, handoff_id, "aborted")
            return self._ack(handoff_id, [])
        return await self._abort(h, reason, decode_incarnation)

    async def _abort(
        self, h: PrefillHandoff, reason: str, decode_incarnation: str | None = None
    ) -> AbortAck:
        handoff_id = h.handoff_id
        dest = h.known_destination
        if (
            decode_incarnation is not None
            and dest is not None
            and dest.decode_incarnation != decode_incarnation
        ):
            raise ConflictError(
                f"handoff {handoff_id!r} belongs to decode incarnation "
                f"{dest.decode_incarnation}, not {decode_incarnation}",
                field="decode_incarnation",
            )
        running = [r for r, s in h.stage_state.items() if not s.final]
        if h.task is not None:
            h.task.cancel()
            await asyncio.wait([h.task])
        for rank in running:
            if not h.stage_state[rank].final:
                h.set_stage(rank, StageState.STOPPED)
        self._close(h, "aborted")
        self._publish(HandoffAborted(handoff_id=handoff_id, role=ROLE, reason=reason))
        return self._ack(handoff_id, sorted(running))

    async def give_up(self, handoff_id: str, reason: str, *, decode_url: str | None = None) -> None:
        """The engine dropped this request (e.g. its client went away): stop its stages and
        fail the handoff on the decode side too, naming each stage that will not arrive. Returns
        once no write of it can still land and its source pages are no longer read; a
        destination delivered later is refused (the handoff is finished here). `decode_url`
        names the request's decode, as for `ready`."""
        scope = None if decode_url is None else canonical_url(decode_url)
        h = self._handoffs.for_ready(scope, handoff_id)
        if h is None:
            self._finished.remember(scope, handoff_id, "failed")
            return
        if h.task is not None:
            h.task.cancel()
            await asyncio.wait([h.task])
        await fail_all(self._runner, h, h.known_destination, EngineAborted(reason))
        self._close(h, "failed")

    async def withdraw(self, handoff_id: str, reason: str) -> bool:
        """The engine needs no transfer of this handoff after all (another rank sends it):
        stop its stages and end it here `aborted` with `reason`, telling no decode, as none
        holds it yet. Returns False, changing nothing, once it has a destination: a decode
        waits for it then, and `give_up` is the call that tells it."""
        h = self._handoffs.for_ready(None, handoff_id)
        if h is None:
            self._finished.remember(None, handoff_id, "aborted")
            return True
        if h.known_destination is not None:
            return False
        await self._abort(h, reason)
        return True

    def _ack(self, handoff_id: str, stopped: list[int]) -> AbortAck:
        return AbortAck(
            handoff_id=handoff_id,
            quiesced=True,
            stages=stopped,
            incarnation=self.incarnation,
            max_call_s=self.max_call_s,
        )

    async def peer_lost(self, decode_url: str, reason: str) -> list[str]:
        """A decode service went silent: stop sending to it. Returns the stopped handoff ids."""
        victims = [h for h in self._handoffs if h.decode_url == decode_url]
        for h in victims:
            await self._abort(h, f"decode {decode_url} {reason}")  # as `reconcile` names it
        return [h.handoff_id for h in victims]

    async def reconcile(self, decode_url: str, ack: HeartbeatAck, sent: list[str]) -> list[str]:
        """A heartbeat answer from `decode_url`: stop every handoff bound to another life of it
        (it restarted: the pages we would write are no longer that handoff's), and every handoff
        in `sent` that it no longer runs while a stage here may still write and has not sent
        its last notice (the decode completes a handoff on that notice, and may answer this
        heartbeat before the notice's own answer is back). Returns their ids."""
        victims = self._handoffs.outdated(decode_url, ack, sent)
        for h, why in victims:
            await self._abort(h, why)
        return [h.handoff_id for h, _ in victims]

    def live_with(self, decode_url: str) -> list[str]:
        """Handoffs bound to `decode_url` (a heartbeat answer)."""
        return self.live_by_decode().get(decode_url, [])

    def live_by_decode(self) -> dict[str, list[str]]:
        """Live handoff ids per decode URL: whom the heartbeat task must keep pinging."""
        return self._handoffs.live_by_decode()

    async def close(self) -> None:
        for h in self._handoffs:
            await self._abort(h, "service shutting down")
        self._runner.close()

    # ----------------------------------------------------------------- internals

    def _open(self, scope: str | None, handoff_id: str) -> PrefillHandoff:
        loop = asyncio.get_running_loop()
        h = PrefillHandoff(handoff_id, self._clock(), loop.create_future(), scope=scope)
        self._handoffs.add(h)
        h.task = loop.create_task(
            run_handoff(h, self._runner, self._lives, self._default_deadline_s, self._close),
            name=f"prefill:{handoff_id}",
        )
        return h

    def _close(self, h: PrefillHandoff, outcome: str) -> None:
        if self._handoffs.remove(h):
            self._finished.remember(h.scope, h.handoff_id, outcome)

    def _publish(self, event: Event) -> None:
        self._bus.publish(event)


def _ranged_input() -> StageInput:
    """A stage signalled by page range: its pages grow with each range, its slots come last."""
    return StageInput(
        np.zeros(0, dtype=np.int64),
        NO_SLOTS,
        asyncio.Queue(RANGED_QUEUE_DEPTH),
        ranged=True,
        ended=False,
    )
