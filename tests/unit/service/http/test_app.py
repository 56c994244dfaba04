from __future__ import annotations

import json
import logging
import random
import time
from typing import Annotated, Any

import msgspec
import pytest
from aiohttp import web

from kvhandoff.pipelines.errors import (
    ConflictError,
    DeadlineExceeded,
    InvalidInput,
    KVHandoffError,
    LayoutError,
    NotFoundError,
    PairingError,
    PlanError,
    TransportError,
    TransportTimeout,
)
from kvhandoff.pipelines.pairing_problems import Problem
from kvhandoff.service.http.app import (
    CONFIG,
    MAX_JSON_DEPTH,
    PEERS,
    READINESS,
    ROUTES,
    decode_body,
    json_depth,
    json_response,
)
from kvhandoff.service.http.peer_client import PeerClient
from kvhandoff.service.http.problems import PROBLEM_CONTENT_TYPE, TYPE_PREFIX
from kvhandoff.service.http.routing import RouteTable
from tests.unit.service.conftest import ClientFactory, make_config

PAIRING_PROBLEMS = [
    Problem("missing_destination", "no destination for layer 7 group 1", layer_id=7, group=1),
    Problem("slot_size_mismatch", "conv slot 768 != 512", layer_id=2, kind="conv"),
]

RAISED: dict[str, KVHandoffError] = {
    "invalid": InvalidInput("num_pages must be positive", field="num_pages"),
    "layout": LayoutError("3 buffers for 2 layers", field="kv_layer_ids"),
    "plan": PlanError("page 99 outside the pool", field="dst_pages", pp_rank=1),
    "pairing": PairingError(list(PAIRING_PROBLEMS)),
    "conflict": ConflictError("page 3 is leased to h1", field="dst_pages"),
    "missing": NotFoundError("no handoff h9"),
    "deadline": DeadlineExceeded("handoff h1 passed its deadline"),
    "transport": TransportError("batch failed", rc=-1, peer="127.0.0.1:1234"),
    "transport_timeout": TransportTimeout("batch timed out", peer="127.0.0.1:1234"),
}

EXPECTED = {
    "invalid": (422, "invalid_input"),
    "layout": (422, "layout_error"),
    "plan": (422, "plan_error"),
    "pairing": (422, "pairing_error"),
    "conflict": (409, "conflict"),
    "missing": (404, "not_found"),
    "deadline": (504, "deadline_exceeded"),
    "transport": (502, "transport_error"),
    "transport_timeout": (504, "transport_timeout"),
}


JSON = {"Content-Type": "application/json"}


class Body(msgspec.Struct, forbid_unknown_fields=True):
    request_id: str
    dst_pages: list[Annotated[int, msgspec.Meta(ge=0)]]


def install_test_routes(app: web.Application) -> None:
    routes = RouteTable()

    @routes.get("/v1/raise/{name}")
    async def raise_named(request: web.Request) -> web.Response:
        raise RAISED[request.match_info["name"]]

    @routes.get("/v1/crash")
    async def crash(request: web.Request) -> web.Response:
        raise RuntimeError("secret internals")

    @routes.post("/v1/echo", request=Body, response=Body)
    async def echo(request: web.Request) -> web.Response:
        return json_response(await decode_body(request, Body), status=201)

    @routes.get("/v1/aiohttp-error")
    async def aiohttp_error(request: web.Request) -> web.Response:
        raise web.HTTPUnsupportedMediaType(reason="text/xml is not supported")

    @routes.get("/v1/config-role")
    async def role(request: web.Request) -> web.Response:
        return json_response({"role": request.app[CONFIG].role})

    app[ROUTES].include(routes)


async def problem(response: Any) -> dict[str, Any]:
    assert response.content_type == PROBLEM_CONTENT_TYPE
    body: dict[str, Any] = await response.json(content_type=PROBLEM_CONTENT_TYPE)
    assert body["status"] == response.status
    assert body["type"] == TYPE_PREFIX + body["code"]
    assert {"title", "detail", "instance"} <= set(body)
    return body


