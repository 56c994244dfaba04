"""A router's one stream of handoff outcomes from a decode service.

`OutcomeStream` holds ONE `GET /v1/events?types=handoff.completed,handoff.failed,handoff.aborted`
open on a decode and resolves a future per handoff from it, instead of a long poll per handoff
(`RouterClient` uses it; docs/guides/router.md describes the pattern). A handoff's future is
registered (`expect`) before its create is sent, so an outcome that comes before the create's
answer is not lost.

No outcome is lost and no caller waits for ever, whatever the stream does:

- dropped: it is re-opened at once with `Last-Event-ID` (the decode replays what followed);
- `stream.gap` (the replay buffer no longer holds some ids) or `stream.overflow` (this reader
  fell behind and was cut off), or a re-open that fails: every outstanding handoff is looked up
  by `fallback` (the per-handoff GET), and so is every handoff registered while the stream is
  down;
- a future still unresolved `patience_s` after it was registered is looked up the same way.

Whichever answer comes first resolves the future; the later one is ignored.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

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
        self._waiting: dict[str, asyncio.Future[Outcome]] = {}
        #: Of those, the ones whose create was answered (a look-up finds them), and the ones
        #: not created yet that the stream may have missed (looked up once created).
        self._created: set[str] = set()
        self._missed: set[str] = set()
        self._looking: set[str] = set()
        self._tasks: set[asyncio.Task[Any]] = set()
        self._up = asyncio.Event()  # set while the stream is open and read
        self._last_id: int | None = None
        self._reader: asyncio.Task[None] | None = None
        #: Outstanding handoffs looked up another way since the start: gaps, overflows, drops.
        self.fallbacks = 0
        #: `stream.gap` and `stream.overflow` frames received.
        self.gaps = self.overflows = 0

    @property
    def up(self) -> bool:
        """The stream is open: outcomes come on it."""
        return self._up.is_set()

    async def start(self) -> None:
        """Open the stream; returns once it is open, or after CONNECT_S (then it is down, and
        handoffs are looked up by `fallback` until it opens)."""
        if self._reader is None:
            self._reader = asyncio.create_task(self._read_forever())
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(CONNECT_S):
                await self._up.wait()

    async def close(self) -> None:
        tasks = [t for t in [self._reader, *self._tasks] if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._reader = None

    def expect(self, handoff_id: str) -> asyncio.Future[Outcome]:
        """The future of `handoff_id`'s outcome; register it before the handoff is created."""
        future = self._waiting.get(handoff_id)
        if future is None:
            future = self._waiting[handoff_id] = asyncio.get_running_loop().create_future()
            future.add_done_callback(lambda _: self._done(handoff_id))
        return future

    def forget(self, handoff_id: str) -> None:
        """Stop waiting for `handoff_id` (its create was refused: there is no outcome)."""
        future = self._waiting.get(handoff_id)
        if future is not None and not future.done():
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
            return await future

    def _done(self, handoff_id: str) -> None:
        self._waiting.pop(handoff_id, None)
        self._created.discard(handoff_id)
        self._missed.discard(handoff_id)

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
                # Opened for the first time, or after a resume it could not make: whatever
                # was registered before may have ended unseen.
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
        if tag in ("stream.gap", "stream.overflow"):
            if tag == "stream.gap":
                self.gaps += 1
            else:
                self.overflows += 1
            # Outcomes may be among what this reader will never get: look every one up.
            self._look_up_all()
            return
        found = outcome_of(tag, data)
        if found is not None:
            self._resolve(*found)

    def _resolve(self, handoff_id: str, outcome: Outcome) -> None:
        future = self._waiting.get(handoff_id)
        if future is not None and not future.done():
            future.set_result(outcome)

    # -- the way around it -------------------------------------------------------------------

    def _look_up_all(self) -> None:
        for handoff_id in list(self._waiting):
            if handoff_id in self._created:
                self._look_up(handoff_id)
            else:  # a GET now may come before the decode has it: look it up once created
                self._missed.add(handoff_id)

    def _look_up(self, handoff_id: str) -> None:
        if handoff_id in self._looking or handoff_id not in self._waiting:
            return
        self._looking.add(handoff_id)
        self.fallbacks += 1
        task = asyncio.create_task(self._look_up_one(handoff_id))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _look_up_one(self, handoff_id: str) -> None:
        try:
            outcome = await self.fallback(handoff_id)
        finally:
            self._looking.discard(handoff_id)
        self._resolve(handoff_id, outcome)
