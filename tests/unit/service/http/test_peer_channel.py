"""Peer channels (`kvhandoff.service.http.peer_channel`) between real aiohttp services on loopback,
with real signing: the channel route of `kvhandoff.service.api.peer`, a call it carries (arrivals),
and `PeerClient` as the sender. What today's signed HTTP calls refuse, the channel refuses too: a
frame replayed on its own or another connection, altered, reflected, sent under a handshake
signed for another recipient, or after the recipient's restart."""

from __future__ import annotations

import asyncio
import json
import logging
import socket
from collections.abc import AsyncIterator
from types import SimpleNamespace
from typing import Any

import aiohttp
import msgspec
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from kvhandoff.pipelines.errors import InvalidInput, PeerUnreachable
from kvhandoff.pipelines.messages import Outcome
from kvhandoff.pipelines.peer_calls import ARRIVALS, CHANNEL
from kvhandoff.service.api.peer import Asked, carries, common_routes
from kvhandoff.service.http.app import ROUTES, create_app
from kvhandoff.service.http.peer_channel import (
    FRAME_BYTES,
    ChannelBroken,
    Hello,
    PeerChannels,
    Sealer,
    Writer,
    answer_until_closed,
    session,
)
from kvhandoff.service.http.peer_client import PeerClient
from kvhandoff.service.http.peer_signing import AnswerRejected, Signer, channel_key
from kvhandoff.service.http.problems import PeerTimeout
from kvhandoff.service.http.routing import RouteTable
from kvhandoff.service.runtime.roles import RUNTIME
from tests.channels import OpenedByHand
from tests.unit.service.conftest import make_config

SECRET = "t"  # the services' `server.token`: their peer secret too
SENDER = "http://tester"


class Seen:
    """What the carried handler was asked, by whom; `hold` makes it wait (a slow peer)."""

    def __init__(self) -> None:
        self.calls: list[tuple[str | None, bytes]] = []
        self.hold = asyncio.Event()
        self.hold.set()


def install(seen: Seen) -> Any:
    table = RouteTable()

    @carries(table, ARRIVALS)
    async def arrivals(asked: Asked, raw: bytes) -> list[Outcome]:
        seen.calls.append((asked.sender, raw))
        await seen.hold.wait()
        return [Outcome(204) for _ in json.loads(raw)]

    def extension(app: web.Application) -> None:
        app[ROUTES].include(common_routes)
        app[ROUTES].include(table)
        # What a channel needs of the runtime: the event set when the service stops (as
        # `kvhandoff.service.runtime.roles` sets it).
        runtime = SimpleNamespace(closing=asyncio.Event())
        app[RUNTIME] = runtime  # type: ignore[assignment]

        async def stopping(app: web.Application) -> None:
            runtime.closing.set()

        app.on_shutdown.append(stopping)

    return extension


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def serve(seen: Seen, port: int | None = None) -> TestServer:
    port = port or free_port()
    url = f"http://127.0.0.1:{port}"
    config = make_config(**{"server.token": SECRET, "server.public_url": url})
    server = TestServer(create_app(config, extensions=[install(seen)]), host="127.0.0.1", port=port)
    await server.start_server()
    return server


def url_of(server: TestServer) -> str:
    return str(server.make_url("")).rstrip("/")


@pytest.fixture
async def seen() -> Seen:
    return Seen()


@pytest.fixture
async def peer(seen: Seen) -> AsyncIterator[str]:
    server = await serve(seen)
    yield url_of(server)
    await server.close()


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as session:
        yield session


@pytest.fixture
async def client(http: aiohttp.ClientSession) -> AsyncIterator[PeerClient]:
    client = PeerClient(http, signer=Signer(SECRET, SENDER), timeout_s=30.0)
    yield client
    await client.close()


async def opened(client: PeerClient, peer: str) -> None:
    """Until the client's channel to `peer` is open (a call goes over HTTP meanwhile)."""
    for _ in range(200):
        if client._channels is not None and client._channels.ready(
            peer, client.incarnation_of(peer)
        ):
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"no channel to {peer}")


async def by_hand(
    http: aiohttp.ClientSession, peer: str, life: str, *, recipient: str | None = None
) -> OpenedByHand:
    return await OpenedByHand.open(http, peer, life, secret=SECRET, sender=SENDER, to=recipient)


async def life_of(client: PeerClient, peer: str) -> str:
    await client.post(peer, ARRIVALS.path, b"[]", ARRIVALS.reply)  # over HTTP: learns the life
    life = client.incarnation_of(peer)
    assert life is not None
    return life


# ---------------------------------------------------------------------------------------------
# Frames


