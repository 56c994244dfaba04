"""Who may call which route: credentials per role, checked before any handler runs.

`create_app` installs `auth_middleware(Credentials.from_config(config), declared)`; `declared`
maps aiohttp's routes to their `Route` declarations, whose `auth_role` says whose credential a
route takes (kvhandoff.service.http.routing). The rules:

- router and engine routes take `Authorization: Bearer <token>` (scheme case-insensitive, RFC
  9110) with one of that role's secrets; no or an unknown token is 401, a token of another role
  is 403 (a router cannot act as an engine or a peer, nor the reverse);
- peer routes take a request signed with a peer secret (kvhandoff.service.http.peer_signing), never
a bearer
  token, addressed to this service: unsigned, badly signed or signed for another service is
  401, a replay 409, one signed for another life of this service 409 `stale_incarnation`,
  another role's bearer token 403; the verified sender URL is then `signed_sender(request)`,
  which handlers compare with the URL a message claims (kvhandoff.service.api.peer);
- the answer to a signed peer request (whatever its status, a refusal of a stale one too) is
  signed in turn by `answer_middleware`, bound to the request's nonce, so the caller can tell
  it came from the service it addressed (`kvhandoff.service.http.peer_client`);
- a role without any secret configured is open, as are routes outside `/v1`.
"""

from __future__ import annotations

import hmac
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from kvhandoff.service.config import AUTH_ROLES, Config
from kvhandoff.service.http.egress import EGRESS
from kvhandoff.service.http.peer_signing import (
    NONCE_HEADER,
    RECIPIENT_INCARNATION_HEADER,
    SIGNATURE_HEADER,
    SIGNED_HEADERS,
    AnswerSigner,
    SignatureRejected,
    Signer,
    Verifier,
)
from kvhandoff.service.http.problems import Forbidden, Replayed, StaleIncarnation, Unauthorized
from kvhandoff.service.http.routing import API_PREFIX, AuthRole, Route

#: The peer URL a request was signed by, once verified (absent when peer auth is off).
SENDER = web.RequestKey("signed_sender", str)
#: The peer secret a verified peer request was signed with (what a channel's key derives from).
SIGNED_WITH = web.RequestKey("signed_with", str)
#: The nonce of a peer request whose signature verified: its answer is signed for it.
_ANSWER_NONCE = web.RequestKey("answer_nonce", str)


@dataclass(frozen=True)
class Credentials:
    """The secrets of each role (current first), the peer verifier built from them and the
    signer of this service's answers to peer requests (life `incarnation`)."""

    secrets: Mapping[str, tuple[str, ...]]
    verifier: Verifier | None
    answers: AnswerSigner | None = None

    @classmethod
    def from_config(cls, config: Config, incarnation: str) -> Credentials:
        secrets = {role: config.secrets(role) for role in AUTH_ROLES}
        verifier = answers = None
        if secrets["peer"]:
            url = config.server.public_url
            verifier = Verifier(
                secrets["peer"],
                url=url,
                incarnation=incarnation,
                max_skew_s=config.auth.max_skew_s,
                capacity=config.auth.replay_cache,
            )
            answers = AnswerSigner(secrets["peer"][0], url, incarnation)
        return cls(secrets, verifier, answers)

    def secured(self, role: AuthRole) -> bool:
        return role != "open" and bool(self.secrets.get(role))

    def roles_of(self, token: bytes) -> list[str]:
        """Every role `token` is a bearer secret of (compared in constant time)."""
        return [
            role
            for role, secrets in self.secrets.items()
            if role != "peer" and any(hmac.compare_digest(token, s.encode()) for s in secrets)
        ]


def signer_for(config: Config) -> Signer | None:
    """What the peer client signs with (the current peer secret, as this service's URL) and
    checks answers against (every accepted peer secret)."""
    secrets = config.secrets("peer")
    return Signer(secrets, config.server.public_url) if secrets else None


def signed_sender(request: web.Request) -> str | None:
    """The verified sender URL of a signed peer request; None when peer auth is off."""
    return request.get(SENDER)


