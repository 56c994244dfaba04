from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator

import aiohttp
import msgspec
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from pipelines.errors import (
    ConflictError,
    InvalidInput,
    KVHandoffError,
    NotFoundError,
    PairingError,
    PeerUnreachable,
    TransportError,
)
from pipelines.pairing import Problem
from service.http.app import ROUTES, create_app, decode_body, json_response
from service.http.client import PeerClient
from service.http.problems import PeerError, PeerTimeout
from service.http.routing import Route, RouteTable
from service.http.signing import Signer
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

    for r in routes:  # as peer routes: the client's calls are signed
        app[ROUTES].add(r.method, r.path, r.handler, role="peer", **_contract(r))


def _contract(r: Route) -> dict[str, object]:
    return {"request": r.request, "response": r.response, "status": r.status}


@pytest.fixture
async def peer() -> AsyncIterator[str]:
    server = TestServer(create_app(make_config(**{"server.token": "t"}), extensions=[install]))
    await server.start_server()
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
    health = await client.get(peer, "/healthz", dict)
    assert health["status"] == "ok"


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
            await client.get(url, "/healthz", dict)
    assert info.value.context["peer"] == url
    assert url in info.value.message
    assert not isinstance(info.value, PeerTimeout)
