"""The bootstrap server of the kvhandoff backend: SGLang's registry, registrations signed.

SGLang starts one per prefill instance (`start_disagg_service`, constructed as `(host, port)`).
Decode ranks read it with SGLang's own code (`GET /route`, `POST /query_dp_ranks`), so the
registry logic and the answers are SGLang's own (`CommonKVBootstrapServer`'s handlers, reused
as they are). What changes:

- a registration (`PUT /route`, `POST /register_dp_rank`) is taken only when signed with the
  peer secret (`sign` / `check`: HMAC-SHA256 over method, path, timestamp and body, within
  `MAX_SKEW_S`); SGLang's own server takes anyone's (sglang#39400), letting any host that reaches
  the port redirect a rank's KV;
- a registration carries the rank's kvhandoff service URL, answered with the rank's row.

It is deliberately *not* a `CommonKVBootstrapServer` subclass: SGLang's Rust server stands in
for any subclass of that (`rust_server_serves_kv_bootstrap`) with its unauthenticated registry.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import math
import os
import time
from collections.abc import Awaitable, Callable, Sequence

from aiohttp import web
from sglang.srt.disaggregation.base.conn import BaseKVBootstrapServer
from sglang.srt.disaggregation.common.conn import CommonKVBootstrapServer

from kvhandoff.service.integrations.sglang.settings import peer_secrets

log = logging.getLogger("kvhandoff.sglang.bootstrap")

SIGNATURE_HEADER = "X-KVHandoff-Signature"
MAX_SKEW_S = 30.0
SIGNED_ROUTES = {("PUT", "/route"), ("POST", "/register_dp_rank")}
#: The rank's kvhandoff service URL inside a registration and in its GET /route row.
URL_FIELD = "kvhandoff_url"


def sign(secret: bytes, method: str, path: str, body: bytes, now: float | None = None) -> str:
    """The signature header value of one request: `t=<unix s>,v1=<hex HMAC>`."""
    ts = f"{time.time() if now is None else now:.3f}"
    return f"t={ts},v1={_mac(secret, method, path, ts, body)}"


def check(
    secrets: Sequence[bytes], method: str, path: str, body: bytes, header: str | None
) -> str | None:
    """None when `header` signs this request freshly with one of `secrets` (every configured
    peer secret: a rotation adds the new one first and keeps the old one a while, as the peer
    protocol takes them); otherwise why it does not."""
    if not header:
        return f"missing {SIGNATURE_HEADER}"
    fields = dict(part.split("=", 1) for part in header.split(",") if "=" in part)
    ts, mac = fields.get("t", ""), fields.get("v1", "")
    try:
        skew = abs(time.time() - float(ts))
    except ValueError:
        return "bad timestamp"
    if not math.isfinite(skew):
        return "bad timestamp"
    if skew > MAX_SKEW_S:
        return f"timestamp {skew:.0f} s away from this server's clock"
    if not any(hmac.compare_digest(mac, _mac(k, method, path, ts, body)) for k in secrets):
        return "bad signature"
    return None


def _mac(secret: bytes, method: str, path: str, ts: str, body: bytes) -> str:
    digest = hashlib.sha256(body).hexdigest()
    message = f"{method}\n{path}\n{ts}\n{digest}".encode()
    return hmac.new(secret, message, hashlib.sha256).hexdigest()


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
_common = CommonKVBootstrapServer


class KVHandoffBootstrapServer(BaseKVBootstrapServer):
    """SGLang's HTTP bootstrap registry behind signed registrations (see the module doc)."""

    # SGLang's registry, reused as is: the same table, readiness and answers as its own server.
    run = _common.run
    close = _common.close
    poll = _common.poll
    _is_ready = _common._is_ready
    _handle_route = _common._handle_route
    _handle_route_get_common = _common._handle_route_get
    _handle_route_put_common = _common._handle_route_put
    _handle_register_dp_rank = _common._handle_register_dp_rank
    _handle_query_dp_ranks = _common._handle_query_dp_ranks
    _handle_health_check = _common._handle_health_check
    _cleanup_expired_entries = _common._cleanup_expired_entries
    _run_server = _common._run_server

    def __init__(self, host: str, port: int) -> None:
        self._secrets = peer_secrets(os.environ)
        #: (dp group, cp rank, tp rank, pp rank) -> the rank's kvhandoff URL.
        self.service_urls: dict[tuple[int, int, int, int], str] = {}
        self._loop = None
        _common.__init__(self, host, port)  # type: ignore[arg-type]  # fields, routes, thread

    def _setup_routes(self) -> None:
        self.app.middlewares.append(self._authenticate)
        _common._setup_routes(self)  # type: ignore[arg-type]

    @web.middleware
    async def _authenticate(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        if (request.method, request.path) in SIGNED_ROUTES:
            body = await request.read()
            why = check(
                self._secrets,
                request.method,
                request.path,
                body,
                request.headers.get(SIGNATURE_HEADER),
            )
            if why is not None:
                log.warning(
                    "refused %s %s from %s: %s", request.method, request.path, request.remote, why
                )
                return web.Response(status=401, text=f"unauthenticated registration: {why}")
        return await handler(request)

    async def _handle_route_put(self, request: web.Request) -> web.StreamResponse:
        data = await request.json()
        url = data.get(URL_FIELD)
        dummy_cp = url is None and int(data.get("attn_cp_rank") or 0) > 0
        if not dummy_cp and (
            not isinstance(url, str) or not url.startswith(("http://", "https://"))
        ):
            return web.Response(status=400, text=f"a registration must carry {URL_FIELD}")
        response = await self._handle_route_put_common(request)
        if response.status == 200:
            dp = data["attn_dp_rank"] if data["system_dp_size"] == 1 else data["system_dp_rank"]
            key = (
                int(dp),
                int(data["attn_cp_rank"]),
                int(data["attn_tp_rank"]),
                int(data["pp_rank"]),
            )
            async with self.lock:
                if dummy_cp:
                    # A prefill CP rank other than 0, SGLang's dummy participant: registered
                    # (SGLang counts every rank), never paired, so it runs no service.
                    self.service_urls.pop(key, None)
                else:
                    self.service_urls[key] = url
        return response

    async def _handle_route_get(self, request: web.Request) -> web.StreamResponse:
        response = await self._handle_route_get_common(request)
        q = request.query
        try:
            key = tuple(
                int(q[k])
                for k in ("prefill_dp_rank", "prefill_cp_rank", "target_tp_rank", "target_pp_rank")
            )
        except (KeyError, ValueError):
            return response
        if response.status != 200 or key == (-1, -1, -1, -1):
            return response
        assert isinstance(response, web.Response) and isinstance(response.body, bytes)
        row = json.loads(response.body)
        async with self.lock:
            row[URL_FIELD] = self.service_urls.get(key)  # type: ignore[arg-type]
        return web.json_response(row, status=200)
