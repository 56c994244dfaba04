"""One webhook POST over a kept-alive HTTP/1.1 connection to an address the policy allows.

Used by the dispatcher (`kvhandoff.service.webhooks.dispatch`) for every attempt. A webhook needs
only the status line and `Retry-After` of the answer, so this is a small client: connections are
pooled per origin and reused, the body of an answer is read (at most `MAX_BODY_BYTES`) and dropped,
no redirect is followed, and every name is resolved here and each address checked against the
`TargetPolicy` before connecting — the connection goes to the very address that was checked, so
DNS rebinding cannot slip a private address in between. Costs about a quarter of the CPU of a
general-purpose client per request, which is most of what a delivery costs the event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import ssl
from collections.abc import Sequence
from dataclasses import dataclass
from urllib.parse import urlsplit

from kvhandoff.service.webhooks.targets import TargetPolicy

#: An answer's body beyond this is not read: the connection is closed instead.
MAX_BODY_BYTES = 64 * 1024
#: Idle connections kept per origin.
MAX_IDLE = 32
#: Parsed URLs remembered (one per endpoint or callback URL in use).
MAX_ROUTES = 4096


class SendError(Exception):
    """No answer came: refused target, connection error, malformed answer (message says which)."""


@dataclass(frozen=True)
class Answer:
    status: int
    retry_after: str | None


@dataclass(frozen=True)
class _Origin:
    scheme: str
    host: str
    port: int


class _Conn:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer

    def close(self) -> None:
        self.writer.close()


class Sender:
    def __init__(self, policy: TargetPolicy, user_agent: str) -> None:
        self._policy = policy
        self._user_agent = user_agent
        self._idle: dict[_Origin, list[_Conn]] = {}
        self._tls: ssl.SSLContext | None = None
        self._routes: dict[str, tuple[_Origin, str]] = {}

    async def post(
        self, url: str, headers: Sequence[tuple[str, str]], body: bytes, timeout_s: float
    ) -> Answer:
        """POST `body`; raises SendError or TimeoutError when no answer came in time."""
        origin, head = self._route(url)
        lines = [
            head,
            f"Content-Length: {len(body)}",
            *(f"{name}: {value}" for name, value in headers),
        ]
        request = ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body
        async with asyncio.timeout(timeout_s):
            idle = self._idle.get(origin)
            if idle:
                # A kept-alive connection the receiver closed meanwhile fails at once: try again
                # on a fresh one (a webhook may arrive twice anyway; receivers dedupe by id).
                conn = idle.pop()
                with contextlib.suppress(SendError, OSError, asyncio.IncompleteReadError):
                    return await self._exchange(origin, conn, request)
            conn = await self._connect(origin)
            try:
                return await self._exchange(origin, conn, request)
            except asyncio.IncompleteReadError:
                raise SendError("the connection closed before an answer") from None
            except OSError as exc:
                raise SendError(
                    f"connection to {origin.host}:{origin.port} failed: {exc}"
                ) from None

    def _route(self, url: str) -> tuple[_Origin, str]:
        """The origin and the fixed request lines of `url` (parsed once per URL)."""
        found = self._routes.get(url)
        if found is None:
            parts = urlsplit(url)
            if parts.scheme not in ("http", "https") or not parts.hostname:
                raise SendError(f"{url!r} is not an http(s) URL")
            port = parts.port or _DEFAULT_PORT[parts.scheme]
            target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
            head = "\r\n".join(
                [
                    f"POST {target} HTTP/1.1",
                    f"Host: {parts.netloc.rpartition('@')[2]}",
                    f"User-Agent: {self._user_agent}",
                    "Content-Type: application/json",
                ]
            )
            if len(self._routes) >= MAX_ROUTES:
                self._routes.clear()
            found = self._routes[url] = (_Origin(parts.scheme, parts.hostname, port), head)
        return found

    async def close(self) -> None:
        for conns in self._idle.values():
            for conn in conns:
                conn.close()
        self._idle.clear()

    async def _connect(self, origin: _Origin) -> _Conn:
        refusal = self._policy.literal_refusal(f"{origin.scheme}://{origin.host}")
        if refusal is not None:
            raise SendError(f"target refused: {refusal}")
        loop = asyncio.get_running_loop()
        try:
            infos = await loop.getaddrinfo(origin.host, origin.port, type=socket.SOCK_STREAM)
        except OSError as exc:
            raise SendError(f"cannot resolve {origin.host}: {exc}") from None
        address = str(infos[0][4][0])
        bad = [str(i[4][0]) for i in infos if not self._policy.address_allowed(str(i[4][0]))]
        if bad:
            raise SendError(f"target refused: {origin.host} resolves to non-public {bad[0]}")
        tls = None
        if origin.scheme == "https":
            if self._tls is None:
                self._tls = ssl.create_default_context()
            tls = self._tls
        try:
            reader, writer = await asyncio.open_connection(
                address,
                origin.port,
                ssl=tls,
                server_hostname=origin.host if tls else None,
                limit=MAX_BODY_BYTES,
            )
        except OSError as exc:
            raise SendError(f"cannot connect to {origin.host}:{origin.port}: {exc}") from None
        return _Conn(reader, writer)

    async def _exchange(self, origin: _Origin, conn: _Conn, request: bytes) -> Answer:
        keep = False
        try:
            conn.writer.write(request)
            await conn.writer.drain()
            answer, keep = await _read_answer(conn.reader)
            return answer
        finally:
            idle = self._idle.setdefault(origin, [])
            if keep and len(idle) < MAX_IDLE:
                idle.append(conn)
            else:
                conn.close()


_DEFAULT_PORT = {"http": 80, "https": 443}


async def _read_answer(reader: asyncio.StreamReader) -> tuple[Answer, bool]:
    """The status and Retry-After of one HTTP/1.x answer, and whether the connection may be
    reused (its body was read whole and neither side asked to close)."""
    try:
        head = await reader.readuntil(b"\r\n\r\n")
    except asyncio.LimitOverrunError:
        raise SendError("the answer's header is too long") from None
    status_line, *header_lines = head[:-4].decode("latin-1").split("\r\n")
    version, _, rest = status_line.partition(" ")
    code = rest[:3]
    if not version.startswith("HTTP/1.") or not code.isdigit():
        raise SendError(f"not an HTTP answer: {status_line[:80]!r}")
    status = int(code)
    fields: dict[str, str] = {}
    for line in header_lines:
        name, _, value = line.partition(":")
        fields[name.strip().lower()] = value.strip()
    keep = version == "HTTP/1.1" and fields.get("connection", "").lower() != "close"
    answer = Answer(status, fields.get("retry-after"))
    if status in (204, 304) or 100 <= status < 200:
        return answer, keep
    if "chunked" in fields.get("transfer-encoding", "").lower():
        return answer, keep and await _skip_chunked(reader)
    length = fields.get("content-length")
    if length is not None and length.isdigit():
        if int(length) > MAX_BODY_BYTES:
            return answer, False
        await reader.readexactly(int(length))
        return answer, keep
    return answer, False  # a body until the connection closes: do not wait for it


async def _skip_chunked(reader: asyncio.StreamReader) -> bool:
    """Read and drop a chunked body; False (close the connection) if it is too long."""
    total = 0
    while True:
        size_line = await reader.readuntil(b"\r\n")
        try:
            size = int(size_line.split(b";", 1)[0].strip(), 16)
        except ValueError:
            raise SendError(f"bad chunk size {size_line[:20]!r}") from None
        if size == 0:
            while await reader.readuntil(b"\r\n") != b"\r\n":
                pass  # trailer fields, up to the empty line
            return True
        total += size
        if total > MAX_BODY_BYTES:
            return False
        await reader.readexactly(size + 2)
