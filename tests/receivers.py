"""A router's webhook endpoint for tests: a real aiohttp server on 127.0.0.1 that records every
request and answers as the test scripts it (a status, `Retry-After`, or holding the answer until
an event is set). It can go down and come back on the same port. Used by the unit tests of the
webhook routes and dispatcher and by the integration tests; signatures are checked with the
`standardwebhooks` package, never with kvhandoff's own code.
"""

from __future__ import annotations

import asyncio
import json
import socket
import weakref
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web
from standardwebhooks.webhooks import Webhook

#: Longest a test waits for a delivery before failing instead of hanging: far beyond what a
#: delivery takes, even on a busy machine (it bounds failures, not successes).
WAIT_S = 30.0


@dataclass(frozen=True)
class Received:
    headers: dict[str, str]
    body: bytes

    @property
    def webhook_id(self) -> str:
        return self.headers["webhook-id"]

    @property
    def payload(self) -> dict[str, Any]:
        out: dict[str, Any] = json.loads(self.body)
        return out

    @property
    def type(self) -> str:
        return str(self.payload["type"])

    @property
    def handoff_id(self) -> str:
        return str(self.payload["data"]["handoff_id"])

    def verified(self, secret: str) -> dict[str, Any]:
        """The payload, after `standardwebhooks` accepted the signature (raises otherwise)."""
        out: dict[str, Any] = Webhook(secret).verify(self.body, self.headers)
        return out


@dataclass
class Answer:
    status: int = 200
    headers: dict[str, str] = field(default_factory=dict)
    hold: asyncio.Event | None = None  # answer only once this is set


class WebhookReceiver:
    def __init__(self) -> None:
        self.received: list[Received] = []
        self.script: deque[Answer] = deque()  # answers for the next requests; then 200
        self.default = Answer()
        #: When set, decides every answer from the request (overrides `script`).
        self.respond: Callable[[Received], Answer] | None = None
        self._changed = asyncio.Condition()
        self._runner: web.AppRunner | None = None
        # The port is held for the receiver's whole life by a socket that is bound but never
        # listens: while the receiver is down, connections are refused, and no other process
        # can take the port (a port picked, released and bound later may be taken meanwhile by
        # any process on the machine, an outgoing connection included). The server binds the
        # same port beside it (both set SO_REUSEADDR; only the server listens).
        hold = socket.socket()
        hold.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        hold.bind(("127.0.0.1", 0))
        weakref.finalize(self, hold.close)
        self.port = int(hold.getsockname()[1])

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/hook"

    async def start(self) -> WebhookReceiver:
        app = web.Application()
        app.router.add_post("/hook", self._handle)
        self._runner = web.AppRunner(app, handle_signals=False)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", self.port, reuse_address=True).start()
        return self

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def _handle(self, request: web.Request) -> web.Response:
        got = Received(dict(request.headers), await request.read())
        if self.respond is not None:
            answer = self.respond(got)
        else:
            answer = self.script.popleft() if self.script else self.default
        async with self._changed:
            self.received.append(got)
            self._changed.notify_all()
        if answer.hold is not None:
            await answer.hold.wait()
        return web.Response(status=answer.status, headers=answer.headers)

    async def wait_for(
        self, predicate: Callable[[list[Received]], bool], timeout_s: float = WAIT_S
    ) -> list[Received]:
        async with asyncio.timeout(timeout_s), self._changed:
            await self._changed.wait_for(lambda: predicate(self.received))
        return list(self.received)

    async def count(self, n: int, timeout_s: float = WAIT_S) -> list[Received]:
        return await self.wait_for(lambda r: len(r) >= n, timeout_s)
