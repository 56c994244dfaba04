"""The aiohttp application: factory, middlewares, health/readiness, OpenAPI, JSON helpers.

`create_app(config, extensions=[...])` builds the app; each extension is a plain function
`install(app) -> None` called before the app starts, which may:

- declare routes: `app[ROUTES].include(table)` with a `service.routing.RouteTable`;
- own long-lived resources: `app.cleanup_ctx.append(ctx)` (an async generator over `app`:
  start, `yield`, stop), storing them under its own `web.AppKey`s;
- gate readiness: `app[READINESS].add("transport", check)`, where `check()` returns a bool or an
  awaitable bool (`GET /readyz` answers 503 naming every failing check);
- read the configuration: `app[CONFIG]`; call peer services: `app[PEERS]` (a `PeerClient`,
  available once the app has started).

Handlers raise the error tree (`kvhandoff.pipelines.errors`, `kvhandoff.service.http.problems`),
never `web.HTTP*`; the one error middleware turns errors into problem+json. Built-in routes:
`/healthz`, `/readyz`, `/openapi.json`. Each route takes its role's credential
(kvhandoff.service.http.auth).
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from functools import cache
from typing import Any, TypeVar, cast

import aiohttp
import msgspec
from aiohttp import web
from aiohttp.abc import AbstractAccessLogger
from msgspec import Struct

from kvhandoff.pipelines.errors import InvalidInput, KVHandoffError
from kvhandoff.pipelines.peercache import new_incarnation
from kvhandoff.service.config import Config
from kvhandoff.service.http.auth import Credentials, answer_middleware, auth_middleware, signer_for
from kvhandoff.service.http.egress import EGRESS, Egress
from kvhandoff.service.http.openapi import build_openapi
from kvhandoff.service.http.peer_client import PeerClient
from kvhandoff.service.http.peer_signing import AnswerSigner
from kvhandoff.service.http.problems import (
    PROBLEM_CONTENT_TYPE,
    MalformedBody,
    MethodNotAllowed,
    NotReady,
    PayloadTooLarge,
    RouteNotFound,
    Unauthorized,
    UnsupportedMediaType,
    encode_problem,
    error_problem,
    invalid_value,
    problem_body,
)
from kvhandoff.service.http.routing import Route, RouteTable

log = logging.getLogger("kvhandoff.service")
access_log = logging.getLogger("kvhandoff.access")

T = TypeVar("T")
Extension = Callable[[web.Application], None]
ReadinessCheck = Callable[[], bool | Awaitable[bool]]

VERSION = "0.1.0"


class PeerReady(Struct, frozen=True):
    """One peer in `/readyz`'s `peers` section: whether it is reachable now."""

    url: str
    up: bool
    configured: bool  # named in `peers.prefill`: what a decode's readiness asks about
    last_heard_s: float | None  # seconds since it was last heard; None: never


class Readiness:
    """Named readiness checks; the app is ready when every one passes. `peers` reports the
    peers behind the `peers` check (set by the role's runtime once it runs)."""

    def __init__(self) -> None:
        self._checks: dict[str, ReadinessCheck] = {}
        self.peers: Callable[[], list[PeerReady]] = list

    def add(self, name: str, check: ReadinessCheck) -> None:
        self._checks[name] = check

    async def failing(self) -> list[str]:
        failed = []
        for name, check in self._checks.items():
            try:
                result = check()
                ok = await result if isinstance(result, Awaitable) else result
            except Exception:  # a check that crashes means "not ready", and must not 500 /readyz
                log.warning("readiness check %s raised", name, exc_info=True)
                ok = False
            if not ok:
                failed.append(name)
        return failed

    @property
    def names(self) -> list[str]:
        return list(self._checks)


CONFIG = web.AppKey("config", Config)
ROUTES = web.AppKey("routes", RouteTable)
READINESS = web.AppKey("readiness", Readiness)
PEERS = web.AppKey("peers", PeerClient)
#: This service life's incarnation, drawn when the app is made: the runtime publishes it, and
#: the peer requests it accepts and the answers it signs are bound to it.
INCARNATION = web.AppKey("incarnation", str)
#: Set by whoever starts the transport (its `local_target`), for the start-up log line.
LOCAL_TARGET = web.AppKey("local_target", str)
_OPENAPI = web.AppKey("openapi_cache", dict)
_CREDENTIALS = web.AppKey("credentials", Credentials)


