"""Errors ↔ RFC 9457 problem+json: the one place that maps the error tree to HTTP statuses.

Used by the app's error middleware (error → response body) and by the peer client (a remote's
problem body → the same error class here, so a peer's 409 is raised locally as ConflictError).
Also defines the few errors that only the HTTP layer raises (401, 405, 413, 503, peer answers
that are not ours, peer timeouts).

Problem `type`s are `urn:kvhandoff:problem:<code>` — stable identifiers, deliberately not URLs,
since nothing is served at them; `code` is the error class's `code`.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import msgspec
from msgspec import Struct

from kvhandoff.pipelines.errors import (
    CapacityExceeded,
    ConflictError,
    DeadlineExceeded,
    InvalidInput,
    KVHandoffError,
    NotFoundError,
    PairingError,
    PeerUnreachable,
    TransportError,
    TransportTimeout,
)
from kvhandoff.pipelines.messages import decode_error_field
from kvhandoff.pipelines.pairing_problems import Problem as PairingProblem

PROBLEM_CONTENT_TYPE = "application/problem+json"
TYPE_PREFIX = "urn:kvhandoff:problem:"


# ---------------------------------------------------------------------------------------------
# Errors only the HTTP layer raises


class MalformedBody(InvalidInput):
    """The body is not JSON at all (as opposed to JSON with a wrong value: InvalidInput)."""

    code = "malformed_body"


class PayloadTooLarge(InvalidInput):
    code = "payload_too_large"


class RouteNotFound(NotFoundError):
    code = "route_not_found"


class MethodNotAllowed(KVHandoffError):
    code = "method_not_allowed"


class Unauthorized(KVHandoffError):
    """No credential, or one this service does not know, for the route's role."""

    code = "unauthorized"


class Forbidden(KVHandoffError):
    """A known credential of another role, or a signed sender speaking for someone else."""

    code = "forbidden"


class Replayed(ConflictError):
    """A signed peer message that was already received (same nonce), or too old to tell."""

    code = "replayed"


class StaleIncarnation(ConflictError):
    """A signed peer request addressed to another life of this service (it restarted since
    the sender last heard it): the signed answer names the current one."""

    code = "stale_incarnation"


class UnsupportedMediaType(InvalidInput):
    """A `/v1` body that is not `application/json` (a form post would skip CORS preflight)."""

    code = "unsupported_media_type"


class BadRequest(InvalidInput):
    """The HTTP message itself is malformed (aiohttp's parser refused it)."""

    code = "bad_request"


class NotReady(KVHandoffError):
    """Readiness checks failed; `context['not_ready']` lists their names."""

    code = "not_ready"


class PeerError(KVHandoffError):
    """A peer service answered with an error that is not one of ours (e.g. a proxy's 502)."""

    code = "peer_error"


class PeerTimeout(PeerUnreachable):
    """A peer service did not answer within the call's timeout."""

    code = "peer_timeout"


# ---------------------------------------------------------------------------------------------
# The status table. Looked up along the MRO, so the most specific class listed wins.

STATUS: dict[type[KVHandoffError], int] = {
    MalformedBody: 400,
    BadRequest: 400,
    Unauthorized: 401,
    Forbidden: 403,
    NotFoundError: 404,
    MethodNotAllowed: 405,
    ConflictError: 409,
    PayloadTooLarge: 413,
    UnsupportedMediaType: 415,
    CapacityExceeded: 429,
    InvalidInput: 422,  # incl. LayoutError, PlanError: well-formed JSON, impossible values
    PairingError: 422,  # the two layouts themselves are incompatible; retrying cannot help
    TransportError: 502,  # the engine (an upstream of ours) failed; carries rc and peer
    PeerError: 502,
    PeerUnreachable: 502,
    NotReady: 503,
    # 504, not 409: the handoff ran out of time waiting on work upstream of this service (the
    # prefill side, the transfer), which is what Gateway Timeout means; it is retryable, while a
    # 409 would tell the caller its request conflicts with state and must change first.
    DeadlineExceeded: 504,
    TransportTimeout: 504,
    PeerTimeout: 504,
    KVHandoffError: 500,
}

TITLES: dict[int, str] = {
    400: "Malformed request body",
    401: "Unauthorized",
    403: "Forbidden",
    404: "Not found",
    405: "Method not allowed",
    409: "Conflict",
    413: "Request body too large",
    415: "Unsupported media type",
    422: "Invalid input",
    429: "Too many handoffs in flight",
    500: "Internal server error",
    502: "Upstream failure",
    503: "Not ready",
    504: "Deadline exceeded",
}


