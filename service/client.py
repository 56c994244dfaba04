"""An async client for routers: handoffs, the event stream, webhook endpoints and verification.

Used by routers integrating with a decode service, and by kvhandoff's own tools and tests. It
depends on aiohttp, msgspec, the API's public schemas (`kvhandoff.pipelines.decode`) and the
Standard Webhooks signature code (`kvhandoff.service.webhooks.signatures`) — nothing of the running
service.

    async with KVHandoffClient("http://decode:8100", token=TOKEN) as kv:
        await kv.create("req-1", dst_pages=[7, 8], dst_slot=3)
        view = await kv.wait("req-1")                # terminal HandoffView
        async for ev in kv.events(types=["handoff."]):  # resumes from the last id by itself
            ...

Errors from the API raise `ApiError` carrying the problem+json members (`code`, `field`, ...).
"""

from __future__ import annotations

import asyncio
import builtins
import json
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any

import aiohttp
import msgspec

from kvhandoff.pipelines.decode.views import HandoffPage, HandoffView
from kvhandoff.service.webhooks.signatures import SignatureError, verify

__all__ = [
    "ApiError",
    "KVHandoffClient",
    "SignatureError",
    "StreamEvent",
    "verify_webhook",
]

TERMINAL = frozenset({"completed", "failed", "aborted"})
#: One long poll of `GET /v1/handoffs/{id}?wait_s=` (the service allows at most 60).
LONG_POLL_S = 30.0
_view = msgspec.json.Decoder(HandoffView)
_page = msgspec.json.Decoder(HandoffPage)


class ApiError(Exception):
    """The service answered with an error: `status`, and the problem body's `code`, `detail`
    and extension members (`field`, `layer_id`, `holder`, ...) in `problem`."""

    def __init__(self, status: int, problem: dict[str, Any]) -> None:
        self.status = status
        self.problem = problem
        self.code = str(problem.get("code", status))
        self.detail = str(problem.get("detail", ""))
        super().__init__(f"{status} {self.code}: {self.detail}")


@dataclass(frozen=True)
class StreamEvent:
    """One Server-Sent Event: `type` (the `event:` tag, e.g. `handoff.completed`, or
    `stream.gap` / `stream.overflow`), `id` (the sequence number) and `data` (parsed JSON).
    (`stream.position` frames are not yielded: `events()` resumes from them by itself.)"""

    type: str
    id: int | None
    data: Any


@dataclass
class _SseParser:
    """The text/event-stream format: fields until a blank line; `:` lines are comments."""

    event: str = "message"
    data: list[str] = field(default_factory=list)
    id: str | None = None
    retry_ms: int | None = None

    def feed(self, line: str) -> StreamEvent | None:
        if not line:
            if not self.data:
                self.event = "message"
                return None
            text = "\n".join(self.data)
            try:
                data: Any = json.loads(text)
            except ValueError:
                data = text
            out = StreamEvent(
                self.event, int(self.id) if self.id and self.id.isdigit() else None, data
            )
            self.event, self.data = "message", []
            return out
        if line.startswith(":"):
            return None
        name, _, value = line.partition(":")
        value = value.removeprefix(" ")
        if name == "event":
            self.event = value
        elif name == "data":
            self.data.append(value)
        elif name == "id" and "\0" not in value:
            self.id = value
        elif name == "retry" and value.isdigit():
            self.retry_ms = int(value)
        return None