# ---------------------------------------------------------------------------------------------
# JSON in and out

_encoder = msgspec.json.Encoder()


def json_response(
    body: Any, *, status: int = 200, headers: dict[str, str] | None = None
) -> web.Response:
    """A JSON response from any msgspec-encodable value (Structs, dicts, lists)."""
    return web.Response(
        body=_encoder.encode(body), status=status, headers=headers, content_type="application/json"
    )


@cache
def _decoder(type_: Any) -> msgspec.json.Decoder[Any]:
    return msgspec.json.Decoder(type_)


#: Deepest nesting of arrays and objects a body may have; well below the interpreter's recursion
#: limit, so decoding, storing and re-encoding a body (events, webhooks) cannot overflow it.
MAX_JSON_DEPTH = 64


async def decode_body(request: web.Request, type_: type[T]) -> T:
    """Read the body (at most `server.max_body_bytes`) and decode it as `type_`.

    Raises UnsupportedMediaType (415) unless it is sent as `application/json`, MalformedBody
    (400) if it is not JSON or nests deeper than MAX_JSON_DEPTH, InvalidInput (422) with `field`
    set to the key path of the wrong value (`dst_pages[3]`), PayloadTooLarge (413).
    """
    return decode_json(await read_json_body(request), type_)


async def read_json_body(request: web.Request) -> bytes:
    """The body, not decoded yet; `decode_body`'s errors for its media type and size."""
    if request.content_type != "application/json":
        raise UnsupportedMediaType(
            f"the body must be sent as application/json, not {request.content_type}",
            field="Content-Type",
        )
    try:
        return await request.read()
    except web.HTTPRequestEntityTooLarge:
        raise _too_large(request) from None


def decode_json(raw: bytes, type_: type[T]) -> T:
    """`raw` decoded as `type_`, with `decode_body`'s errors (a body that came another way: a
    peer channel's frame)."""
    depth = json_depth(raw)
    if depth > MAX_JSON_DEPTH:
        raise MalformedBody(f"request body nests more than {MAX_JSON_DEPTH} levels deep", field="$")
    try:
        decoded: T = _decoder(cast(Any, type_)).decode(raw)
        return decoded
    except msgspec.ValidationError as exc:
        raise invalid_value(exc) from None
    except msgspec.DecodeError as exc:
        raise MalformedBody(f"request body is not valid JSON: {exc}", field="$") from None


def decode_items(raw_items: list[msgspec.Raw], type_: type[T]) -> list[T | InvalidInput]:
    """Each item of a batch body (decoded as `list[msgspec.Raw]` by `decode_body`) as `type_`,
    or the InvalidInput naming its wrong field (`rows[0]`): one bad item is answered alone,
    and the batch's other items still are."""
    decoder = _decoder(cast(Any, type_))
    out: list[T | InvalidInput] = []
    for raw in raw_items:
        try:
            out.append(decoder.decode(raw))
        except msgspec.ValidationError as exc:
            out.append(invalid_value(exc))
    return out


# One escape (a backslash and the byte after it): removed, an escaped quote ends no string.
_JSON_ESCAPE = re.compile(rb"\\.", re.S)
# One bracket kind for arrays and objects, every byte but brackets and quotes deleted.
_ONE_BRACKET = bytes.maketrans(b"{}", b"[]")
_NOT_BRACKET_OR_QUOTE = bytes(range(256)).translate(None, b'[]{}"')


