"""One handoff driven over HTTP the way a router and the prefill engines drive it.

`RouterClient.handoff` creates the handoff on the decode service, signals every PP stage ready
on the prefill service hosting it, and long-polls `GET /v1/handoffs/{id}` until the state is
terminal. Used by `kvhandoff demo` and `kvhandoff bench handoff` against a `LocalDeployment`.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import aiohttp

from kvhandoff.service.testing.deployment import LocalDeployment

TERMINAL = frozenset({"completed", "failed", "aborted"})
#: One long poll of `GET /v1/handoffs/{id}`; the client waits this plus a margin.
WAIT_S = 10.0


@dataclass(frozen=True)
class Outcome:
    state: str  # a handoff state, or "rejected" / "unreachable" when the API said no or nothing
    bytes: int = 0
    error: str | None = None


class RouterClient:
    def __init__(
        self, http: aiohttp.ClientSession, dep: LocalDeployment, *, verify: bool = False
    ) -> None:
        self.http, self.dep, self.verify = http, dep, verify
        self.timeout = aiohttp.ClientTimeout(total=WAIT_S + 20)
        self._stage_urls = [dep.url_of_stage(r) for r in range(dep.pp_size)]

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
        body: dict[str, Any] = {
            "id": handoff_id,
            "prefill": self.dep.prefill_urls,
            "dst_pages": list(dst_pages),
            "verify": self.verify,
        }
        if dst_slot is not None:
            body["dst_slot"] = dst_slot
        url = f"{self.dep.decode_url}/v1/handoffs"
        async with self.http.post(url, json=body, timeout=self.timeout) as resp:
            if resp.status not in (200, 201):  # 200: this very request was already accepted
                return Outcome("rejected", 0, await problem_text(resp))
        refused = await self.signal_stages(handoff_id, src_pages, src_slot)
        view = await self.until_terminal(handoff_id)
        error = view.get("error")
        reason = f"{error['code']}: {error['reason']}" if error else None
        return Outcome(view["state"], int(view["bytes"]), reason or next(iter(refused), None))

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


async def _problem(resp: aiohttp.ClientResponse) -> dict[str, str]:
    """A problem+json body as {"code", "reason"} (or the raw text if it is not one)."""
    text = await resp.text()
    try:
        body = json.loads(text)
        return {"code": str(body.get("code", resp.status)), "reason": str(body["detail"])}
    except (ValueError, KeyError, AttributeError):
        return {"code": str(resp.status), "reason": text[:300]}


async def problem_text(resp: aiohttp.ClientResponse) -> str:
    problem = await _problem(resp)
    return f"{problem['code']}: {problem['reason']}"
