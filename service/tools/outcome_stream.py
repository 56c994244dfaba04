"""A router's one stream of handoff outcomes from a decode service.

`OutcomeStream` holds ONE `GET /v1/events?types=handoff.completed,handoff.failed,handoff.aborted`
open on a decode and resolves a future per handoff from it, instead of a long poll per handoff
(`RouterClient` uses it; docs/guides/router.md describes the pattern). A handoff's future is
registered (`expect`) before its create is sent, so an outcome that comes before the create's
answer is not lost.

No outcome is lost and no caller waits for ever, whatever the stream does:

- `stream.position` (at open, and after every quarter of the decode's replay buffer of other
  events): a resume point, never an outcome; its id is where a re-open resumes, so a reader
  whose last outcome is long gone from the buffer still resumes without a gap;
- dropped: it is re-opened at once with `Last-Event-ID` (the decode replays what followed);
- `stream.overflow` (this reader fell behind and was cut off): re-opened from the id it had,
  like a drop (the decode replays the rest, or says `stream.gap`);
- `stream.gap` (the replay buffer no longer holds some ids), or a re-open that fails: every
  outstanding handoff is looked up by `fallback` (the per-handoff GET), and so is every handoff
  registered while the stream is down; a look-up that cannot reach the decode is retried until
  the handoff's `patience_s` is spent (a blip does not make a router reschedule);
- a future still unresolved `patience_s` after it was registered is looked up the same way;
- `close()`: every outcome still awaited is answered "unreachable".

Whichever answer comes first resolves the future (and cancels the handoff's look-up); the later
one is ignored. Each caller has its own future, so two callers of one id do not share a fate.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import aiohttp
import msgspec

#: What the stream follows: a handoff's outcome, what a router reschedules on.
OUTCOME_TYPES = "handoff.completed,handoff.failed,handoff.aborted"
#: Seconds between attempts to re-open a stream that the decode refused or could not serve.
RETRY_S = 0.5
#: Longest wait for the stream's first bytes (its headers) before it counts as down.
CONNECT_S = 5.0
#: A stream silent this long is dead (the decode sends a keep-alive every 15 s by default).
SILENT_S = 65.0


@dataclass(frozen=True)
class Outcome:
    state: str  # a handoff state, or "rejected" / "unreachable" when the API said no or nothing
    bytes: int = 0
    error: str | None = None


class _Frame(msgspec.Struct):
    """The fields of an outcome event that an `Outcome` needs (`kvhandoff.pipelines.events`):
    `handoff.completed` carries `bytes`, `.failed` `code` and `reason`, `.aborted` `reason`."""

    handoff_id: str
    role: str
    bytes: int = 0
    code: str | None = None
    reason: str | None = None


_frame = msgspec.json.Decoder(_Frame)


def outcome_of(tag: str, data: bytes) -> tuple[str, Outcome] | None:
    """(handoff id, its outcome) from one outcome event's `data:`; None for another event."""
    state = tag.removeprefix("handoff.")
    if state not in ("completed", "failed", "aborted"):
        return None
    event = _frame.decode(data)
    if event.role != "decode":  # a prefill hosted in the same process speaks for itself only
        return None
    if state == "completed":
        return event.handoff_id, Outcome(state, event.bytes)
    error = f"{event.code}: {event.reason}" if event.code else f"aborted: {event.reason}"
    return event.handoff_id, Outcome(state, 0, error)