class KVHandoffClient:
    """Talks to one decode service. Use as an async context manager (or call `close()`); pass
    `session` to share an `aiohttp.ClientSession` (then it is not closed here)."""

    def __init__(
        self,
        base_url: str,
        *,
        token: str | None = None,
        session: aiohttp.ClientSession | None = None,
        timeout_s: float = 30.0,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self._headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._own = session is None
        self._session = session
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)

    async def __aenter__(self) -> KVHandoffClient:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    async def close(self) -> None:
        if self._own and self._session is not None:
            await self._session.close()
            self._session = None

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None:
            self._session = aiohttp.ClientSession()
        return self._session

    # -- handoffs ----------------------------------------------------------------------------

    async def create(
        self,
        handoff_id: str,
        dst_pages: Sequence[int],
        *,
        dst_slot: int | None = None,
        dst_slots: Mapping[str, int] | None = None,
        dst_aux: int | None = None,
        prefix_pages: int = 0,
        prefill: Sequence[str] = (),
        deadline_s: float | None = None,
        verify: bool | None = None,
        metadata: Mapping[str, Any] | None = None,
        callback_url: str | None = None,
    ) -> HandoffView:
        """`POST /v1/handoffs`; repeating the same call returns the same handoff."""
        body: dict[str, Any] = {"id": handoff_id, "dst_pages": list(dst_pages)}
        optional = {
            "dst_slot": dst_slot,
            "dst_slots": dict(dst_slots) if dst_slots else None,
            "dst_aux": dst_aux,
            "prefix_pages": prefix_pages or None,
            "prefill": list(prefill) or None,
            "deadline_s": deadline_s,
            "verify": verify,
            "metadata": dict(metadata) if metadata else None,
            "callback_url": callback_url,
        }
        body.update({k: v for k, v in optional.items() if v is not None})
        return _view.decode(await self._call("POST", "/v1/handoffs", body))

    async def get(self, handoff_id: str) -> HandoffView:
        return _view.decode(await self._call("GET", f"/v1/handoffs/{handoff_id}"))

    async def wait(self, handoff_id: str, timeout_s: float | None = None) -> HandoffView:
        """Long-poll until the handoff is terminal (or `timeout_s` passed: then as it is)."""
        end = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            left = (
                LONG_POLL_S if end is None else max(0.0, min(LONG_POLL_S, end - time.monotonic()))
            )
            raw = await self._call(
                "GET",
                f"/v1/handoffs/{handoff_id}",
                params={"wait_s": f"{left:.3f}"} if left > 0 else None,
                timeout_s=left + 30.0,
            )
            view = _view.decode(raw)
            if view.state.value in TERMINAL or (end is not None and time.monotonic() >= end):
                return view

    async def list(
        self, state: str | None = None, *, page_size: int = 100
    ) -> AsyncIterator[HandoffView]:
        """Every handoff (of `state`) the decode service knows, those of its earlier lives too (from
        its records), following the pagination cursor."""
        cursor = 0
        while True:
            params = {"limit": str(page_size), "cursor": str(cursor)}
            if state is not None:
                params["state"] = state
            page = _page.decode(await self._call("GET", "/v1/handoffs", params=params))
            for item in page.items:
                yield item
            if page.next_cursor is None:
                return
            cursor = page.next_cursor

    async def abort(self, handoff_id: str) -> HandoffView:
        """`DELETE /v1/handoffs/{id}`: answers once no write of it can still land."""
        return _view.decode(await self._call("DELETE", f"/v1/handoffs/{handoff_id}"))

    # -- webhooks ----------------------------------------------------------------------------

    async def register_webhook(
        self, url: str, types: Sequence[str] = (), *, secret: str | None = None
    ) -> dict[str, Any]:
        """Register an endpoint; the answer's `secret` is shown this once."""
        body: dict[str, Any] = {"url": url, "types": list(types)}
        if secret is not None:
            body["secret"] = secret
        out: dict[str, Any] = json.loads(await self._call("POST", "/v1/webhooks", body))
        return out

    async def deliveries(
        self, endpoint_id: str, state: str | None = None
    ) -> builtins.list[dict[str, Any]]:
        params = {"state": state} if state else None
        raw = await self._call("GET", f"/v1/webhooks/{endpoint_id}/deliveries", params=params)
        items: builtins.list[dict[str, Any]] = json.loads(raw)["items"]
        return items

    # -- events ------------------------------------------------------------------------------

    async def events(
        self,
        *,
        types: Sequence[str] = (),
        handoffs: Sequence[str] = (),
        last_event_id: int | None = None,
        path: str = "/v1/events",
        reconnect_s: float = 0.5,
    ) -> AsyncIterator[StreamEvent]:
        """`GET /v1/events` as an endless async iterator. A dropped connection is re-opened with
        `Last-Event-ID` = the last id seen, so nothing is missed or repeated; what the service
        no longer holds arrives as an explicit `stream.gap` event. A filtered stream's
        `stream.position` frames only move that id (past the events it does not carry), so
        they are kept here, not yielded."""
        params: list[tuple[str, str]] = [("handoff", h) for h in handoffs]
        if types:
            params.append(("types", ",".join(types)))
        last = last_event_id
        delay_s = reconnect_s
        while True:
            headers = {**self._headers, "Accept": "text/event-stream"}
            if last is not None:
                headers["Last-Event-ID"] = str(last)
            parser = _SseParser()
            try:
                async with self.session.get(
                    self.base_url + path,
                    params=params,
                    headers=headers,
                    timeout=aiohttp.ClientTimeout(total=None, sock_connect=10),
                ) as resp:
                    if resp.status != 200:
                        raise ApiError(resp.status, _problem(await resp.read(), resp.status))
                    async for raw in resp.content:
                        event = parser.feed(raw.decode().rstrip("\r\n"))
                        if event is None:
                            continue
                        if event.id is not None:
                            last = event.id
                        if event.type != "stream.position":
                            yield event
            except (aiohttp.ClientPayloadError, aiohttp.ClientConnectionError, TimeoutError):
                pass  # dropped: reconnect below from `last`
            if parser.retry_ms is not None:
                delay_s = parser.retry_ms / 1000
            await asyncio.sleep(delay_s)

    # -- plumbing ----------------------------------------------------------------------------

    async def _call(
        self,
        method: str,
        path: str,
        body: Any = None,
        *,
        params: Mapping[str, str] | None = None,
        timeout_s: float | None = None,
    ) -> bytes:
        timeout = self._timeout if timeout_s is None else aiohttp.ClientTimeout(total=timeout_s)
        async with self.session.request(
            method,
            self.base_url + path,
            json=body,
            params=params,
            headers=self._headers,
            timeout=timeout,
        ) as resp:
            raw = await resp.read()
            if resp.status >= 400:
                raise ApiError(resp.status, _problem(raw, resp.status))
            return raw


def _problem(raw: bytes, status: int) -> dict[str, Any]:
    try:
        body = json.loads(raw)
    except ValueError:
        return {"status": status, "detail": raw[:300].decode("utf-8", "replace")}
    return body if isinstance(body, dict) else {"status": status, "detail": str(body)}


def verify_webhook(
    headers: Mapping[str, str], body: bytes, secret: str, *, now: float | None = None
) -> dict[str, Any]:
    """Check a received webhook (Standard Webhooks: `webhook-id`, `webhook-timestamp` within 5
    minutes, a matching `v1` signature) and return its payload `{type, timestamp, data}`.
    Raises `SignatureError` naming what is wrong; `body` must be the raw bytes received."""
    verify(headers, body, secret, now=time.time() if now is None else now)
    payload: dict[str, Any] = json.loads(body)
    return payload