def status_of(error: KVHandoffError) -> int:
    for cls in type(error).__mro__:
        if cls in STATUS:
            return STATUS[cls]
    return 500


class ProblemDetails(Struct, omit_defaults=True, kw_only=True):
    """The problem+json body (RFC 9457) with kvhandoff's extension members.

    Any other key of an error's `context` is added as an extension member too, so the encoded
    body is built by `problem_body`, not by encoding this Struct; it exists for the schema and
    for decoding peers' problems.
    """

    type: str
    title: str
    status: int
    detail: str = ""
    instance: str = ""
    code: str = ""
    field: str | None = None
    layer_id: int | None = None
    group: int | None = None
    kind: str | None = None
    aux: int | None = None  # an aux entry, by position
    pp_rank: int | None = None
    peer: str | None = None
    rc: int | None = None
    problems: list[PairingProblem] | None = None
    not_ready: list[str] | None = None


def invalid_value(exc: msgspec.ValidationError) -> InvalidInput:
    """msgspec's "Expected `int`, got `str` - at `$.dst_pages[3]`" as InvalidInput whose `field`
    is the key path in the style every other check uses (`dst_pages[3]`; `$` for the whole body).
    """
    return InvalidInput(str(exc), field=decode_error_field(exc))


def problem_body(
    *, status: int, code: str, detail: str, instance: str, extra: dict[str, object] | None = None
) -> dict[str, Any]:
    body: dict[str, Any] = {
        "type": TYPE_PREFIX + code,
        "title": TITLES.get(status, "Error"),
        "status": status,
        "detail": detail,
        "instance": instance,
        "code": code,
    }
    for key, value in (extra or {}).items():
        body.setdefault(key, value)  # context never overrides the standard members
    return body


def error_problem(error: KVHandoffError, instance: str) -> tuple[int, dict[str, Any]]:
    """(status, body) for a domain error: its message, code and context as extension members."""
    status = status_of(error)
    extra = dict(error.context)
    if isinstance(error, PairingError):
        extra["problems"] = list(error.problems)
    return status, problem_body(
        status=status, code=error.code, detail=error.message, instance=instance, extra=extra
    )


_encoder = msgspec.json.Encoder(enc_hook=str)  # unknown context values (enums, paths) as text


def encode_problem(body: dict[str, Any]) -> bytes:
    return _encoder.encode(body)


# ---------------------------------------------------------------------------------------------
# The way back: a peer's problem body → an error of the same class


def _subclasses(cls: type[KVHandoffError]) -> Iterator[type[KVHandoffError]]:
    yield cls
    for sub in cls.__subclasses__():
        yield from _subclasses(sub)


def error_class(code: str) -> type[KVHandoffError] | None:
    """The error class whose `code` is `code`, among every class imported so far."""
    for cls in _subclasses(KVHandoffError):
        if cls.__dict__.get("code") == code:
            return cls
    return None


# When a peer sends a code this build does not know, fall back on its status.
_BY_STATUS: dict[int, type[KVHandoffError]] = {
    400: MalformedBody,
    401: Unauthorized,
    403: Forbidden,
    404: NotFoundError,
    409: ConflictError,
    413: PayloadTooLarge,
    415: UnsupportedMediaType,
    422: InvalidInput,
    503: NotReady,
    504: DeadlineExceeded,
}

_problem_decoder = msgspec.json.Decoder(dict[str, Any])


def error_from_problem(status: int, raw: bytes, *, peer: str) -> KVHandoffError:
    """Rebuild the error a peer reported; non-problem bodies become `PeerError`.

    Subclass constructors differ (TransportError formats its message, PairingError takes a
    list), so the instance is built through the root's constructor with the remote's detail and
    context, then the attributes those subclasses expose are restored.
    """
    try:
        body = _problem_decoder.decode(raw)
    except msgspec.DecodeError:
        body = {}
    code = body.get("code") if isinstance(body.get("code"), str) else None
    cls = (error_class(code) if code else None) or _BY_STATUS.get(status, PeerError)
    detail = str(body.get("detail") or raw[:200].decode("utf-8", "replace") or f"HTTP {status}")
    standard = {"type", "title", "status", "detail", "instance", "code", "problems"}
    context = {k: v for k, v in body.items() if k not in standard}
    context.setdefault("peer", peer)
    if cls is PeerError or not code:
        context.setdefault("status", status)
    error = cls.__new__(cls)
    KVHandoffError.__init__(error, detail, **context)
    if isinstance(error, TransportError):
        error.rc = context.get("rc")
        error.peer = str(context.get("peer"))
    if isinstance(error, PairingError):
        error.problems = list(
            msgspec.convert(body.get("problems") or [], list[PairingProblem], strict=False)
        )
    return error
