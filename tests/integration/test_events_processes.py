"""The event stream as a router reads it: real processes (decode + PP=2 prefill, Mooncake over
TCP on loopback), `httpx-sse` on `GET /v1/events`, a connection dropped mid-run and resumed
with `Last-Event-ID`. Every event the decode service published (each lands in its handoff's
timeline) is read exactly once, in order."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import aiohttp
import httpx
import pytest
from httpx_sse import aconnect_sse

from kvhandoff.service.testing.deployment import LocalDeployment
from kvhandoff.service.tools.router_client import RouterClient

pytestmark = pytest.mark.integration
DeploymentFactory = Callable[..., LocalDeployment]
WAIT_S = 30.0


async def drive(client: RouterClient, ids: range) -> None:
    outcomes = await asyncio.gather(
        *(client.handoff(f"ev-{i}", [1 + i, 20 + i], [2 * i, 2 * i + 1], i % 8, i % 8) for i in ids)
    )
    assert [o.state for o in outcomes] == ["completed"] * len(ids), outcomes


async def test_a_dropped_reader_resumes_and_reads_every_event_once(
    deployment: DeploymentFactory,
) -> None:
    dep = deployment(pp_size=2)
    url = f"{dep.decode_url}/v1/events"
    seen: list[int] = []
    async with (
        aiohttp.ClientSession() as http,
        httpx.AsyncClient(timeout=httpx.Timeout(WAIT_S)) as sse_http,
    ):
        client = RouterClient(http, dep)
        async with aconnect_sse(sse_http, "GET", url) as source:
            running = asyncio.create_task(drive(client, range(0, 6)))
            async with asyncio.timeout(WAIT_S):
                async for sse in source.aiter_sse():
                    seen.append(int(sse.id))
                    if len(seen) == 5:
                        break  # the reader goes away mid-run
        await running
        await drive(client, range(6, 10))  # more happens while nobody reads
        expected: list[int] = []
        for i in range(10):
            async with http.get(f"{dep.decode_url}/v1/handoffs/ev-{i}") as resp:
                expected += [event["seq"] for event in (await resp.json())["timeline"]]
        expected.sort()
        headers = {"Last-Event-ID": str(seen[-1])}
        async with aconnect_sse(sse_http, "GET", url, headers=headers) as source:
            async with asyncio.timeout(WAIT_S):
                async for sse in source.aiter_sse():
                    seen.append(int(sse.id))
                    if seen[-1] == expected[-1]:
                        break
    assert seen == expected
    # created, per stage a segment committed and its arrival, completed, released
    assert len(expected) == 10 * 7
