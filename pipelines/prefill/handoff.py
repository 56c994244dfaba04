"""The prefill side's records: one handoff as this process holds it, the stages it hosts, and
what the pipeline needs from a transport and from the decode service.

Shared by the lifecycle (`pipeline.py`) and the stage worker (`stage.py`); holds no behaviour
beyond the legal changes of a stage's state.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt

from kvhandoff.pipelines.arena import Arena
from kvhandoff.pipelines.errors import InvalidInput
from kvhandoff.pipelines.layout import StageLayout
from kvhandoff.pipelines.memory import EntryMemory
from kvhandoff.pipelines.messages import (
    ArenaSpan,
    ArrivalMsg,
    DestinationMsg,
    SegmentAck,
    SegmentMsg,
    StageFailedMsg,
    TransferMode,
    WindowAnswer,
    WindowRequest,
)
from kvhandoff.pipelines.packing import ByteRegions
from kvhandoff.pipelines.slots import RequestSlots
from kvhandoff.pipelines.states import StageState, advance
from kvhandoff.transport.blocks import Blocks

I64 = npt.NDArray[np.int64]
ROLE = "prefill"


class BlockWriter(Protocol):
    """What the pipeline needs from a transport."""

    async def write(self, peer: str, blocks: Blocks, *, start_by: float | None = None) -> None: ...

    async def quiesce(self, peer: str | None = None) -> None: ...

    @property
    def max_call_s(self) -> float:
        """The longest one engine call can still write once started."""
        ...


@dataclass(frozen=True)
class DecodeSide:
    """What a decode life named of itself in its first accepted destination
    (`destinations.DecodeLives`): the layout to pair against (placed in direct mode only), the
    one transfer mode it serves, its landing arena (landed mode), where every grant must lie,
    and the transport target its memory is registered on: every write goes there, never to
    another target a later destination names (another endpoint may hold memory at the same
    addresses)."""

    layout: StageLayout
    mode: TransferMode
    arena: ArenaSpan | None
    target: str


class DecodePeer(Protocol):
    """Prefill → decode calls, implemented by the service over HTTP (or in-process)."""

    async def arrived(self, decode_url: str, msg: ArrivalMsg) -> None: ...

    async def stage_failed(self, decode_url: str, msg: StageFailedMsg) -> None: ...

    async def window(self, decode_url: str, msg: WindowRequest) -> WindowAnswer:
        """Landed mode: ask for a window of the decode's landing arena."""
        ...

    async def segment(self, decode_url: str, msg: SegmentMsg) -> SegmentAck:
        """Landed mode: one segment landed in its window; the decode commits it (or not)."""
        ...


@dataclass(frozen=True)
class HostedStage:
    """One PP stage registered in this process: its placed layout and a view of its memory."""

    layout: StageLayout
    memory: EntryMemory | None = None  # host-readable views, for direct mode's digests
    # Every entry on its own device, for landed mode's gathers (`kvhandoff.pipelines.packing`).
    regions: ByteRegions | None = None


@dataclass(frozen=True)
class Staging:
    """A prefill's registered staging buffer: packed segments wait here while they travel."""

    arena: Arena
    buffer: Any  # the whole buffer as one 1-D uint8 array on its device


@dataclass(frozen=True)
class ReadySignal:
    layers: frozenset[int] | None  # None: every layer of the stage not sent yet
    # A page-range signal: the request's pages up to this position are ready for every KV
    # layer of the stage (None: a layer signal).
    pages_end: int | None = None
    last: bool = False  # a page-range signal: the last range; the slot comes with it


class End:
    """Marks the end of a stage's chunk or plan stream."""


END = End()


@dataclass(frozen=True)
class Chunk:
    """Layer-tagged work for one stage: KV pages of `layers`, state slots of `layers`, or the
    stage's aux rows (no layers)."""

    pp_rank: int
    kind: str  # "kv", "state" or "aux"
    layers: tuple[int, ...]