def bearer_token(request: web.Request) -> bytes | None:
    """The token of `Authorization: Bearer <token>`; None when absent. Raises Unauthorized for
    a header that is not a bearer credential, or not ASCII (RFC 9110 token68)."""
    raw = request.headers.get("Authorization")
    if raw is None:
        return None
    try:
        value = raw.encode("ascii")  # aiohttp keeps undecodable bytes as surrogates
    except UnicodeEncodeError:
        raise Unauthorized("invalid Authorization header: not ASCII") from None
    scheme, _, token = value.strip().partition(b" ")
    if scheme.lower() != b"bearer" or not token.strip():
        raise Unauthorized("invalid Authorization header: not `Bearer <token>`")
    return token.strip()


def auth_middleware(credentials: Credentials, declared: Mapping[web.AbstractRoute, Route]) -> Any:
    @web.middleware
    async def check(request: web.Request, handler: Any) -> web.StreamResponse:
        route = declared.get(request.match_info.route)
        # An unmatched path (404, 405) under /v1 answers as a router route: no free probing.
        role: AuthRole = route.auth_role if route is not None else _unmatched(request)
        if credentials.secured(role):
            if role == "peer":
                await _check_signature(request, credentials)
            else:
                _check_bearer(request, credentials, role)
        return await handler(request)  # type: ignore[no-any-return]

    return check


def answer_middleware(credentials: Credentials) -> Any:
    """Signs the answer to every verified peer request, errors included (outermost, so it sees
    the problem+json the error middleware made). A streamed answer (the watch) is not signed:
    what it says — the peer's process ended — only ever fails handoffs, never releases pages."""

    @web.middleware
    async def sign(request: web.Request, handler: Any) -> web.StreamResponse:
        response: web.StreamResponse = await handler(request)
        await request.app[EGRESS].before()  # what the answer tells of is on disk before it goes out
        nonce = request.get(_ANSWER_NONCE)
        answers = credentials.answers
        signable = isinstance(response, web.Response) and not response.prepared
        if nonce is not None and answers is not None and signable:
            assert isinstance(response, web.Response)
            body = response.body
            raw = body if isinstance(body, bytes) else b""
            response.headers.update(answers.headers(nonce, response.status, raw))
        return response

    return sign


def _check_bearer(request: web.Request, credentials: Credentials, role: str) -> None:
    token = bearer_token(request)
    if token is None:
        raise Unauthorized(f"missing {role} bearer token", role=role)
    roles = credentials.roles_of(token)
    if role in roles:
        return
    if roles:
        raise Forbidden(
            f"a {roles[0]} credential may not call {role} routes", role=role, credential=roles[0]
        )
    raise Unauthorized(f"invalid {role} bearer token", role=role)


async def _check_signature(request: web.Request, credentials: Credentials) -> None:
    assert credentials.verifier is not None  # secured("peer") implies a verifier
    if all(request.headers.get(h) is None for h in SIGNED_HEADERS):
        token = bearer_token(request)
        roles = credentials.roles_of(token) if token is not None else []
        if roles:
            raise Forbidden(
                f"a {roles[0]} credential may not call peer routes",
                role="peer",
                credential=roles[0],
            )
    body = await request.read()
    headers = {h: request.headers.get(h) for h in SIGNED_HEADERS}
    headers[RECIPIENT_INCARNATION_HEADER] = request.headers.get(RECIPIENT_INCARNATION_HEADER)
    try:
        sender, secret = credentials.verifier.verify_secret(
            request.method, request.raw_path, headers, body
        )
    except SignatureRejected as exc:
        if exc.stale:  # the signature verified: answer it signed, so the caller learns our life
            request[_ANSWER_NONCE] = request.headers[NONCE_HEADER]
            raise StaleIncarnation(str(exc), role="peer") from None
        if exc.replayed:
            raise Replayed(str(exc), role="peer") from None
        raise Unauthorized(str(exc), role="peer") from None
    except UnicodeEncodeError:  # header values with undecodable bytes
        raise Unauthorized("peer signature headers are not ASCII", role="peer") from None
    request[SENDER] = sender
    request[SIGNED_WITH] = secret
    request[_ANSWER_NONCE] = request.headers[NONCE_HEADER]


def _unmatched(request: web.Request) -> AuthRole:
    """A signed request is checked as a peer's (a peer calling a route this version lacks
    learns it is missing), anything else as a router's."""
    if not request.path.startswith(API_PREFIX):
        return "open"
    return "peer" if request.headers.get(SIGNATURE_HEADER) is not None else "router"
