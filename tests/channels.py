"""A peer channel opened by hand (`kvhandoff.service.http.peer_channel`), as a holder of the peer
secret speaking for `sender` would: the signed handshake, the hello checked, the session key
derived, then frames of the test's choosing. Used by the channel's unit tests and by the trust tests
against real processes."""

from __future__ import annotations

import json
from typing import Any

import aiohttp
import msgspec

from kvhandoff.pipelines.peer_calls import CHANNEL
from kvhandoff.service.http.peer_channel import HELLO_STATUS, Hello, session
from kvhandoff.service.http.peer_signing import NONCE_HEADER, Signer


class OpenedByHand:
    def __init__(self, ws: aiohttp.ClientWebSocketResponse, key: bytes) -> None:
        self.ws = ws
        self.out, self.in_ = session(key)

    @classmethod
    async def open(
        cls,
        http: aiohttp.ClientSession,
        url: str,
        life: str,
        *,
        secret: str,
        sender: str,
        to: str | None = None,
    ) -> OpenedByHand:
        """A channel to `url` in life `life`, its handshake signed for `to` (default `url`)."""
        signer = Signer(secret, sender)
        headers = signer.headers(
            "GET", CHANNEL.path, b"", recipient=to or url, recipient_incarnation=life
        )
        ws = await http.ws_connect(url + CHANNEL.path, headers=headers)
        hello = msgspec.json.decode((await ws.receive()).data, type=Hello)
        nonce = headers[NONCE_HEADER]
        vouched = signer.check_answer(nonce, url, HELLO_STATUS, hello.signed, hello.nonce.encode())
        assert vouched == life, (vouched, life)
        return cls(ws, signer.channel_key(nonce, hello.nonce, url, life))

    def frame(self, path: str, body: Any, ident: int = 1) -> bytes:
        """The next frame of this channel: one call of `path` with `body`."""
        return self.out.seal(json.dumps([{"id": ident, "path": path, "body": body}]).encode())

    async def answers(self) -> list[Any]:
        message = await self.ws.receive()
        assert message.type == aiohttp.WSMsgType.BINARY, message
        return list(json.loads(self.in_.open(message.data)))

    async def refused(self) -> None:
        """The recipient closed the channel over the last frame (a policy violation)."""
        message = await self.ws.receive()
        assert message.type in (aiohttp.WSMsgType.CLOSE, aiohttp.WSMsgType.CLOSED), message
        assert self.ws.close_code == aiohttp.WSCloseCode.POLICY_VIOLATION