@dataclass
class StageInput:
    """What the engine told this process about one stage of one handoff.

    Signalled by layer, `src_pages` holds every page from the first signal on. Signalled by
    page range (`ranged`), it holds the pages of the ranges so far (request positions
    `0..len-1`) and grows with each one, amortised O(range): a segment may still be gathering
    from an older array, which keeps the same values at the positions it reads."""

    src_pages: I64
    src_slots: RequestSlots  # its state slots and aux row (by page range: with the last)
    signals: asyncio.Queue[ReadySignal]
    ranged: bool = False
    ended: bool = True  # every page (and the slots) is known: False until the last range
    ended_event: asyncio.Event = field(default_factory=asyncio.Event)
    _buffer: I64 | None = None

    def add_range(self, pages: I64, slots: RequestSlots, *, last: bool) -> None:
        """Append a validated page range (ranged stages only)."""
        n, m = int(self.src_pages.shape[0]), int(pages.shape[0])
        buf = self._buffer
        if buf is None or buf.shape[0] < n + m:
            # A new array, so a gather reading the old one is untouched.
            grown = np.empty(max(2 * (n + m), 16), dtype=np.int64)
            grown[:n] = self.src_pages
            buf = self._buffer = grown
        buf[n : n + m] = pages
        self.src_pages = buf[: n + m]
        if last:
            self.src_slots = slots
            self.ended = True
            self.ended_event.set()


def request_pages(prefix: int, num_dst: int) -> str:
    """How many pages the decode's request has, said in errors about a prefix."""
    return f"the decode has {prefix + num_dst} pages ({prefix} of them its cached prefix)"


class _SkippedSignals:
    """A stage's ready signals with page positions counted after the decode's prefix. Ranges
    queued before the destination came were not checked against its page count (`check_range`
    checks those that come after; `stage_source` a stage whose last range came before): their
    ends are here, in request positions."""

    def __init__(
        self, inner: asyncio.Queue[ReadySignal], prefix: int, num_dst: int, pp_rank: int
    ) -> None:
        self._inner = inner
        self._prefix = prefix
        self._total = prefix + num_dst
        self._pp_rank = pp_rank

    def empty(self) -> bool:
        return self._inner.empty()

    async def get(self) -> ReadySignal:
        signal = await self._inner.get()
        end = signal.pages_end
        if end is None:
            return signal
        if end > self._total:
            has = request_pages(self._prefix, self._total - self._prefix)
            raise InvalidInput(
                f"the range ends at position {end}; {has}",
                field="src_pages",
                pp_rank=self._pp_rank,
            )
        # A range inside the prefix brings no page to send (it ends at position 0 here).
        return replace(signal, pages_end=max(0, end - self._prefix))


class PrefixSkipped:
    """A stage's input as a destination that skips a prefix sees it (`prefix_pages`): the
    request's positions `prefix..`, numbered from 0 as the destination's `dst_pages` are.
    The pages before are never read; ranges still to come are counted the same way."""

    def __init__(self, inner: StageInput, prefix: int, num_dst: int, pp_rank: int) -> None:
        self._inner = inner
        self._prefix = prefix
        self.signals = _SkippedSignals(inner.signals, prefix, num_dst, pp_rank)

    @property
    def src_pages(self) -> I64:
        return self._inner.src_pages[self._prefix :]

    @property
    def src_slots(self) -> RequestSlots:
        return self._inner.src_slots

    @property
    def ranged(self) -> bool:
        return self._inner.ranged

    @property
    def ended(self) -> bool:
        return self._inner.ended

    @property
    def ended_event(self) -> asyncio.Event:
        return self._inner.ended_event


#: A stage's input as its worker reads it: whole, or after the decode's prefix.
StageSource = StageInput | PrefixSkipped