@pytest.mark.parametrize("name", list(RAISED))
async def test_domain_errors_become_problems(make_client: ClientFactory, name: str) -> None:
    client = await make_client(extensions=[install_test_routes])
    response = await client.get(f"/v1/raise/{name}")
    body = await problem(response)
    assert (response.status, body["code"]) == EXPECTED[name]
    error = RAISED[name]
    assert body["detail"] == error.message
    assert body["instance"] == f"/v1/raise/{name}"
    for key, value in error.context.items():
        assert body[key] == value


async def test_pairing_problem_lists_every_problem(make_client: ClientFactory) -> None:
    client = await make_client(extensions=[install_test_routes])
    body = await problem(await client.get("/v1/raise/pairing"))
    assert body["problems"] == msgspec.to_builtins(PAIRING_PROBLEMS)
    assert (body["layer_id"], body["group"]) == (7, 1)  # the first problem, as extension members


async def test_unexpected_error_is_logged_500_without_internals(
    make_client: ClientFactory, caplog: pytest.LogCaptureFixture
) -> None:
    client = await make_client(extensions=[install_test_routes])
    with caplog.at_level(logging.ERROR, logger="kvhandoff.service"):
        response = await client.get("/v1/crash")
    body = await problem(response)
    assert (response.status, body["code"]) == (500, "internal_error")
    assert "secret" not in await response.text()
    assert any("secret internals" in (r.exc_text or "") for r in caplog.records)


async def test_other_aiohttp_errors_keep_their_status(make_client: ClientFactory) -> None:
    client = await make_client(extensions=[install_test_routes])
    response = await client.get("/v1/aiohttp-error")
    body = await problem(response)
    assert (response.status, body["code"]) == (415, "http_error")
    assert body["detail"] == "text/xml is not supported"


async def test_decode_body_ok(make_client: ClientFactory) -> None:
    client = await make_client(extensions=[install_test_routes])
    response = await client.post("/v1/echo", json={"request_id": "r1", "dst_pages": [1, 2]})
    assert response.status == 201
    assert await response.json() == {"request_id": "r1", "dst_pages": [1, 2]}


@pytest.mark.parametrize(
    ("payload", "status", "field", "fragment"),
    [
        (b'{"request_id": "r", "dst_pages": [0, 1, 2, "x"]}', 422, "dst_pages[3]", "got `str`"),
        (b'{"request_id": "r", "dst_pages": [-1]}', 422, "dst_pages[0]", ">= 0"),
        (b'{"dst_pages": []}', 422, "request_id", "missing required field `request_id`"),
        (b'{"request_id": "r", "dst_pages": [], "x": 1}', 422, "x", "unknown field `x`"),
        (b'{"request_id": ', 400, "$", "not valid JSON"),
        (b"", 400, "$", "not valid JSON"),
    ],
)
async def test_decode_body_errors_name_the_json_path(
    make_client: ClientFactory, payload: bytes, status: int, field: str, fragment: str
) -> None:
    client = await make_client(extensions=[install_test_routes])
    response = await client.post("/v1/echo", data=payload, headers=JSON)
    body = await problem(response)
    assert response.status == status
    assert body["field"] == field
    assert fragment in body["detail"]


async def test_body_over_the_limit_is_413(make_client: ClientFactory) -> None:
    client = await make_client(make_config(**{"server.max_body_bytes": 64}), [install_test_routes])
    payload = {"request_id": "r", "dst_pages": list(range(100))}
    response = await client.post("/v1/echo", json=payload)
    body = await problem(response)
    assert (response.status, body["code"], body["max_bytes"]) == (413, "payload_too_large", 64)
    small = await client.post("/v1/echo", json={"request_id": "r", "dst_pages": []})
    assert small.status == 201


async def test_unknown_route_and_wrong_method(make_client: ClientFactory) -> None:
    client = await make_client(extensions=[install_test_routes])
    missing = await client.get("/v1/nowhere")
    assert (missing.status, (await problem(missing))["code"]) == (404, "route_not_found")
    wrong = await client.delete("/v1/echo")
    assert (wrong.status, (await problem(wrong))["code"]) == (405, "method_not_allowed")
    assert wrong.headers["Allow"] == "POST"


