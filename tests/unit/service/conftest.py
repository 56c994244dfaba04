"""Shared builders for the service tests: a small valid config and a client over a real app."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from kvhandoff.service.config import Config, load_config
from kvhandoff.service.http.app import Extension, create_app

MINIMAL: dict[str, Any] = {
    "role": "decode",
    "model": {"preset": "dense-mha", "scale": 64, "num_layers": 4},
    "stages": [{"num_pages": 16}],
}


def make_config(**overrides: Any) -> Config:
    """A valid decode config; `overrides` are dotted keys, e.g. `server.token="t"`."""
    dotted = {key.replace("__", "."): value for key, value in overrides.items()}
    return load_config(None, {}, {**MINIMAL, **dotted})


ClientFactory = Callable[..., Any]


@pytest.fixture
async def make_client() -> AsyncIterator[ClientFactory]:
    """`await make_client(config, extensions)` → a TestClient over a running app; closed after."""
    clients: list[TestClient[web.Request, web.Application]] = []

    async def factory(
        config: Config | None = None, extensions: Sequence[Extension] = ()
    ) -> TestClient[web.Request, web.Application]:
        app = create_app(config or make_config(), extensions=extensions)
        client = TestClient(TestServer(app))
        await client.start_server()
        clients.append(client)
        return client

    yield factory
    for client in clients:
        await client.close()
