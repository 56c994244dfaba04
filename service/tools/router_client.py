"""One handoff driven over HTTP the way a router and the prefill engines drive it.

`RouterClient.handoff` creates the handoff on the decode service and, at the same time, signals
every PP stage ready on the prefill service hosting it (an engine computes while the router
creates; a prefill holds a ready until its destination comes), then waits for the outcome. It
follows outcomes on ONE event stream per decode (`kvhandoff.service.tools.outcome_stream`), or
with `follow="poll"` by a long poll of `GET /v1/handoffs/{id}` per handoff. Used by
`kvhandoff demo`, `kvhandoff bench handoff` and `make bench` against a `LocalDeployment`.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Sequence
from types import TracebackType
from typing import Any, Literal

import aiohttp

from kvhandoff.service.api.batches import MAX_BATCH_ITEMS
from kvhandoff.service.testing.deployment import LocalDeployment
from kvhandoff.service.tools.outcome_stream import Outcome, OutcomeStream
from kvhandoff.service.tools.turn_batch import TurnBatcher

__all__ = ["TERMINAL", "WAIT_S", "Outcome", "RouterClient"]

TERMINAL = frozenset({"completed", "failed", "aborted"})
#: One long poll of `GET /v1/handoffs/{id}`; the client waits this plus a margin.
WAIT_S = 10.0


class RouterClient:
    """Drives handoffs through one `LocalDeployment`. Close it (or use `async with`) to end its
    event stream; a stream left open ends with its `http` session."""

    def __init__(
        self,
        http: aiohttp.ClientSession,
        dep: LocalDeployment,
        *,
        verify: bool = False,
        follow: Literal["stream", "poll"] = "stream",
        coalesce: bool = False,
    ) -> None:
        """`coalesce` (an attribute too, to switch between handoffs): the creates, and each
        prefill service's stage readies, issued in one turn of the loop leave as one batch
        request (`POST /v1/handoff-batches`, `POST /v1/stages/ready`)."""
        self.http, self.dep, self.verify = http, dep, verify
        self.timeout = aiohttp.ClientTimeout(total=WAIT_S + 20)
        self._stage_urls = [dep.url_of_stage(r) for r in range(dep.pp_size)]
        self._stream = (
            OutcomeStream(http, dep.decode_url, self._polled) if follow == "stream" else None
        )
        self._started: asyncio.Task[None] | None = None
        self.coalesce = coalesce
        self.creates = self._batcher(f"{dep.decode_url}/v1/handoff-batches")
        self.readies = {
            url: self._batcher(f"{url}/v1/stages/ready") for url in dict.fromkeys(self._stage_urls)
        }

    def _batcher(self, url: str) -> TurnBatcher[dict[str, Any], dict[str, Any]]:
        async def send(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
            async with self.http.post(url, json={"items": items}, timeout=self.timeout) as resp:
                if resp.status == 200:
                    results: list[dict[str, Any]] = (await resp.json())["items"]
                    return results
                problem = await _problem(resp)
            if resp.status == 413 and len(items) > 1:
                # Over the service's body bound (long-context items): halves, one after the
                # other (in order), rather than every item refused.
                half = len(items) // 2
                return [*await send(items[:half]), *await send(items[half:])]
            # The whole batch refused (it never is for an item's fault): each its own.
            item_problem = {"code": problem["code"], "detail": problem["reason"]}
            return [{"status": resp.status, "problem": item_problem}] * len(items)

        expected = (aiohttp.ClientError, TimeoutError)
        return TurnBatcher(send, MAX_BATCH_ITEMS, expected)

    @property
    def fallbacks(self) -> int:
        """Handoffs whose outcome the stream could not tell (looked up by GET) so far."""
        return 0 if self._stream is None else self._stream.fallbacks

    async def __aenter__(self) -> RouterClient:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    async def close(self) -> None:
        if self._stream is not None:
            await self._stream.close()
        for batcher in [self.creates, *self.readies.values()]:
            await batcher.close()

    async def handoff(
        self,
        handoff_id: str,
        src_pages: Sequence[int],
        dst_pages: Sequence[int],
        src_slot: int | None,
        dst_slot: int | None,
    ) -> Outcome:
        """Run one handoff to its end; never raises for what the services answer."""
        try:
            return await self._handoff(handoff_id, src_pages, dst_pages, src_slot, dst_slot)
        except (aiohttp.ClientError, TimeoutError) as exc:
            return Outcome("unreachable", 0, f"{type(exc).__name__}: {exc}")

    async def _handoff(
        self,
        handoff_id: str,
        src_pages: Sequence[int],
        dst_pages: Sequence[int],
        src_slot: int | None,
        dst_slot: int | None,
    ) -> Outcome:
        stream = self._stream
        if stream is None:
            return await self._polled_handoff(handoff_id, src_pages, dst_pages, src_slot, dst_slot)
        if self._started is None:
            self._started = asyncio.ensure_future(stream.start())
        await asyncio.shield(self._started)
        # Registered before the create: an outcome that comes before its answer is kept.
        future = stream.expect(handoff_id)
        try:
            ended, refused = await self._create_and_signal(
                handoff_id, src_pages, dst_pages, src_slot, dst_slot
            )
        except BaseException:
            stream.forget(handoff_id, future)
            raise
        if ended is not None:  # refused, or re-driven after its end (its event long gone)
            stream.forget(handoff_id, future)
        else:
            ended = await stream.outcome(handoff_id, future)
        return _with_refusal(ended, refused)

    async def _create_and_signal(
        self,
        handoff_id: str,
        src_pages: Sequence[int],
        dst_pages: Sequence[int],
        src_slot: int | None,
        dst_slot: int | None,
    ) -> tuple[Outcome | None, list[str]]:
        """The create and every stage's ready, sent at once (as an engine computes while the
        router creates): what `create` answers, and the readies' refusals. A refused create
        leaves its readies held on the prefill until their deadline (counted against the
        prefill's bound on handoffs awaiting a destination), as an engine's would be; neither
        call is left running unobserved when the other raises."""
        created, signalled = await asyncio.gather(
            self.create(handoff_id, dst_pages, dst_slot),
            self.signal_stages(handoff_id, src_pages, src_slot),
            return_exceptions=True,
        )
        for result in (created, signalled):
            if isinstance(result, BaseException):
                raise result
        assert not isinstance(created, BaseException) and not isinstance(signalled, BaseException)
        return created, signalled

    async def _polled_handoff(
        self,
        handoff_id: str,
        src_pages: Sequence[int],
        dst_pages: Sequence[int],
        src_slot: int | None,
        dst_slot: int | None,
    ) -> Outcome:
        ended, refused = await self._create_and_signal(
            handoff_id, src_pages, dst_pages, src_slot, dst_slot
        )
        return _with_refusal(ended or await self._polled(handoff_id), refused)

    async def create(
        self, handoff_id: str, dst_pages: Sequence[int], dst_slot: int | None
    ) -> Outcome | None:
        """`POST /v1/handoffs`: None once accepted, the "rejected" outcome when refused, the
        outcome itself when it is accepted already ended (a re-drive: 200 with a terminal
        view, whose outcome event the stream will not repeat)."""
        body: dict[str, Any] = {
            "id": handoff_id,
            "prefill": self.dep.prefill_urls,
            "dst_pages": list(dst_pages),
            "verify": self.verify,
        }
        if dst_slot is not None:
            body["dst_slot"] = dst_slot
        if self.coalesce:
            result = await self.creates.submit(body)
            if result["status"] in (200, 201):
                return _ended(result.get("view"))
            return Outcome("rejected", 0, _item_problem_text(result))
        url = f"{self.dep.decode_url}/v1/handoffs"
        async with self.http.post(url, json=body, timeout=self.timeout) as resp:
            if resp.status not in (200, 201):  # 200: this very request was already accepted
                return Outcome("rejected", 0, await problem_text(resp))
            if resp.status == 201:
                await resp.read()
                return None
            view: dict[str, Any] = await resp.json()
        return _ended(view)

    async def _polled(self, handoff_id: str) -> Outcome:
        """The outcome by long poll (never raises: "unreachable" when nothing answers)."""
        try:
            view = await self.until_terminal(handoff_id)
        except (aiohttp.ClientError, TimeoutError) as exc:
            return Outcome("unreachable", 0, f"{type(exc).__name__}: {exc}")
        return _outcome_of_view(view)

    async def signal_stages(
        self, handoff_id: str, src_pages: Sequence[int], src_slot: int | None
    ) -> list[str]:
        """Signal every stage ready, all at once, each with all its layers and pages (an
        engine's one completion per stage); the refusals' texts. Benchmarks override it to
        signal by layer or by page range."""
        ready: dict[str, Any] = {"src_pages": list(src_pages)}
        if src_slot is not None:
            ready["src_slot"] = src_slot
        signals = (self._ready(handoff_id, r, ready) for r in range(len(self._stage_urls)))
        return [p for p in await asyncio.gather(*signals) if p]

    async def _ready(self, handoff_id: str, rank: int, body: dict[str, Any]) -> str | None:
        """Signal stage `rank` ready; the problem's text if the prefill service refused."""
        url = f"{self._stage_urls[rank]}/v1/handoffs/{handoff_id}/stages/{rank}/ready"
        try:
            if self.coalesce:
                result = await self.readies[self._stage_urls[rank]].submit(
                    {"handoff_id": handoff_id, "pp_rank": rank, **body}
                )
                return None if result["status"] == 202 else _item_problem_text(result)
            async with self.http.post(url, json=body, timeout=self.timeout) as resp:
                return None if resp.status == 202 else await problem_text(resp)
        except aiohttp.ClientError as exc:
            # The handoff exists: the decode service fails it (peer timeout, deadline); wait.
            return f"stage {rank}: {type(exc).__name__}: {exc}"

    async def until_terminal(self, handoff_id: str) -> dict[str, Any]:
        """Long-poll the handoff's view until its state is terminal (a view with state
        "unreachable" when the decode answers with an error)."""
        # Bounded by the handoff's deadline: the decode service fails it then at the latest.
        url = f"{self.dep.decode_url}/v1/handoffs/{handoff_id}"
        while True:
            async with self.http.get(
                url, params={"wait_s": str(WAIT_S)}, timeout=self.timeout
            ) as resp:
                if resp.status != 200:
                    return {"state": "unreachable", "bytes": 0, "error": await _problem(resp)}
                view: dict[str, Any] = await resp.json()
            if view["state"] in TERMINAL:
                return view


def _with_refusal(ended: Outcome, refused: list[str]) -> Outcome:
    """The outcome, naming the first refused ready as its reason when the handoff did not
    complete and says no reason of its own (the same rule however the outcome was followed)."""
    if ended.error is None and ended.state not in ("completed", "rejected") and refused:
        return Outcome(ended.state, ended.bytes, refused[0])
    return ended


async def _problem(resp: aiohttp.ClientResponse) -> dict[str, str]:
    """A problem+json body as {"code", "reason"} (or the raw text if it is not one)."""
    text = await resp.text()
    try:
        body = json.loads(text)
        return {"code": str(body.get("code", resp.status)), "reason": str(body["detail"])}
    except (ValueError, KeyError, AttributeError):
        return {"code": str(resp.status), "reason": text[:300]}


def _outcome_of_view(view: dict[str, Any]) -> Outcome:
    error = view.get("error")
    reason = f"{error['code']}: {error['reason']}" if error else None
    return Outcome(view["state"], int(view.get("bytes", 0)), reason)


def _ended(view: dict[str, Any] | None) -> Outcome | None:
    """The outcome of an accepted create's view if it has ended already, else None."""
    if view is None or view.get("state") not in TERMINAL:
        return None
    return _outcome_of_view(view)


def _item_problem_text(result: dict[str, Any]) -> str:
    """A batch item's problem as `problem_text` gives a single route's."""
    problem = result.get("problem") or {}
    return f"{problem.get('code', result['status'])}: {problem.get('detail', '')}"


async def problem_text(resp: aiohttp.ClientResponse) -> str:
    problem = await _problem(resp)
    return f"{problem['code']}: {problem['reason']}"
