"""aiohttp's parser errors come back as problem+json (kvhandoff.service.http.server)."""

from __future__ import annotations

import asyncio
import json
import socket
from collections.abc import AsyncIterator

import pytest
from aiohttp import web

from kvhandoff.service.http.app import create_app
from kvhandoff.service.http.problems import PROBLEM_CONTENT_TYPE
from kvhandoff.service.http.server import ProblemAppRunner
from tests.unit.service.conftest import make_config

REQUESTS = {
    "long request line": b"GET /" + b"a" * 9000 + b" HTTP/1.1\r\nHost: x\r\n\r\n",
    "long header": b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Big: " + b"b" * 9000 + b"\r\n\r\n",
    "bad chunking": (
        b"POST /v1/handoffs HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Transfer-Encoding: chunked\r\n\r\nzz\r\n{}\r\n0\r\n\r\n"
    ),
    "HTTP/9.9": b"GET /healthz HTTP/9.9\r\nHost: x\r\n\r\n",
    "length and chunked": (
        b"POST /v1/handoffs HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n"
        b"Transfer-Encoding: chunked\r\n\r\n0\r\n\r\n"
    ),
    "bad method": b"G\x01T /healthz HTTP/1.1\r\nHost: x\r\n\r\n",
}


@pytest.fixture
async def port() -> AsyncIterator[int]:
    runner = ProblemAppRunner(create_app(make_config()))
    await runner.setup()
    sock = socket.create_server(("127.0.0.1", 0))
    site = web.SockSite(runner, sock)
    await site.start()
    yield sock.getsockname()[1]
    await runner.cleanup()
    sock.close()


async def exchange(port: int, raw: bytes) -> tuple[int, dict[str, str], bytes]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(raw)
    await writer.drain()
    data = await asyncio.wait_for(reader.read(), 10)  # the server closes after an error
    writer.close()
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    headers = {k.lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
    return status, headers, body


@pytest.mark.parametrize("name", sorted(REQUESTS))
async def test_parser_errors_are_problems(port: int, name: str) -> None:
    status, headers, body = await exchange(port, REQUESTS[name])
    assert 400 <= status < 500, (status, body)
    assert headers["content-type"] == PROBLEM_CONTENT_TYPE
    problem = json.loads(body)
    assert (problem["status"], problem["code"]) == (status, "bad_request")
    assert problem["detail"].startswith("the HTTP request is malformed")


async def test_a_good_request_still_works(port: int) -> None:
    status, _headers, body = await exchange(
        port, b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
    )
    assert status == 200 and json.loads(body)["status"] == "ok"
