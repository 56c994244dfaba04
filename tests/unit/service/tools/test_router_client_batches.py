"""`RouterClient`'s coalesced sends against a scripted decode in this process: a batch the
service refuses as too large (413) is split and sent again in order, not refused item by item;
a whole-batch refusal reads as its problem's text. (Real services: tests/integration/
test_router_stream.py.)"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from types import SimpleNamespace
from typing import Any, cast

import aiohttp
import pytest
from aiohttp import web

from kvhandoff.service.tools.router_client import RouterClient

MAX_ITEMS = 30  # what the scripted decode takes in one body


class Decode:
    def __init__(self) -> None:
        self.bodies: list[list[str]] = []
        self.refuse: int | None = None  # a status refusing every batch

    async def batch(self, request: web.Request) -> web.Response:
        items = (await request.json())["items"]
        self.bodies.append([item["id"] for item in items])
        if self.refuse is not None:
            problem = {"status": self.refuse, "code": "overloaded", "detail": "busy"}
            return web.json_response(problem, status=self.refuse)
        if len(items) > MAX_ITEMS:
            return web.json_response({"code": "payload_too_large", "detail": "big"}, status=413)
        view = {"state": "pending"}
        return web.json_response({"items": [{"status": 201, "view": view} for _ in items]})


@pytest.fixture
async def decode() -> AsyncIterator[tuple[Decode, RouterClient]]:
    fake = Decode()
    app = web.Application()
    app.router.add_post("/v1/handoff-batches", fake.batch)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    url = f"http://127.0.0.1:{runner.addresses[0][1]}"
    # The parts of a deployment a coalescing create reads: where the decode is.
    dep = SimpleNamespace(decode_url=url, prefill_urls=[url], pp_size=1, url_of_stage=lambda _: url)
    async with aiohttp.ClientSession() as http:
        router = RouterClient(http, cast(Any, dep), follow="poll", coalesce=True)
        yield fake, router
        await router.close()
    await runner.cleanup()


async def test_a_batch_over_the_body_bound_is_split_and_sent_in_order(
    decode: tuple[Decode, RouterClient],
) -> None:
    fake, router = decode
    ids = [f"h-{i}" for i in range(100)]
    answers = await _create_all(router, ids)
    assert answers == [None] * 100  # every one accepted
    sent = [body for body in fake.bodies if len(body) <= MAX_ITEMS]
    assert [i for body in sent for i in body] == ids  # each once, in the order issued
    assert len(fake.bodies[0]) == 100 and fake.bodies[0] == ids


async def test_a_whole_batch_refusal_reads_as_its_problem(
    decode: tuple[Decode, RouterClient],
) -> None:
    fake, router = decode
    fake.refuse = 503
    answers = await _create_all(router, ["a", "b"])
    assert [(a.state, a.error) for a in answers] == [("rejected", "overloaded: busy")] * 2
    assert len(fake.bodies) == 1  # not split: only a body too large is


async def _create_all(router: RouterClient, ids: list[str]) -> list[Any]:
    return list(await asyncio.gather(*(router.create(h, [1], 1) for h in ids)))