def test_a_frame_opens_once_in_its_own_session_and_direction_only() -> None:
    key = channel_key(SECRET, "n1", "c1", SENDER, "http://peer", "life")
    out, in_ = session(key)
    theirs_in, theirs_out = session(key)  # the recipient's view of the same session
    first, second = out.seal(b"[1]"), out.seal(b"[2]")
    assert theirs_in.open(first) == b"[1]"
    with pytest.raises(ChannelBroken):
        theirs_in.open(first)  # replayed
    assert theirs_in.open(second) == b"[2]"
    reordered_out, reordered_in = session(key)
    a, b = reordered_out.seal(b"[a]"), reordered_out.seal(b"[b]")
    with pytest.raises(ChannelBroken):
        reordered_in.open(b)  # the second frame before the first
    other = channel_key(SECRET, "n1", "c2", SENDER, "http://peer", "life")
    with pytest.raises(ChannelBroken):
        session(other)[0].open(a)  # another session's frame (another channel nonce)
    with pytest.raises(ChannelBroken):
        in_.open(Sealer(key, b"kvhandoff-channel-request").seal(b"[x]"))  # reflected
    answer = theirs_out.seal(b"[ok]")
    with pytest.raises(ChannelBroken):
        in_.open(answer[:-2] + b"x]")  # altered
    assert in_.open(answer) == b"[ok]"


def test_a_session_key_is_bound_to_both_ends_the_life_and_both_nonces() -> None:
    base = (SECRET, "n", "c", SENDER, "http://peer", "life")
    keys = {channel_key(*base)}
    for i, other in enumerate(("other", "n2", "c2", "http://x", "http://y", "life2")):
        changed = list(base)
        changed[i] = other
        keys.add(channel_key(*changed))
    assert len(keys) == 7


