from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator

import aiohttp
import msgspec
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from kvhandoff.pipelines.errors import (
    ConflictError,
    InvalidInput,
    KVHandoffError,
    NotFoundError,
    PairingError,
    PeerUnreachable,
    TransportError,
)
from kvhandoff.pipelines.pairing_problems import Problem
from kvhandoff.service.http.app import ROUTES, create_app, decode_body, json_response
from kvhandoff.service.http.peer_client import PeerClient, UnauthenticatedAnswer
from kvhandoff.service.http.peer_signing import Signer
from kvhandoff.service.http.problems import PeerError, PeerTimeout
from kvhandoff.service.http.routing import Route, RouteTable
from tests.unit.service.conftest import make_config


class Ping(msgspec.Struct, frozen=True):
    n: int


class Pong(msgspec.Struct, frozen=True):
    n: int
    role: str


PROBLEMS = [Problem("item_len_mismatch", "layer 3 group 0: 64 != 32", layer_id=3, group=0)]


def install(app: web.Application) -> None:
    routes = RouteTable()

    @routes.post("/v1/ping", request=Ping, response=Pong)
    async def ping(request: web.Request) -> web.Response:
        body = await decode_body(request, Ping)
        return json_response(Pong(body.n + 1, "decode"))

    @routes.post("/v1/fire")
    async def fire(request: web.Request) -> web.Response:
        await decode_body(request, Ping)
        return web.Response(status=204)

    @routes.get("/v1/conflict")
    async def conflict(request: web.Request) -> web.Response:
        raise ConflictError("page 3 is leased to h1", field="dst_pages", handoff_id="h1")

    @routes.get("/v1/pairing")
    async def pairing(request: web.Request) -> web.Response:
        raise PairingError(list(PROBLEMS))

    @routes.get("/v1/transport")
    async def transport(request: web.Request) -> web.Response:
        raise TransportError("batch failed", rc=-5, peer="10.0.0.2:1234")

    @routes.get("/v1/crash")
    async def crash(request: web.Request) -> web.Response:
        raise RuntimeError("boom")

    @routes.get("/v1/slow")
    async def slow(request: web.Request) -> web.Response:
        await asyncio.sleep(5)
        return json_response({})

    @routes.get("/v1/foreign")
    async def foreign(request: web.Request) -> web.Response:
        return web.Response(status=502, text="<html>bad gateway</html>")

    @routes.get("/v1/unknown-code")
    async def unknown_code(request: web.Request) -> web.Response:
        body = {
            "type": "urn:x",
            "title": "t",
            "status": 409,
            "detail": "d",
            "code": "from_the_future",
        }
        return json_response(body, status=409)

    @routes.get("/v1/wrong-shape")
    async def wrong_shape(request: web.Request) -> web.Response:
        return json_response({"n": "not an int"})

    @routes.get("/v1/redirect")
    async def redirect(request: web.Request) -> web.Response:
        return web.Response(status=307, headers={"Location": request.query["to"]})

    @routes.get("/v1/claims")
    async def claims(request: web.Request) -> web.Response:
        return json_response({"incarnation": request.query["incarnation"], "url": "x"})

    for r in routes:  # as peer routes: the client's calls are signed
        app[ROUTES].add(r.method, r.path, r.handler, role="peer", **_contract(r))


def _contract(r: Route) -> dict[str, object]:
    return {"request": r.request, "response": r.response, "status": r.status}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def serve_peer(**overrides: object) -> TestServer:
    """A peer service on 127.0.0.1 whose `public_url` is where it listens (signed calls are
    addressed to it)."""
    port = free_port()
    config = make_config(
        **{"server.token": "t", "server.public_url": f"http://127.0.0.1:{port}", **overrides}
    )
    server = TestServer(create_app(config, extensions=[install]), host="127.0.0.1", port=port)
    await server.start_server()
    return server


@pytest.fixture
async def peer() -> AsyncIterator[str]:
    server = await serve_peer()
    yield str(server.make_url("")).rstrip("/")
    await server.close()


@pytest.fixture
async def client() -> AsyncIterator[PeerClient]:
    async with aiohttp.ClientSession() as session:
        # A bound no call here comes near, even on a busy machine; the timeout test sets its own.
        yield PeerClient(session, signer=Signer("t", "http://tester"), timeout_s=30.0)


async def test_post_and_get_decode_typed_bodies(peer: str, client: PeerClient) -> None:
    assert await client.post(peer, "/v1/ping", Ping(1), Pong) == Pong(2, "decode")
    await client.post(peer, "/v1/fire", Ping(1))  # 204, no body expected


async def test_remote_conflict_is_a_conflict_here(peer: str, client: PeerClient) -> None:
    with pytest.raises(ConflictError) as info:
        await client.get(peer, "/v1/conflict", dict)
    assert info.value.message == "page 3 is leased to h1"
    assert info.value.context == {"field": "dst_pages", "handoff_id": "h1", "peer": peer}


async def test_remote_pairing_error_keeps_its_problems(peer: str, client: PeerClient) -> None:
    with pytest.raises(PairingError) as info:
        await client.get(peer, "/v1/pairing", dict)
    assert info.value.problems == PROBLEMS
    assert info.value.context["layer_id"] == 3


