"""The OpenAPI 3.1 document, generated from the app's `RouteTable`.

Called once per app (lazily, by `GET /openapi.json`) after every extension registered its routes.
Component schemas come from `msgspec.json.schema_components` over every request/response type,
so the document describes exactly what the decoders accept; errors point at one
`ProblemDetails` schema served as `application/problem+json`.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import msgspec

from service.http.problems import PROBLEM_CONTENT_TYPE, TITLES, ProblemDetails
from service.http.routing import Route

OPENAPI_VERSION = "3.1.0"
REF_TEMPLATE = "#/components/schemas/{name}"
SECURITY_SCHEME = "bearerAuth"


def build_openapi(
    routes: Iterable[Route],
    *,
    title: str = "kvhandoff",
    version: str = "0.1.0",
    description: str = "",
    server_url: str | None = None,
    token_required: bool = False,
) -> dict[str, Any]:
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
            r, schema_of, token_required
        )

    doc: dict[str, Any] = {
        "openapi": OPENAPI_VERSION,
        "info": {"title": title, "version": version, "description": description},
        "paths": paths,
        "components": {"schemas": components},
    }
    if server_url:
        doc["servers"] = [{"url": server_url}]
    if token_required:
        doc["components"]["securitySchemes"] = {
            SECURITY_SCHEME: {"type": "http", "scheme": "bearer"}
        }
    return doc


def _operation(r: Route, schema_of: dict[Any, Any], token_required: bool) -> dict[str, Any]:
    op: dict[str, Any] = {"operationId": r.operation_id, "responses": {}}
    if r.summary:
        op["summary"] = r.summary
    if r.description:
        op["description"] = r.description
    if r.tags:
        op["tags"] = list(r.tags)
    if r.path_params:
        op["parameters"] = [
            {"name": p, "in": "path", "required": True, "schema": {"type": "string"}}
            for p in r.path_params
        ]
    errors = set(r.errors) | {500}
    if r.request is not None:
        op["requestBody"] = {
            "required": True,
            "content": {"application/json": {"schema": schema_of[r.request]}},
        }
        errors |= {400, 413, 422}
    if r.is_api and token_required:
        op["security"] = [{SECURITY_SCHEME: []}]
        errors.add(401)

    ok: dict[str, Any] = {"description": "success"}
    if r.response is not None:
        ok["content"] = {r.content_type: {"schema": schema_of[r.response]}}
    elif r.content_type != "application/json":
        ok["content"] = {r.content_type: {"schema": {"type": "string"}}}
    op["responses"][str(r.status)] = ok
    problem = {"$ref": REF_TEMPLATE.format(name=ProblemDetails.__name__)}
    for status in sorted(errors):
        op["responses"][str(status)] = {
            "description": TITLES.get(status, "error"),
            "content": {PROBLEM_CONTENT_TYPE: {"schema": problem}},
        }
    return op


def _unique(items: list[Any]) -> list[Any]:
    seen: list[Any] = []
    for item in items:
        if item not in seen:  # types may be unhashable generics (list[X]); compare by equality
            seen.append(item)
    return seen
