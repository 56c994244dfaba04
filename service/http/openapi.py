"""The OpenAPI 3.1 document, generated from the app's `RouteTable`.

Called once per app (lazily, by `GET /openapi.json`) after every extension registered its routes.
Component schemas come from `msgspec.json.schema_components` over every request/response type,
so the document describes exactly what the decoders accept; errors point at one
`ProblemDetails` schema served as `application/problem+json`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import msgspec

from kvhandoff.service.http.peer_signing import SIGNATURE_HEADER
from kvhandoff.service.http.problems import PROBLEM_CONTENT_TYPE, TITLES, ProblemDetails
from kvhandoff.service.http.routing import AuthRole, Route

OPENAPI_VERSION = "3.1.0"
REF_TEMPLATE = "#/components/schemas/{name}"

#: One security scheme per role (kvhandoff.service.http.auth). A peer request is signed over several
#: headers; OpenAPI can name only one, so the scheme names the signature and describes the rest.
SECURITY_SCHEMES: dict[str, tuple[str, dict[str, Any]]] = {
    "router": (
        "routerBearer",
        {"type": "http", "scheme": "bearer", "description": "a router's token (auth.router)"},
    ),
    "engine": (
        "engineBearer",
        {"type": "http", "scheme": "bearer", "description": "an engine's token (auth.engine)"},
    ),
    "peer": (
        "peerSignature",
        {
            "type": "apiKey",
            "in": "header",
            "name": SIGNATURE_HEADER,
            "description": "HMAC-SHA256 with a peer secret over method, path, timestamp, nonce, "
            "sender and body, with KVHandoff-Sender, -Timestamp and -Nonce headers (see "
            "service/http/peer_signing.py)",
        },
    ),
}


#: One Server-Sent Events frame as a client parses it (what tools validate each event against):
#: `event` is the stable tag, `id` the sequence number, `data` the JSON event as text.
SSE_EVENT_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "event": {"type": "string"},
        "id": {"type": "string"},
        "data": {"type": "string"},
        "retry": {"type": "integer"},
    },
}


def _never(role: AuthRole) -> bool:
    return False


def build_openapi(
    routes: Iterable[Route],
    *,
    title: str = "kvhandoff",
    version: str = "0.1.0",
    description: str = "",
    server_url: str | None = None,
    secured: Callable[[AuthRole], bool] = _never,
) -> dict[str, Any]:
    """The document for `routes`; `secured(role)` says which roles need a credential here."""
    documented = [r for r in routes if r.in_schema]
    types: list[Any] = [ProblemDetails]
    for r in documented:
        types.extend(t for t in (r.request, r.response) if t is not None)
    type_refs, components = msgspec.json.schema_components(
        _unique(types), ref_template=REF_TEMPLATE
    )
    schema_of = dict(zip(_unique(types), type_refs))

    paths: dict[str, dict[str, Any]] = {}
    for r in documented:
        paths.setdefault(r.openapi_path, {})[r.method.lower()] = _operation(
            r, schema_of, secured(r.auth_role)
        )

    doc: dict[str, Any] = {
        "openapi": OPENAPI_VERSION,
        "info": {"title": title, "version": version, "description": description},
        "paths": paths,
        "components": {"schemas": components},
    }
    if server_url:
        doc["servers"] = [{"url": server_url}]
    used = {r.auth_role for r in documented if secured(r.auth_role)}
    schemes = dict(SECURITY_SCHEMES[role] for role in sorted(used))
    if schemes:
        doc["components"]["securitySchemes"] = schemes
    return doc


def _operation(r: Route, schema_of: dict[Any, Any], secured: bool) -> dict[str, Any]:
    op: dict[str, Any] = {"operationId": r.operation_id, "responses": {}}
    if r.summary:
        op["summary"] = r.summary
    if r.description:
        op["description"] = r.description
    if r.tags:
        op["tags"] = list(r.tags)
    parameters = [
        {"name": p, "in": "path", "required": True, "schema": r.path_schemas.get(p, _STRING)}
        for p in r.path_params
    ]
    parameters += [{"name": n, "in": "query", "schema": schema} for n, schema in r.query]
    if parameters:
        op["parameters"] = parameters
    errors = set(r.errors) | {500}
    if r.request is not None:
        op["requestBody"] = {
            "required": True,
            "content": {"application/json": {"schema": schema_of[r.request]}},
        }
        errors |= {400, 413, 415, 422}
    if secured:
        op["security"] = [{SECURITY_SCHEMES[r.auth_role][0]: []}]
        errors |= {401, 403}
        if r.auth_role == "peer":
            errors.add(409)  # a replayed message

    ok: dict[str, Any] = {"description": "success"}
    if r.response is not None:
        ok["content"] = {r.content_type: {"schema": schema_of[r.response]}}
    elif r.content_type == "text/event-stream":
        ok["content"] = {r.content_type: {"schema": SSE_EVENT_SCHEMA}}
    elif r.content_type != "application/json":
        ok["content"] = {r.content_type: {"schema": {"type": "string"}}}
    for status in (r.status, *r.also):
        op["responses"][str(status)] = ok
    problem = {"$ref": REF_TEMPLATE.format(name=ProblemDetails.__name__)}
    for status in sorted(errors):
        op["responses"][str(status)] = {
            "description": TITLES.get(status, "error"),
            "content": {PROBLEM_CONTENT_TYPE: {"schema": problem}},
        }
    return op


_STRING = {"type": "string"}


def _unique(items: list[Any]) -> list[Any]:
    seen: list[Any] = []
    for item in items:
        if item not in seen:  # types may be unhashable generics (list[X]); compare by equality
            seen.append(item)
    return seen
