"""The webhook sender against a raw HTTP/1.1 server whose answers the test writes byte for byte:
chunked and closing answers, reuse of kept-alive connections, oversized and malformed answers."""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import AsyncIterator

import pytest

from kvhandoff.service.webhooks.sender import MAX_BODY_BYTES, Sender, SendError
from kvhandoff.service.webhooks.targets import TargetPolicy


class RawServer:
    """Answers each request with the next scripted bytes; `None` closes without answering."""

    def __init__(self) -> None:
        self.script: deque[bytes | None] = deque()
        self.requests: list[bytes] = []
        self.connections = 0
        self.server: asyncio.Server | None = None

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = next(
                    int(line.split(b":")[1])
                    for line in head.split(b"\r\n")
                    if line.lower().startswith(b"content-length:")
                )
                self.requests.append(head + await reader.readexactly(length))
                answer = (
                    self.script.popleft() if self.script else b"HTTP/1.1 204 No Content\r\n\r\n"
                )
                if answer is None:
                    break
                writer.write(answer)
                await writer.drain()
                if b"Connection: close" in answer:
                    break
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    @property
    def url(self) -> str:
        assert self.server is not None
        return f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}/hook?x=1"


@pytest.fixture
async def server() -> AsyncIterator[RawServer]:
    s = RawServer()
    s.server = await asyncio.start_server(s.handle, "127.0.0.1", 0)
    yield s
    s.server.close()


@pytest.fixture
async def sender() -> AsyncIterator[Sender]:
    out = Sender(TargetPolicy([], allow_private=True), "test/1")
    yield out
    await out.close()


async def test_a_request_carries_its_headers_and_connections_are_reused(
    server: RawServer, sender: Sender
) -> None:
    for _ in range(3):
        answer = await sender.post(server.url, [("webhook-id", "msg_1")], b'{"a":1}', 5.0)
        assert answer.status == 204
    assert server.connections == 1
    head = server.requests[0].decode()
    assert head.startswith("POST /hook?x=1 HTTP/1.1\r\n")
    assert "\r\nwebhook-id: msg_1\r\n" in head and head.endswith('\r\n\r\n{"a":1}')
    assert "Content-Length: 7" in head and "Host: 127.0.0.1:" in head


async def test_chunked_closing_and_retry_after_answers(server: RawServer, sender: Sender) -> None:
    server.script.extend(
        [
            b"HTTP/1.1 503 Busy\r\nRetry-After: 30\r\nTransfer-Encoding: chunked\r\n\r\n"
            b"4\r\nbusy\r\n0\r\nX-Trailer: 1\r\n\r\n",
            b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: close\r\n\r\nok",
            b"HTTP/1.0 410 Gone\r\n\r\n",
        ]
    )
    first = await sender.post(server.url, [], b"{}", 5.0)
    assert (first.status, first.retry_after) == (503, "30")
    assert (await sender.post(server.url, [], b"{}", 5.0)).status == 200  # same connection
    assert (await sender.post(server.url, [], b"{}", 5.0)).status == 410  # a new one
    assert (await sender.post(server.url, [], b"{}", 5.0)).status == 204  # and another
    assert server.connections == 3


async def test_a_kept_alive_connection_closed_by_the_receiver_is_replaced(
    server: RawServer, sender: Sender
) -> None:
    assert (await sender.post(server.url, [], b"{}", 5.0)).status == 204
    server.script.append(None)  # the receiver drops the idle connection on the next request
    assert (await sender.post(server.url, [], b"{}", 5.0)).status == 204
    assert server.connections == 2


async def test_oversized_malformed_and_missing_answers(server: RawServer, sender: Sender) -> None:
    big = MAX_BODY_BYTES + 1
    server.script.extend(
        [
            f"HTTP/1.1 200 OK\r\nContent-Length: {big}\r\n\r\n".encode() + b"x" * 10,
            b"SMTP ready\r\n\r\n",
            None,
        ]
    )
    assert (await sender.post(server.url, [], b"{}", 5.0)).status == 200  # body left unread
    with pytest.raises(SendError, match="not an HTTP answer"):
        await sender.post(server.url, [], b"{}", 5.0)
    with pytest.raises(SendError, match="closed before an answer"):
        await sender.post(server.url, [], b"{}", 5.0)
    with pytest.raises(SendError, match="cannot connect"):
        await sender.post("http://127.0.0.1:1/x", [], b"{}", 5.0)


async def test_a_silent_receiver_times_out(server: RawServer, sender: Sender) -> None:
    hold = asyncio.Event()

    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await hold.wait()
        writer.close()

    quiet = await asyncio.start_server(silent, "127.0.0.1", 0)
    port = quiet.sockets[0].getsockname()[1]
    try:
        with pytest.raises(TimeoutError):
            await sender.post(f"http://127.0.0.1:{port}/x", [], b"{}", 0.1)
    finally:
        hold.set()
        quiet.close()