def json_depth(raw: bytes) -> int:
    """The deepest array/object nesting of a JSON text (brackets inside strings not counted):
    0 for a text with too few brackets to pass MAX_JSON_DEPTH, else exact up to MAX_JSON_DEPTH
    and MAX_JSON_DEPTH + 1 for anything deeper.

    Every step is a C pass over bytes: strings are cut out, the rest is reduced to brackets,
    and each `replace(b"[]", b"")` pass removes the innermost level, so a body `d` deep is
    empty after `d` passes; the passes stop past the limit, so a deep body costs at most
    MAX_JSON_DEPTH + 1 passes over its (already bracket-only) bytes.
    """
    if raw.count(b"[") + raw.count(b"{") <= MAX_JSON_DEPTH:
        return 0  # cannot be too deep: skip the scan for the common small body
    if b"\\" in raw:
        # Escapes removed left to right, as the decoder reads them (an escaped backslash
        # before a quote leaves that quote to end the string). One linear pass: a regex
        # matching whole strings retries from every quote, quadratic in a body of escaped
        # quotes (seconds for 40 KiB).
        raw = _JSON_ESCAPE.sub(b"", raw)
    brackets = raw.translate(_ONE_BRACKET, _NOT_BRACKET_OR_QUOTE)
    # Without escapes every quote opens or closes a string (as the decoder reads it, up to
    # wherever an unclosed one makes it fail): the even pieces are what lies outside strings.
    brackets = b"".join(brackets.split(b'"')[::2])
    for depth in range(MAX_JSON_DEPTH + 1):
        if not brackets:
            return depth
        inner = brackets.replace(b"[]", b"")
        if len(inner) == len(brackets):
            # Unbalanced (not JSON; the decoder refuses it): count every unclosed bracket as one
            # more level, so the bound errs deep, never shallow.
            return min(depth + brackets.count(b"["), MAX_JSON_DEPTH + 1)
        brackets = inner
    return MAX_JSON_DEPTH + 1


def _too_large(request: web.Request) -> PayloadTooLarge:
    limit = request.app[CONFIG].server.max_body_bytes
    return PayloadTooLarge(f"request body exceeds {limit} bytes", max_bytes=limit)


# ---------------------------------------------------------------------------------------------
# Middlewares


def _problem_response(
    status: int, body: dict[str, Any], headers: dict[str, str] | None = None
) -> web.Response:
    return web.Response(
        body=encode_problem(body), status=status, headers=headers, content_type=PROBLEM_CONTENT_TYPE
    )


def _error_response(error: KVHandoffError, request: web.Request) -> web.Response:
    status, body = error_problem(error, request.path)
    headers = {}
    if isinstance(error, Unauthorized):
        scheme = "KVHandoff-Signature" if error.context.get("role") == "peer" else "Bearer"
        headers["WWW-Authenticate"] = f'{scheme} realm="kvhandoff"'
    if isinstance(error, MethodNotAllowed) and "allow" in error.context:
        headers["Allow"] = ", ".join(sorted(error.context["allow"]))  # type: ignore[call-overload]
    return _problem_response(status, body, headers)


def _from_http_exception(exc: web.HTTPException, request: web.Request) -> KVHandoffError | None:
    """aiohttp's own errors (routing, body limit) as our errors; None for any other status."""
    if exc.status == 404:
        return RouteNotFound(f"no route for {request.path}")
    if exc.status == 405 and isinstance(exc, web.HTTPMethodNotAllowed):
        return MethodNotAllowed(
            f"{request.method} is not allowed on {request.path}", allow=sorted(exc.allowed_methods)
        )
    if exc.status == 413:
        return _too_large(request)
    return None


@web.middleware
async def error_middleware(request: web.Request, handler: Any) -> web.StreamResponse:
    """The one place errors become responses; the one broad except in the service."""
    try:
        return await handler(request)  # type: ignore[no-any-return]
    except KVHandoffError as error:
        return _error_response(error, request)
    except web.HTTPException as exc:
        mapped = _from_http_exception(exc, request)
        if mapped is not None:
            return _error_response(mapped, request)
        if exc.status < 400:  # redirects and the like pass through
            raise
        # Any other HTTP error aiohttp raises keeps its status, as a problem.
        body = problem_body(
            status=exc.status, code="http_error", detail=exc.reason, instance=request.path
        )
        headers = {
            k: v
            for k, v in exc.headers.items()
            if k.lower() not in {"content-type", "content-length"}
        }
        return _problem_response(exc.status, body, headers)
    except Exception:
        log.exception("unhandled error in %s %s", request.method, request.path)
        body = problem_body(
            status=500,
            code="internal_error",
            detail="an unexpected error occurred; see the service log",
            instance=request.path,
        )
        return _problem_response(500, body)


class AccessLogger(AbstractAccessLogger):
    """One debug line per request (method, path, status, duration)."""

    def log(self, request: web.BaseRequest, response: web.StreamResponse, time_s: float) -> None:
        if self.logger.isEnabledFor(logging.DEBUG):
            self.logger.debug(
                "%s %s %s %.1fms", request.method, request.path, response.status, time_s * 1e3
            )