async def test_remote_transport_error_keeps_rc_and_peer(peer: str, client: PeerClient) -> None:
    with pytest.raises(TransportError) as info:
        await client.get(peer, "/v1/transport", dict)
    assert (info.value.rc, info.value.peer) == (-5, "10.0.0.2:1234")  # the engine's peer, not ours


async def test_remote_validation_error_names_the_field(peer: str, client: PeerClient) -> None:
    with pytest.raises(InvalidInput) as info:
        await client.post(peer, "/v1/ping", {"n": "x"}, Pong)
    assert info.value.context["field"] == "n"


async def test_remote_crash_and_missing_route(peer: str, client: PeerClient) -> None:
    with pytest.raises(KVHandoffError) as crash:
        await client.get(peer, "/v1/crash", dict)
    assert crash.value.code == "internal_error"
    assert "boom" not in crash.value.message
    # A missing route on a peer is a protocol mismatch between services, not a missing object.
    with pytest.raises(PeerError) as missing:
        await client.get(peer, "/v1/absent", dict)
    assert missing.value.context["remote_code"] == "route_not_found"
    assert not isinstance(missing.value, NotFoundError)


async def test_wrong_secret_is_a_peer_error_not_our_401(peer: str) -> None:
    async with aiohttp.ClientSession() as session:
        with pytest.raises(PeerError) as info:
            await PeerClient(session, signer=Signer("nope", "http://x")).get(
                peer, "/v1/conflict", dict
            )
    assert info.value.context["remote_code"] == "unauthorized"
    assert info.value.context["status"] == 401
    assert isinstance(info.value, UnauthenticatedAnswer)  # the peer never signs it: unknown


async def test_unknown_code_falls_back_on_status(peer: str, client: PeerClient) -> None:
    with pytest.raises(ConflictError) as info:
        await client.get(peer, "/v1/unknown-code", dict)
    assert info.value.message == "d"


async def test_foreign_error_body_is_a_peer_error(peer: str, client: PeerClient) -> None:
    with pytest.raises(PeerError) as info:
        await client.get(peer, "/v1/foreign", dict)
    assert info.value.context["status"] == 502
    assert "bad gateway" in info.value.message


async def test_unexpected_success_body_is_a_peer_error(peer: str, client: PeerClient) -> None:
    with pytest.raises(PeerError, match="unexpected body"):
        await client.get(peer, "/v1/wrong-shape", Ping)


async def test_timeout_names_the_peer(peer: str, client: PeerClient) -> None:
    with pytest.raises(PeerTimeout) as info:
        await client.get(peer, "/v1/slow", dict, timeout_s=0.2)
    assert info.value.context["peer"] == peer
    assert isinstance(info.value, PeerUnreachable)


async def test_connection_refused_is_unreachable(client: PeerClient) -> None:
    with socket.socket() as s:  # a port nobody listens on: bound, never listening
        s.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{s.getsockname()[1]}"
        with pytest.raises(PeerUnreachable) as info:
            await client.get(url, "/v1/ping", dict)
    assert info.value.context["peer"] == url
    assert url in info.value.message
    assert not isinstance(info.value, PeerTimeout)


class Claims(msgspec.Struct, frozen=True):
    incarnation: str


async def test_a_redirect_is_never_followed(peer: str, client: PeerClient) -> None:
    """Issue 18 A: a 307 would carry the signed headers and body to whatever host it names."""
    hits: list[str] = []

    async def elsewhere(request: web.Request) -> web.Response:
        hits.append(request.path)
        return json_response({"n": 1, "role": "decode"})

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", elsewhere)
    other = TestServer(app)
    await other.start_server()
    try:
        target = str(other.make_url("/v1/ping"))
        with pytest.raises(PeerError, match="follow no redirect") as info:
            await client.get(peer, f"/v1/redirect?to={target}", Pong)
        assert info.value.context["status"] == 307
        assert hits == []
    finally:
        await other.close()


async def test_a_body_claiming_another_life_than_its_signature_is_refused(
    peer: str, client: PeerClient
) -> None:
    await client.post(peer, "/v1/fire", Ping(1))
    life = client.incarnation_of(peer)
    assert life is not None
    assert await client.get(peer, f"/v1/claims?incarnation={life}", Claims) == Claims(life)
    with pytest.raises(UnauthenticatedAnswer, match="names incarnation other"):
        await client.get(peer, "/v1/claims?incarnation=other", Claims)


async def test_a_call_to_a_restarted_peer_is_signed_again_for_its_new_life(
    client: PeerClient,
) -> None:
    """Calls name the recipient's life once known; a restarted peer refuses the old life's
    (so a kept request of that life cannot be replayed to it), and its signed refusal names the
    new life, which the client signs for at once."""
    first = await serve_peer()
    url = str(first.make_url("")).rstrip("/")
    port = first.port
    await client.post(url, "/v1/fire", Ping(1))
    old = client.incarnation_of(url)
    await first.close()
    config = make_config(**{"server.token": "t", "server.public_url": url})
    again = TestServer(create_app(config, extensions=[install]), host="127.0.0.1", port=port)
    await again.start_server()
    try:
        assert await client.post(url, "/v1/ping", Ping(1), Pong) == Pong(2, "decode")
        assert client.incarnation_of(url) not in (None, old)
    finally:
        await again.close()