async def test_a_writer_sends_what_queued_meanwhile_in_frames_of_at_most_frame_bytes() -> None:
    sent: list[bytes] = []
    first_sent = asyncio.Event()

    async def send(frame: bytes) -> None:
        sent.append(frame)
        first_sent.set()
        await asyncio.sleep(0)

    writer = Writer(Sealer(None, b"x"), send)
    running = asyncio.ensure_future(writer.run())
    writer.put(b"1")
    await first_sent.wait()
    big = b'"' + b"x" * (FRAME_BYTES // 2) + b'"'
    for part in (b"2", big, big, b"3"):  # queued while nothing is written: share frames
        writer.put(part)
    while len(sent) < 3:
        await asyncio.sleep(0.01)
    running.cancel()
    assert [json.loads(f) for f in sent] == [
        [1],
        [2, big.decode().strip('"')],
        [big.decode().strip('"'), 3],
    ]
    assert all(len(f) <= FRAME_BYTES + 2 for f in sent)


async def test_an_answer_written_to_a_closing_connection_ends_the_writing_without_an_error(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # The recipient's writer, as `serve` runs it, when its connection closes with an answer
    # still queued (found by the image's SIGTERM test: the decode's channel closed while the
    # prefill answered the decode's abort, and the writer task failed with a traceback).
    async def send(frame: bytes) -> None:
        raise aiohttp.ClientConnectionResetError("Cannot write to closing transport")

    writer = Writer(Sealer(None, b"x"), send)
    writer.put(b"1")
    with caplog.at_level(logging.INFO, logger="kvhandoff"):
        await asyncio.wait_for(answer_until_closed(writer, "http://sender"), 5)
    assert [r.levelno for r in caplog.records] == [logging.INFO]
    assert "answers not sent, the connection is closing" in caplog.records[0].getMessage()


# ---------------------------------------------------------------------------------------------
# Channels between services


async def test_calls_move_to_the_channel_and_answer_as_over_http(
    peer: str, client: PeerClient, seen: Seen
) -> None:
    await life_of(client, peer)
    await opened(client, peer)
    notices = b'[{"n": 1}, {"n": 2}]'
    outcomes = await asyncio.gather(
        *(client.post(peer, ARRIVALS.path, notices, ARRIVALS.reply) for _ in range(5))
    )
    assert outcomes == [[Outcome(204), Outcome(204)]] * 5
    assert seen.calls[1:] == [(SENDER, notices)] * 5  # the verified sender, as over HTTP


async def test_a_frame_replayed_on_its_own_or_another_connection_is_refused(
    peer: str, client: PeerClient, http: aiohttp.ClientSession, seen: Seen
) -> None:
    life = await life_of(client, peer)
    first = await by_hand(http, peer, life)
    frame = first.frame(ARRIVALS.path, [{"n": 1}])
    await first.ws.send_bytes(frame)
    assert await first.answers() == [{"id": 1, "status": 200, "body": [{"status": 204}]}]
    second = await by_hand(http, peer, life)
    await second.ws.send_bytes(frame)  # a frame of the first channel on the second
    await second.refused()
    await first.ws.send_bytes(frame)  # and again on its own
    await first.refused()
    assert len(seen.calls) == 2  # the HTTP call and the one genuine frame


async def test_a_handshake_signed_for_another_recipient_or_life_is_refused(
    peer: str, client: PeerClient, http: aiohttp.ClientSession
) -> None:
    life = await life_of(client, peer)
    with pytest.raises(aiohttp.WSServerHandshakeError) as relayed:
        await by_hand(http, peer, life, recipient="http://127.0.0.1:1")
    assert relayed.value.status == 401
    with pytest.raises(aiohttp.WSServerHandshakeError) as stale:
        await by_hand(http, peer, "an-earlier-life")
    assert stale.value.status == 409


async def test_a_restarted_peer_gets_a_new_channel_and_the_old_ones_calls_fail(
    client: PeerClient, http: aiohttp.ClientSession
) -> None:
    """A call waiting on the channel when its recipient's life ends fails as unreachable (the
    same error as a dropped HTTP request), and the old life's handshake is refused by the new
    life; the client opens a channel to the new life once it learns it."""
    seen = Seen()
    first = await serve(seen)
    url, port = url_of(first), first.port
    old = await life_of(client, url)
    await opened(client, url)
    kept = await by_hand(http, url, old)
    seen.hold.clear()
    waiting = asyncio.ensure_future(client.post(url, ARRIVALS.path, b"[{}]", ARRIVALS.reply))
    while len(seen.calls) < 2:
        await asyncio.sleep(0.01)
    await first.close()
    with pytest.raises(PeerUnreachable, match="lost with the channel"):
        await waiting
    again = await serve(Seen(), port)
    try:
        with pytest.raises(aiohttp.WSServerHandshakeError) as stale:
            await by_hand(http, url, old)
        assert stale.value.status == 409
        # The old life's channels ended with it: nothing sent on them can reach the new life.
        closed = (aiohttp.WSMsgType.CLOSE, aiohttp.WSMsgType.CLOSED, aiohttp.WSMsgType.CLOSING)
        assert (await kept.ws.receive()).type in closed
        with pytest.raises(aiohttp.ClientConnectionResetError):
            await kept.ws.send_bytes(kept.frame(ARRIVALS.path, [{}]))
        new = await life_of(client, url)  # over HTTP, signed again for the new life
        assert new != old
        await opened(client, url)
        assert await client.post(url, ARRIVALS.path, b"[{}]", ARRIVALS.reply) == [Outcome(204)]
    finally:
        await again.close()


async def test_a_call_without_an_answer_in_time_is_a_peer_timeout(
    peer: str, http: aiohttp.ClientSession, seen: Seen
) -> None:
    client = PeerClient(http, signer=Signer(SECRET, SENDER), timeout_s=0.3)
    try:
        await life_of(client, peer)
        await opened(client, peer)
        seen.hold.clear()
        with pytest.raises(PeerTimeout, match="channel"):
            await client.post(peer, ARRIVALS.path, b"[{}]", ARRIVALS.reply)
    finally:
        seen.hold.set()
        await client.close()


async def test_a_hello_not_signed_by_the_addressed_peer_opens_no_channel(
    http: aiohttp.ClientSession,
) -> None:
    """An impostor at the peer's URL (without the secret) cannot complete the handshake: the
    sender refuses its hello, and its calls stay on HTTP, which refuses its answers."""

    async def impostor(request: web.Request) -> web.WebSocketResponse:
        ws = web.WebSocketResponse()
        await ws.prepare(request)
        forged = Signer("not-the-secret", "x")  # any signature but the peer secret's
        signed = {"KVHandoff-Responder": url, "KVHandoff-Responder-Incarnation": "life"}
        signed["KVHandoff-Answer-Signature"] = forged.headers("GET", "/", b"", recipient=url)[
            "KVHandoff-Signature"
        ]
        await ws.send_bytes(msgspec.json.encode(Hello("nonce", signed)))
        await ws.receive()
        return ws

    app = web.Application()
    app.router.add_get(CHANNEL.path, impostor)
    server = TestServer(app, host="127.0.0.1", port=free_port())
    await server.start_server()
    url = url_of(server)
    try:
        channels = PeerChannels(http, Signer(SECRET, SENDER), max_body_bytes=1 << 20)
        with pytest.raises(AnswerRejected):
            await channels._connect(url, "life")
        await channels.close()
    finally:
        await server.close()


async def test_a_signed_request_for_the_channel_without_an_upgrade_is_a_422(
    peer: str, client: PeerClient
) -> None:
    with pytest.raises(InvalidInput) as refused:
        await client.get(peer, CHANNEL.path, dict)
    assert refused.value.context["field"] == "Upgrade"