# ---------------------------------------------------------------------------------------------
# Built-in routes


class Health(Struct, frozen=True):
    status: str
    role: str
    version: str
    uptime_s: float


class Ready(Struct, frozen=True, omit_defaults=True):
    status: str
    checks: list[str]
    peers: list[PeerReady] = []
    #: `transfer.mode`: `direct` on a decode means its KV pages are registered with the
    #: transport, so any client of that port can write them (README, SAFETY.md).
    transfer_mode: str = ""


_started = web.AppKey("started_monotonic", float)


async def healthz(request: web.Request) -> web.Response:
    app = request.app
    return json_response(
        Health("ok", app[CONFIG].role, VERSION, round(time.monotonic() - app[_started], 3))
    )


async def readyz(request: web.Request) -> web.Response:
    readiness = request.app[READINESS]
    failed = await readiness.failing()
    peers = readiness.peers()
    if failed:
        context: dict[str, Any] = {"not_ready": failed}
        if peers:
            context["peers"] = msgspec.to_builtins(peers)
        raise NotReady(f"not ready: {', '.join(failed)}", **context)
    mode = request.app[CONFIG].transfer.mode
    return json_response(Ready("ready", readiness.names, peers, transfer_mode=mode))


def openapi_document(app: web.Application) -> dict[str, Any]:
    """The OpenAPI document of `app`'s routes, built once (its route table is final by then);
    `GET /openapi.json` serves it and the documentation site's API reference is made from it."""
    cache = app[_OPENAPI]
    if not cache:
        config = app[CONFIG]
        routes: RouteTable = app[ROUTES]
        cache.update(
            build_openapi(
                list(routes),
                title=f"kvhandoff ({config.role})",
                version=VERSION,
                server_url=config.server.public_url,
                secured=app[_CREDENTIALS].secured,
            )
        )
    return cache


async def openapi_json(request: web.Request) -> web.Response:
    return json_response(openapi_document(request.app))


def _builtin_routes() -> RouteTable:
    routes = RouteTable()
    routes.add("GET", "/healthz", healthz, summary="process is alive", response=Health)
    routes.add(
        "GET",
        "/readyz",
        readyz,
        summary="every readiness check passes (503 names those that fail)",
        response=Ready,
        errors=(503,),
    )
    routes.add("GET", "/openapi.json", openapi_json, summary="this document", response=dict)
    return routes


def answers_of(app: web.Application) -> AnswerSigner | None:
    """What signs this service's answers to peer requests (None when peer auth is off)."""
    return app[_CREDENTIALS].answers


# ---------------------------------------------------------------------------------------------
# The factory


async def _peer_client_ctx(app: web.Application) -> AsyncIterator[None]:
    config = app[CONFIG]
    async with aiohttp.ClientSession() as session:
        app[PEERS] = PeerClient(
            session,
            signer=signer_for(config),
            timeout_s=config.peers.request_timeout_s,
            egress=app[EGRESS],
            channels=config.peers.channels,
            max_body_bytes=config.server.max_body_bytes,
        )
        yield
        await app[PEERS].close()


async def _clock_ctx(app: web.Application) -> AsyncIterator[None]:
    app[_started] = time.monotonic()
    yield


def create_app(config: Config, *, extensions: Sequence[Extension] = ()) -> web.Application:
    """The service app for `config`, with every extension installed (see the module docstring)."""
    incarnation = new_incarnation()
    credentials = Credentials.from_config(config, incarnation)
    declared: dict[web.AbstractRoute, Route] = {}  # filled below, once every route is known
    middlewares = [
        answer_middleware(credentials),  # outermost: it signs the error middleware's answers
        error_middleware,
        auth_middleware(credentials, declared),
    ]
    app = web.Application(middlewares=middlewares, client_max_size=config.server.max_body_bytes)
    app[CONFIG] = config
    app[INCARNATION] = incarnation
    app[_CREDENTIALS] = credentials
    app[ROUTES] = RouteTable()
    app[READINESS] = Readiness()
    app[EGRESS] = Egress()
    app[_OPENAPI] = {}
    app.cleanup_ctx.append(_clock_ctx)
    app.cleanup_ctx.append(_peer_client_ctx)
    app[ROUTES].include(_builtin_routes())
    for install in extensions:
        install(app)
    declared.update(app[ROUTES].register(app.router))
    return app
