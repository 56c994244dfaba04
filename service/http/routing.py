"""Route declarations: one table drives both aiohttp's router and the OpenAPI document.

Domain modules build a `RouteTable` (decorators, like `web.RouteTableDef`) that also says what
each route takes and returns; an app extension hands it to the app with
`app[ROUTES].include(table)`. `create_app` registers every declared route after all extensions
ran, so the router and `/openapi.json` cannot disagree.
"""

from __future__ import annotations

import re
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Literal

from aiohttp import web

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

#: Routes under this prefix are the API (a credential when configured); the rest stay open.
API_PREFIX = "/v1/"
#: Everything under it is the peer protocol: signed with the peer secret, whatever it declares.
PEER_PREFIX = "/v1/peer/"

#: Who may call a route (see kvhandoff.service.http.auth): a router's or an engine's bearer token, a
#: peer service's signature, or anyone.
AuthRole = Literal["router", "engine", "peer", "open"]


@dataclass(frozen=True, slots=True)
class Route:
    """One HTTP route and its contract.

    `request` is the body type (a msgspec Struct, decoded with `decode_body`); `response` the
    type of the success body (any msgspec-encodable type, or None for no JSON body) with status
    `status`; `errors` the problem statuses a caller should expect besides the automatic ones
    (401/403 when the route's role has a credential, 400/413/415/422 when there is a request
    body, 500). `role` says whose credential the route takes; unset, an API route is a
    router's and any other route is open, so a route added without thought is never open.
    """

    method: str
    path: str
    handler: Handler
    summary: str = ""
    description: str = ""
    request: Any = None
    response: Any = None
    status: int = 200
    errors: tuple[int, ...] = ()
    content_type: str = "application/json"  # e.g. "text/event-stream", "text/html"
    tags: tuple[str, ...] = ()
    name: str | None = None
    in_schema: bool = True
    role: AuthRole | None = None
    #: Query parameters, documented in OpenAPI: (name, JSON schema) pairs.
    query: tuple[tuple[str, dict[str, Any]], ...] = ()
    #: JSON schemas of path parameters (default: any string), e.g. the handoff id's pattern.
    path_schemas: dict[str, dict[str, Any]] = field(default_factory=dict)
    #: Other success statuses with the same body (e.g. 200 for a repeated create).
    also: tuple[int, ...] = ()

    @property
    def is_api(self) -> bool:
        return self.path.startswith(API_PREFIX)

    @property
    def auth_role(self) -> AuthRole:
        if self.path.startswith(PEER_PREFIX):
            # Structural, not per declaration: a peer route that forgot `role=` must not take a
            # router's credential (a peer message moves or frees decode memory).
            if self.role not in (None, "peer"):
                raise ValueError(f"{self.path} is a peer route; it cannot take role {self.role}")
            return "peer"
        if self.role is not None:
            return self.role
        return "router" if self.is_api else "open"

    @property
    def path_params(self) -> list[str]:
        return re.findall(r"\{([^}:]+)(?::[^}]*)?\}", self.path)

    @property
    def openapi_path(self) -> str:
        """The path without aiohttp's regex parts: `/v1/handoffs/{id:[^/]+}` → `{id}`."""
        return re.sub(r"\{([^}:]+)(?::[^}]*)?\}", r"{\1}", self.path)

    @property
    def operation_id(self) -> str:
        return self.name or str(getattr(self.handler, "__name__", f"{self.method}_{self.path}"))


class RouteTable:
    """An ordered collection of `Route`s; iterate it, `add` to it, or decorate handlers."""

    def __init__(self) -> None:
        self._routes: list[Route] = []

    def add(self, method: str, path: str, handler: Handler, **contract: Any) -> Route:
        route = Route(method.upper(), path, handler, **contract)
        self._routes.append(route)
        return route

    def route(self, method: str, path: str, **contract: Any) -> Callable[[Handler], Handler]:
        def register(handler: Handler) -> Handler:
            self.add(method, path, handler, **contract)
            return handler

        return register

    def get(self, path: str, **contract: Any) -> Callable[[Handler], Handler]:
        return self.route("GET", path, **contract)

    def post(self, path: str, **contract: Any) -> Callable[[Handler], Handler]:
        return self.route("POST", path, **contract)

    def put(self, path: str, **contract: Any) -> Callable[[Handler], Handler]:
        return self.route("PUT", path, **contract)

    def delete(self, path: str, **contract: Any) -> Callable[[Handler], Handler]:
        return self.route("DELETE", path, **contract)

    def include(self, other: RouteTable) -> None:
        self._routes.extend(other)

    def __iter__(self) -> Iterator[Route]:
        return iter(list(self._routes))

    def __len__(self) -> int:
        return len(self._routes)

    def register(self, router: web.UrlDispatcher) -> dict[web.AbstractRoute, Route]:
        """Add every route to aiohttp's router; returns aiohttp's route → its declaration (what
        the auth middleware reads the role from)."""
        declared = {}
        for route in self._routes:
            added = router.add_route(route.method, route.path, route.handler, name=route.name)
            declared[added] = route
        return declared
