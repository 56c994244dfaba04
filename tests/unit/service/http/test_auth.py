"""Credentials per role: each route takes its role's credential and refuses every other one."""

from __future__ import annotations

from typing import Any

import pytest
from aiohttp import web

from kvhandoff.service.http.app import ROUTES, create_app, json_response
from kvhandoff.service.http.auth import signed_sender, signer_for
from kvhandoff.service.http.peer_signing import Signer
from kvhandoff.service.http.routing import RouteTable
from kvhandoff.service.serve import install_service
from tests.unit.service.conftest import ClientFactory, make_config

ROLES = {"router": "r-secret", "engine": "e-secret", "peer": "p-secret"}
ROUTE_OF = {"router": "/v1/r", "engine": "/v1/e", "peer": "/v1/peer/p", "open": "/v1/o"}


def install(app: web.Application) -> None:
    routes = RouteTable()
    for role, path in ROUTE_OF.items():

        async def handler(request: web.Request) -> web.Response:
            return json_response({"sender": signed_sender(request)})

        routes.add("POST", path, handler, role=role, name=f"{role}_route")
    app[ROUTES].include(routes)


def config(**auth: Any) -> Any:
    return make_config(**{f"auth.{k}": v for k, v in auth.items()})


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


#: Whom the signed requests below are addressed to: the service under test.
HERE = make_config().server.public_url


def signed(
    path: str, secret: str = "p-secret", body: bytes = b"", recipient: str = HERE
) -> dict[str, str]:
    return Signer(secret, "http://me:1").headers("POST", path, body, recipient=recipient)


@pytest.mark.parametrize("credential", ["router", "engine"])
@pytest.mark.parametrize("route", ["router", "engine", "peer"])
async def test_a_bearer_credential_works_on_its_own_routes_only(
    make_client: ClientFactory, credential: str, route: str
) -> None:
    client = await make_client(config(**ROLES), [install])
    response = await client.post(ROUTE_OF[route], headers=bearer(ROLES[credential]))
    body = await response.json()
    if credential == route:
        assert response.status == 200, body
    else:
        assert (response.status, body["code"]) == (403, "forbidden"), body
        assert body["credential"] == credential and body["role"] == route


@pytest.mark.parametrize("route", ["router", "engine"])
async def test_the_peer_secret_is_never_a_bearer_token(
    make_client: ClientFactory, route: str
) -> None:
    client = await make_client(config(**ROLES), [install])
    response = await client.post(ROUTE_OF[route], headers=bearer("p-secret"))
    assert response.status == 401
    # nor does a peer signature stand in for a router's or an engine's token
    response = await client.post(ROUTE_OF[route], headers=signed(ROUTE_OF[route]))
    assert response.status == 401


async def test_a_signed_peer_request_exposes_its_sender(make_client: ClientFactory) -> None:
    client = await make_client(config(**ROLES), [install])
    response = await client.post(ROUTE_OF["peer"], headers=signed(ROUTE_OF["peer"]))
    assert (response.status, await response.json()) == (200, {"sender": "http://me:1"})
    headers = signed(ROUTE_OF["peer"])
    assert (await client.post(ROUTE_OF["peer"], headers=headers)).status == 200
    again = await client.post(ROUTE_OF["peer"], headers=headers)
    assert (again.status, (await again.json())["code"]) == (409, "replayed")


@pytest.mark.parametrize(
    "headers",
    [{}, {"Authorization": "Bearer nope"}, signed("/v1/peer/p", "r-secret")],
)
async def test_peer_routes_refuse_unsigned_and_badly_signed(
    make_client: ClientFactory, headers: dict[str, str]
) -> None:
    client = await make_client(config(**ROLES), [install])
    response = await client.post(ROUTE_OF["peer"], headers=headers)
    assert response.status == 401
    assert response.headers["WWW-Authenticate"].startswith("KVHandoff-Signature")


@pytest.mark.parametrize(
    "value", ["Bearer", "Basic r-secret", "r-secret", "Bearer  ", "Bearer\tr-secret"]
)
async def test_malformed_authorization_is_401(make_client: ClientFactory, value: str) -> None:
    client = await make_client(config(**ROLES), [install])
    response = await client.post(ROUTE_OF["router"], headers={"Authorization": value})
    assert response.status == 401


async def test_rotation_accepts_current_and_previous(make_client: ClientFactory) -> None:
    client = await make_client(config(router=["new", "old"], peer=["p2", "p1"]), [install])
    for token in ("new", "old"):
        assert (await client.post(ROUTE_OF["router"], headers=bearer(token))).status == 200
    for secret in ("p2", "p1"):
        headers = signed(ROUTE_OF["peer"], secret)
        assert (await client.post(ROUTE_OF["peer"], headers=headers)).status == 200
    assert signer_for(config(peer=["p2", "p1"])) is not None


async def test_a_role_without_secret_is_open(make_client: ClientFactory) -> None:
    client = await make_client(config(router="r-secret"), [install])
    assert (await client.post(ROUTE_OF["engine"])).status == 200
    assert (await client.post(ROUTE_OF["peer"])).status == 200
    assert (await client.post(ROUTE_OF["open"])).status == 200
    assert (await client.post(ROUTE_OF["router"])).status == 401
    assert signer_for(config(router="r-secret")) is None


async def test_server_token_alone_serves_every_role(make_client: ClientFactory) -> None:
    client = await make_client(make_config(**{"server.token": "t"}), [install])
    assert (await client.post(ROUTE_OF["router"], headers=bearer("t"))).status == 200
    assert (await client.post(ROUTE_OF["engine"], headers=bearer("t"))).status == 200
    headers = signed(ROUTE_OF["peer"], "t")
    assert (await client.post(ROUTE_OF["peer"], headers=headers)).status == 200
    # ... and the roles set in [auth] take their own, leaving the token to the others
    client = await make_client(
        make_config(**{"server.token": "t", "auth.router": "r-secret"}), [install]
    )
    response = await client.post(ROUTE_OF["router"], headers=bearer("t"))
    assert response.status == 403  # "t" is the engine's (and peer's) credential now
    assert (await client.post(ROUTE_OF["router"], headers=bearer("r-secret"))).status == 200


@pytest.mark.parametrize("role", ["decode", "prefill"])
def test_every_peer_route_the_service_serves_takes_the_peer_credential(role: str) -> None:
    app = create_app(make_config(role=role), extensions=[install_service])
    peer_paths = [r.path for r in app[ROUTES] if r.path.startswith("/v1/peer/")]
    assert peer_paths, "no peer routes found"
    for r in app[ROUTES]:
        if r.path.startswith("/v1/peer/") or r.path == "/v1/layout":
            assert r.auth_role == "peer", (r.method, r.path)


def test_a_peer_path_cannot_be_declared_for_another_role() -> None:
    async def handler(request: web.Request) -> web.Response:
        return json_response({})

    routes = RouteTable()
    undeclared = routes.add("GET", "/v1/peer/new", handler)
    assert undeclared.auth_role == "peer"  # a forgotten role= still needs the peer secret
    wrong = routes.add("GET", "/v1/peer/other", handler, role="router")
    with pytest.raises(ValueError, match="peer route"):
        _ = wrong.auth_role