@pytest.mark.parametrize(
    ("headers", "reason"),
    [
        ({}, "missing"),
        ({"Authorization": "Bearer wrong"}, "invalid"),
        ({"Authorization": "t"}, "invalid"),
    ],
)
async def test_api_needs_the_token(
    make_client: ClientFactory, headers: dict[str, str], reason: str
) -> None:
    client = await make_client(make_config(**{"server.token": "t"}), [install_test_routes])
    response = await client.get("/v1/config-role", headers=headers)
    body = await problem(response)
    assert (response.status, body["code"]) == (401, "unauthorized")
    assert response.headers["WWW-Authenticate"].startswith("Bearer")
    assert reason in body["detail"]
    # An unknown /v1 route is not revealed to an unauthenticated caller either.
    assert (await client.get("/v1/nowhere", headers=headers)).status == 401


async def test_token_accepted_and_open_routes_stay_open(make_client: ClientFactory) -> None:
    client = await make_client(make_config(**{"server.token": "t"}), [install_test_routes])
    ok = await client.get("/v1/config-role", headers={"Authorization": "Bearer t"})
    assert (ok.status, await ok.json()) == (200, {"role": "decode"})
    for path in ("/healthz", "/readyz", "/openapi.json"):
        assert (await client.get(path)).status == 200, path


async def test_no_token_configured_means_open_api(make_client: ClientFactory) -> None:
    client = await make_client(extensions=[install_test_routes])
    assert (await client.get("/v1/config-role")).status == 200


async def test_healthz(make_client: ClientFactory) -> None:
    client = await make_client()
    response = await client.get("/healthz")
    body = await response.json()
    assert (response.status, body["status"], body["role"]) == (200, "ok", "decode")
    assert body["uptime_s"] >= 0


async def test_readyz_names_failing_checks(make_client: ClientFactory) -> None:
    state = {"transport": False}

    async def pools_registered() -> bool:
        return True

    def broken() -> bool:
        raise RuntimeError("check crashed")

    def install(app: web.Application) -> None:
        app[READINESS].add("transport", lambda: state["transport"])
        app[READINESS].add("pools", pools_registered)
        app[READINESS].add("broken", broken)

    client = await make_client(extensions=[install])
    response = await client.get("/readyz")
    body = await problem(response)
    assert (response.status, body["code"]) == (503, "not_ready")
    assert body["not_ready"] == ["transport", "broken"]


async def test_readyz_ready(make_client: ClientFactory) -> None:
    def install(app: web.Application) -> None:
        app[READINESS].add("transport", lambda: True)

    client = await make_client(extensions=[install])
    response = await client.get("/readyz")
    assert (response.status, await response.json()) == (
        200,
        # The mode says whether the decode's pages are registered (reachable): landed, they are not.
        {"status": "ready", "checks": ["transport"], "transfer_mode": "landed"},
    )


async def test_cleanup_contexts_and_peer_client_lifecycle(make_client: ClientFactory) -> None:
    events: list[str] = []
    seen: list[PeerClient] = []

    async def resource(app: web.Application) -> Any:
        events.append("start")
        seen.append(app[PEERS])  # started before extensions' contexts
        yield
        events.append("stop")

    def install(app: web.Application) -> None:
        app.cleanup_ctx.append(resource)

    client = await make_client(extensions=[install])
    assert events == ["start"]
    assert isinstance(seen[0], PeerClient)
    await client.close()
    assert events == ["start", "stop"]


def scanned_depth(text: str) -> int:
    """The running bracket depth outside strings, char by char: what `json_depth` computes
    with C passes (and what it did itself before)."""
    depth = deepest = 0
    in_string = escaped = False
    for c in text:
        if in_string:
            in_string = escaped or c != '"'
            escaped = not escaped and c == "\\"
        elif c == '"':
            in_string = True
        elif c in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif c in "]}":
            depth -= 1
    return deepest