def stage_source(inp: StageInput, dest: DestinationMsg, pp_rank: int) -> StageSource:
    """`inp` as `dest` asks for it: after the decode's `prefix_pages`. Once the stage's pages
    are all known, refused (InvalidInput) when they are fewer than the prefix (naming
    `prefix_pages`) or not the prefix and `dst_pages` together (naming the field a stage
    without a prefix would be refused by), in request positions; ranges still to come are
    checked as they are read (`_SkippedSignals`)."""
    prefix, num_dst = dest.prefix_pages, len(dest.dst_pages)
    if not prefix:
        return inp
    n = int(inp.src_pages.shape[0])
    if inp.ended and n < prefix:
        raise InvalidInput(
            f"the stage has {n} pages, fewer than the {prefix}-page prefix the decode holds",
            field="prefix_pages",
            pp_rank=pp_rank,
        )
    if inp.ended and n != prefix + num_dst:
        has = request_pages(prefix, num_dst)
        if not inp.ranged:
            raise InvalidInput(
                f"src_pages has {n} pages; {has}", field="dst_pages", pp_rank=pp_rank
            )
        # The fields `check_range` names for a range signalled after the destination.
        raise InvalidInput(
            f"the last range ends at position {n}; {has}",
            field="src_pages" if n > prefix + num_dst else "last_pages",
            pp_rank=pp_rank,
        )
    return PrefixSkipped(inp, prefix, num_dst, pp_rank)


@dataclass
class PrefillHandoff:
    """One handoff as this prefill process sees it."""

    handoff_id: str
    created_at: float
    destination: asyncio.Future[DestinationMsg]
    #: The decode service this id belongs to (ids are unique per decode only): named by the
    #: destination, or by the engine's ready signal before it; None until one does.
    scope: str | None = None
    inputs: dict[int, StageInput] = field(default_factory=dict)
    # Set when a stage's first ready signal (which carries its source pages) arrives.
    input_seen: dict[int, asyncio.Event] = field(default_factory=dict)
    stage_state: dict[int, StageState] = field(default_factory=dict)
    task: asyncio.Task[None] | None = None
    bytes_sent: int = 0
    # The deadline on this host's monotonic clock, measured when the destination arrived.
    deadline_mono: float | None = None
    # Landed stages whose last segment's notice went to the decode: it may complete the handoff
    # on that notice and answer a heartbeat without it before the notice's answer is back here.
    last_notice_sent: set[int] = field(default_factory=set)

    def set_stage(self, rank: int, state: StageState) -> None:
        current = self.stage_state.get(rank, StageState.WAITING)
        self.stage_state[rank] = advance(
            current, state, f"handoff {self.handoff_id!r} stage {rank}"
        )

    def settled(self, ranks: list[int]) -> bool:
        """Every stage of `ranks` has its bytes landed (its arrival notice may be on its way) or
        has ended: none can still write."""
        return all(
            self.stage_state.get(r, StageState.WAITING)
            in (StageState.NOTIFYING, StageState.ARRIVED)
            or self.stage_state.get(r, StageState.WAITING).final
            for r in ranks
        )

    def told(self, ranks: list[int]) -> bool:
        """Every stage of `ranks` is settled or has its last segment's notice with the decode,
        whose answer, not a heartbeat, then says how the stage ended."""
        return all(self.settled([r]) or r in self.last_notice_sent for r in ranks)

    @property
    def known_destination(self) -> DestinationMsg | None:
        """The destination, once delivered. An abort that cancels the handoff's task while it
        waits for one cancels this future too: that is "none", not an error to raise into
        whoever asks (the heartbeats' round, a reconciliation)."""
        d = self.destination
        return d.result() if d.done() and not d.cancelled() else None

    @property
    def decode_url(self) -> str | None:
        dest = self.known_destination
        return dest.decode_url if dest is not None else None


class StageFailed(Exception):
    """Raised inside the TaskGroup after a stage reported its failure, to cancel siblings."""


class Sender(Protocol):
    """Who this process is on the wire: read at each notice (a service may learn its public URL
    after the pipeline is built)."""

    url: str
    incarnation: str
    max_call_s: float
