from __future__ import annotations

from typing import Any

import msgspec
import pytest
from aiohttp import web

from kvhandoff.service.http.app import ROUTES, create_app, json_response
from kvhandoff.service.http.openapi import SECURITY_SCHEMES, build_openapi
from kvhandoff.service.http.problems import PROBLEM_CONTENT_TYPE
from kvhandoff.service.http.routing import RouteTable
from tests.unit.service.conftest import ClientFactory, make_config


class CreateThing(msgspec.Struct, frozen=True):
    name: str
    pages: list[int]


class Thing(msgspec.Struct, frozen=True):
    id: str
    created: CreateThing


async def handler(request: web.Request) -> web.Response:
    return json_response({})


def install(app: web.Application) -> None:
    routes = RouteTable()
    routes.add(
        "POST",
        "/v1/things",
        handler,
        summary="create",
        request=CreateThing,
        response=Thing,
        status=201,
        errors=(409,),
        name="create_thing",
    )
    routes.add(
        "GET",
        "/v1/things/{thing_id:[a-z0-9]+}",
        handler,
        response=Thing,
        errors=(404,),
        name="get_thing",
    )
    routes.add("GET", "/v1/things", handler, response=list[Thing], name="list_things")
    routes.add("GET", "/v1/events", handler, content_type="text/event-stream", name="events")
    routes.add("GET", "/hidden", handler, in_schema=False)
    app[ROUTES].include(routes)


def refs(node: Any) -> list[str]:
    if isinstance(node, dict):
        found = [node["$ref"]] if isinstance(node.get("$ref"), str) else []
        return found + [r for value in node.values() for r in refs(value)]
    if isinstance(node, list):
        return [r for value in node for r in refs(value)]
    return []


def resolve(doc: dict[str, Any], ref: str) -> Any:
    assert ref.startswith("#/"), ref
    node: Any = doc
    for part in ref[2:].split("/"):
        node = node[part]
    return node


@pytest.mark.parametrize("token", [None, "t"])
async def test_document_covers_every_route_and_refs_resolve(
    make_client: ClientFactory, token: str | None
) -> None:
    client = await make_client(make_config(**{"server.token": token}), [install])
    response = await client.get("/openapi.json")
    assert response.status == 200
    doc = await response.json()
    assert doc["openapi"] == "3.1.0"
    assert doc["info"]["title"] and doc["info"]["version"]

    app = client.app
    assert app is not None
    for route in app[ROUTES]:
        ops = doc["paths"].get(route.openapi_path, {})
        assert (route.method.lower() in ops) == route.in_schema, route.path
    assert "/hidden" not in doc["paths"]

    all_refs = refs(doc)
    assert all_refs  # the check below must have something to check
    for ref in all_refs:
        assert isinstance(resolve(doc, ref), dict), ref

    op_ids = [op["operationId"] for ops in doc["paths"].values() for op in ops.values()]
    assert len(op_ids) == len(set(op_ids))
    for path, ops in doc["paths"].items():
        for op in ops.values():
            declared = [p["name"] for p in op.get("parameters", []) if p["in"] == "path"]
            assert sorted(declared) == sorted(
                part[1:-1] for part in path.split("/") if part[:1] == "{"
            )
            assert "500" in op["responses"]
            for status, answer in op["responses"].items():
                if int(status) >= 400:
                    schema = answer["content"][PROBLEM_CONTENT_TYPE]["schema"]
                    assert schema == {"$ref": "#/components/schemas/ProblemDetails"}

    create = doc["paths"]["/v1/things"]["post"]
    assert set(create["responses"]) >= {"201", "400", "409", "413", "422", "500"}
    body_schema = create["requestBody"]["content"]["application/json"]["schema"]
    assert resolve(doc, body_schema["$ref"])["required"] == ["name", "pages"]
    listed = doc["paths"]["/v1/things"]["get"]["responses"]["200"]["content"]["application/json"]
    assert listed["schema"]["type"] == "array"
    events = doc["paths"]["/v1/events"]["get"]["responses"]["200"]["content"]
    assert "text/event-stream" in events
    assert "/healthz" in doc["paths"] and "/readyz" in doc["paths"]
    assert "503" in doc["paths"]["/readyz"]["get"]["responses"]

    problem = doc["components"]["schemas"]["ProblemDetails"]
    assert {"type", "title", "status"} <= set(problem["required"])
    assert "Problem" in doc["components"]["schemas"]  # pairing problems listed in the body

    schemes = doc["components"].get("securitySchemes", {})
    api_ops = [
        op for path, ops in doc["paths"].items() if path.startswith("/v1/") for op in ops.values()
    ]
    open_ops = [
        op
        for path, ops in doc["paths"].items()
        if not path.startswith("/v1/")
        for op in ops.values()
    ]
    if token is None:
        assert not schemes
        assert all("security" not in op and "401" not in op["responses"] for op in api_ops)
    else:
        # The routes here are all a router's: only its scheme is listed.
        assert schemes == {"routerBearer": SECURITY_SCHEMES["router"][1]}
        assert schemes["routerBearer"]["scheme"] == "bearer"
        assert all(
            op["security"] == [{"routerBearer": []}] and {"401", "403"} <= set(op["responses"])
            for op in api_ops
        )
    assert all("security" not in op for op in open_ops)


def test_build_openapi_without_an_app() -> None:
    table = RouteTable()
    table.add("GET", "/v1/things/{thing_id}", handler, response=Thing)
    table.add("POST", "/v1/peer/things", handler, request=Thing, role="peer")
    doc = build_openapi(table, server_url="http://x:1", secured=lambda role: role == "peer")
    assert doc["components"]["securitySchemes"] == dict([SECURITY_SCHEMES["peer"]])
    peer_op = doc["paths"]["/v1/peer/things"]["post"]
    assert peer_op["security"] == [{"peerSignature": []}]
    assert {"401", "403", "409", "415"} <= set(peer_op["responses"])  # 409: a replay
    assert "security" not in doc["paths"]["/v1/things/{thing_id}"]["get"]  # an open router
    assert doc["servers"] == [{"url": "http://x:1"}]
    assert doc["paths"]["/v1/things/{thing_id}"]["get"]["operationId"] == "handler"
    assert all(isinstance(resolve(doc, ref), dict) for ref in refs(doc))


def test_openapi_is_built_after_extensions() -> None:
    app = create_app(make_config(), extensions=[install])
    assert any(r.path == "/v1/things" for r in app[ROUTES])
    assert any(resource.canonical == "/v1/things" for resource in app.router.resources())