def nested_value(depth: int, rng: random.Random) -> object:
    """A JSON value exactly `depth` deep, mixing arrays, objects, siblings and strings full of
    brackets, quotes and backslashes."""
    if depth == 0:
        return rng.choice([1, "x", '[{"\\', "]]}", None])
    inner = nested_value(depth - 1, rng)
    siblings = [nested_value(rng.randrange(min(depth, 3)), rng) for _ in range(rng.randrange(3))]
    if rng.random() < 0.5:
        return [*siblings, inner]
    return {f'k"[{i}': v for i, v in enumerate([*siblings, inner])}


@pytest.mark.parametrize("depth", [MAX_JSON_DEPTH - 1, MAX_JSON_DEPTH, MAX_JSON_DEPTH + 1])
def test_json_depth_at_the_limit(depth: int) -> None:
    # Objects and arrays alike, each level with siblings, so the body has far more brackets
    # than the limit whatever its depth (the shortcut for few brackets does not answer).
    value: object = []
    for k in range(depth - 1):
        value = [[1], {"a": []}, value] if k % 2 else {"s": "]]", "b": [], "v": value}
    text = json.dumps(value)
    assert scanned_depth(text) == depth
    assert json_depth(text.encode()) == depth


def test_json_depth_past_the_limit_stops_counting() -> None:
    assert json_depth(b"[" * 5000 + b"]" * 5000) == MAX_JSON_DEPTH + 1


@pytest.mark.parametrize("seed", range(40))
def test_json_depth_matches_a_char_by_char_scan(seed: int) -> None:
    rng = random.Random(seed)
    depth = rng.choice([rng.randrange(1, 8), rng.randrange(MAX_JSON_DEPTH - 3, MAX_JSON_DEPTH + 4)])
    value = nested_value(depth, rng)
    text = json.dumps([value] * 70) if depth < 8 else json.dumps(value)  # past the shortcut
    assert scanned_depth(text) == depth + (depth < 8)
    assert json_depth(text.encode()) == min(scanned_depth(text), MAX_JSON_DEPTH + 1)


@pytest.mark.parametrize(
    "text",
    [
        '["' + "[" * 100 + '"]',  # brackets inside a string, no escapes
        '["\\"' + "[" * 100 + '"]',  # an escaped quote does not end the string
        '["\\\\", ' + "[[]]," * 40 + "[" * 50 + "]" * 50 + "]",  # an escaped backslash does
    ],
)
def test_json_depth_skips_brackets_in_strings(text: str) -> None:
    assert json_depth(text.encode()) == min(scanned_depth(text), MAX_JSON_DEPTH + 1)


@pytest.mark.parametrize(
    "text", ["[" * 100, "[" * 70 + "]" * 10, "]" * 70 + "[" * 70, '"' + "[" * 99, "[]" * 70 + "]"]
)
def test_json_depth_of_unbalanced_text_errs_deep(text: str) -> None:
    # Not JSON (the decoder refuses it), but it must never pass as shallower than it is.
    assert (json_depth(text.encode()) > MAX_JSON_DEPTH) >= (scanned_depth(text) > MAX_JSON_DEPTH)


def test_json_depth_is_linear_in_a_body_of_escaped_quotes() -> None:
    # Every quote escaped: a scan that retries a string match from each quote is quadratic
    # (seconds at 40 KiB, hours at the body limit); one pass over 2 MiB takes milliseconds.
    raw = b"[" * (MAX_JSON_DEPTH + 1) + b'"' + b'\\"' * (1 << 20)
    started = time.perf_counter()
    assert json_depth(raw) == MAX_JSON_DEPTH + 1  # the string never closes: all brackets count
    assert time.perf_counter() - started < 2.0
    # Closed: the brackets inside the string do not count (but take the scan past its shortcut).
    closed = b"[" * 60 + b'"' + b'\\"' * (1 << 20) + b'[[[[["' + b"]" * 60
    assert json_depth(closed) == 60
