"""The egress barrier: what runs before anything leaves the process.

A decode's records commit in groups (`kvhandoff.service.storage`): a write joins an open
transaction that commits on the loop's next turn. So that no one outside learns of a state
before it is on disk, every way out of the process awaits `Egress.before()` first — the answer
middleware before a response goes out (`kvhandoff.service.http.auth.answer_middleware`), the peer
client before a request (`kvhandoff.service.http.peer_client.PeerClient`), an SSE stream before a
frame (`kvhandoff.service.api.events`), the webhook dispatcher before a delivery. Each hook is cheap
when nothing is pending; when something is, every caller of one turn of the loop waits for the one
commit.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from aiohttp import web


class Egress:
    def __init__(self) -> None:
        self._hooks: list[Callable[[], Awaitable[None]]] = []

    def add(self, hook: Callable[[], Awaitable[None]]) -> None:
        self._hooks.append(hook)

    def remove(self, hook: Callable[[], Awaitable[None]]) -> None:
        self._hooks.remove(hook)

    async def before(self) -> None:
        for hook in self._hooks:
            await hook()


EGRESS = web.AppKey("egress", Egress)