class OutcomeStream:
    """Follows one decode's outcomes. `fallback(handoff_id)` answers one handoff's outcome
    another way (a long poll); it must not raise. Start with `start()`, end with `close()`."""

    def __init__(
        self,
        http: aiohttp.ClientSession,
        decode_url: str,
        fallback: Callable[[str], Awaitable[Outcome]],
        *,
        headers: dict[str, str] | None = None,
        patience_s: float = 60.0,
    ) -> None:
        self.http, self.fallback, self.patience_s = http, fallback, patience_s
        self._url = f"{decode_url}/v1/events"
        self._headers = {**(headers or {}), "Accept": "text/event-stream"}
        #: Every caller's own future per handoff (two callers of one id never share one, so
        #: one's refusal or cancellation is not the other's), and when the first registered.
        self._waiting: dict[str, set[asyncio.Future[Outcome]]] = {}
        self._since: dict[str, float] = {}
        #: Of those, the ones whose create was answered (a look-up finds them), and the ones
        #: not created yet that the stream may have missed (looked up once created).
        self._created: set[str] = set()
        self._missed: set[str] = set()
        self._looking: dict[str, asyncio.Task[None]] = {}
        self._up = asyncio.Event()  # set while the stream is open and read
        self._closed = False
        self._last_id: int | None = None
        self._reader: asyncio.Task[None] | None = None
        #: Outstanding handoffs looked up another way since the start: gaps, drops, patience.
        self.fallbacks = 0
        #: `stream.gap`, `stream.overflow` and `stream.position` frames received.
        self.gaps = self.overflows = self.positions = 0

    @property
    def up(self) -> bool:
        """The stream is open: outcomes come on it."""
        return self._up.is_set()

    async def start(self) -> None:
        """Open the stream; returns once it is open, or after CONNECT_S (then it is down, and
        handoffs are looked up by `fallback` until it opens)."""
        if self._reader is None and not self._closed:
            self._reader = asyncio.create_task(self._read_forever())
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(CONNECT_S):
                await self._up.wait()

    async def close(self) -> None:
        """Stop following: every outcome still awaited is answered "unreachable" (nothing
        follows it any more), as is any registered later."""
        self._closed = True
        tasks = [t for t in [self._reader, *self._looking.values()] if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._reader = None
        self._up.clear()
        for handoff_id in list(self._waiting):
            self._resolve(handoff_id, _CLOSED)

    def expect(self, handoff_id: str) -> asyncio.Future[Outcome]:
        """This caller's future of `handoff_id`'s outcome; register it before the handoff is
        created."""
        future: asyncio.Future[Outcome] = asyncio.get_running_loop().create_future()
        if self._closed:
            future.set_result(_CLOSED)
            return future
        if handoff_id not in self._waiting:
            self._waiting[handoff_id] = set()
            self._since[handoff_id] = asyncio.get_running_loop().time()
        self._waiting[handoff_id].add(future)
        future.add_done_callback(lambda done: self._done(handoff_id, done))
        return future

    def forget(self, handoff_id: str, future: asyncio.Future[Outcome]) -> None:
        """Stop waiting on `future` (its create was refused: there is no outcome for this
        caller); another caller's future of the same id keeps waiting."""
        if not future.done():
            future.cancel()

    async def outcome(self, handoff_id: str, future: asyncio.Future[Outcome]) -> Outcome:
        """Once `handoff_id`'s create was answered: wait for its `future` (from `expect`), set
        from the stream, or from `fallback` if the stream cannot tell it (down, a gap) or told
        nothing within `patience_s`."""
        if future.done():  # it ended before the create's answer came
            return future.result()
        self._created.add(handoff_id)
        if handoff_id in self._missed or not self._up.is_set():
            self._look_up(handoff_id)
        try:
            async with asyncio.timeout(self.patience_s):
                return await asyncio.shield(future)
        except TimeoutError:
            self._look_up(handoff_id)
            return await future  # a look-up always answers (its retries end at patience_s)
        except asyncio.CancelledError:
            self.forget(handoff_id, future)  # this caller left: nothing of it stays behind
            raise

    def _done(self, handoff_id: str, future: asyncio.Future[Outcome]) -> None:
        futures = self._waiting.get(handoff_id)
        if futures is None:
            return
        futures.discard(future)
        if futures:
            return
        del self._waiting[handoff_id]
        self._since.pop(handoff_id, None)
        self._created.discard(handoff_id)
        self._missed.discard(handoff_id)
        looking = self._looking.pop(handoff_id, None)
        if looking is not None:
            looking.cancel()  # answered (by the stream): its look-up is no more load on the decode

    # -- the stream ------------------------------------------------------------------------

    async def _read_forever(self) -> None:
        while not self.http.closed:
            # Dropped, refused or garbled: re-open from the last id.
            with contextlib.suppress(aiohttp.ClientError, TimeoutError, ValueError):
                await self._read_once()
            if self._up.is_set():
                self._up.clear()
                continue  # re-open at once; the resume replays what the drop missed
            self._look_up_all()  # could not (re-)open: nothing follows these handoffs
            await asyncio.sleep(RETRY_S)

    async def _read_once(self) -> None:
        headers = dict(self._headers)
        if self._last_id is not None:
            headers["Last-Event-ID"] = str(self._last_id)
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=CONNECT_S, sock_read=SILENT_S)
        async with self.http.get(
            self._url, params={"types": OUTCOME_TYPES}, headers=headers, timeout=timeout
        ) as resp:
            if resp.status != 200:
                await resp.read()
                return
            self._up.set()
            if self._last_id is None:
                # Opened for the first time, or re-opened before the decode told a position:
                # whatever was registered before may have ended unseen.
                self._look_up_all()
            await self._read_frames(resp.content)

    async def _read_frames(self, content: aiohttp.StreamReader) -> None:
        tag, data, event_id = "", b"", None
        async for raw in content:
            line = raw.rstrip(b"\r\n")
            if line:
                name, _, value = line.partition(b":")
                value = value.removeprefix(b" ")
                if name == b"event":
                    tag = value.decode()
                elif name == b"data":
                    data = value
                elif name == b"id":
                    event_id = int(value)
                continue
            if tag:
                self._on_frame(tag, data)
            if event_id is not None:
                self._last_id = event_id
            tag, data, event_id = "", b"", None

    def _on_frame(self, tag: str, data: bytes) -> None:
        if tag == "stream.position":
            # Only its id matters (`_read_frames` keeps it): every outcome up to it was sent.
            self.positions += 1
            return
        if tag == "stream.overflow":
            # This reader fell behind and is cut off at the id it had: the re-open resumes from
            # there and the decode replays the rest (a `stream.gap` if it no longer can).
            self.overflows += 1
            return
        if tag == "stream.gap":
            # Outcomes may be among what this reader will never get: look every one up.
            self.gaps += 1
            self._look_up_all()
            return
        found = outcome_of(tag, data)
        if found is not None:
            self._resolve(*found)

    def _resolve(self, handoff_id: str, outcome: Outcome) -> None:
        for future in list(self._waiting.get(handoff_id, ())):
            if not future.done():
                future.set_result(outcome)

    # -- the way around it -------------------------------------------------------------------

    def _look_up_all(self) -> None:
        for handoff_id in list(self._waiting):
            if handoff_id in self._created:
                self._look_up(handoff_id)
            else:  # a GET now may come before the decode has it: look it up once created
                self._missed.add(handoff_id)

    def _look_up(self, handoff_id: str) -> None:
        if handoff_id in self._looking or handoff_id not in self._waiting or self._closed:
            return
        self.fallbacks += 1
        self._looking[handoff_id] = asyncio.create_task(self._look_up_one(handoff_id))

    async def _look_up_one(self, handoff_id: str) -> None:
        # A decode that does not answer is asked again until the handoff's patience is spent:
        # a blip must not make the router reschedule what the decode may still finish.
        loop = asyncio.get_running_loop()
        deadline = self._since.get(handoff_id, loop.time()) + self.patience_s
        while True:
            try:
                outcome = await self.fallback(handoff_id)
            except Exception as exc:  # noqa: BLE001 - it must not; if it does, its caller hears
                outcome = Outcome("unreachable", 0, f"{type(exc).__name__}: {exc}")
            if outcome.state != "unreachable" or loop.time() + RETRY_S >= deadline:
                break
            await asyncio.sleep(RETRY_S)
        if self._looking.get(handoff_id) is asyncio.current_task():
            del self._looking[handoff_id]
        self._resolve(handoff_id, outcome)


_CLOSED = Outcome("unreachable", 0, "the outcome stream was closed")
