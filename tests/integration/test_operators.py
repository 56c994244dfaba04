"""What operators see, against real processes (issue 18 D): peers watched while idle, readiness
that means the service can do its job."""

from __future__ import annotations

import asyncio
import re
import time
from typing import Any

import aiohttp
import pytest

from service.config import HandoffConfig
from tests.integration.conftest import DeploymentFactory

pytestmark = pytest.mark.integration


async def peer_up(http: aiohttp.ClientSession, url: str) -> dict[str, float]:
    async with http.get(f"{url}/metrics") as resp:
        text = await resp.text()
    return {
        m.group(1): float(m.group(2))
        for m in re.finditer(r'^kvhandoff_peer_up\{peer="([^"]+)"\} (\S+)$', text, re.M)
    }


async def readyz(http: aiohttp.ClientSession, url: str) -> tuple[int, dict[str, Any]]:
    async with http.get(f"{url}/readyz") as resp:
        return resp.status, await resp.json(content_type=None)


async def test_a_stage_killed_while_idle_is_down_on_metrics_and_readyz_within_seconds(
    http: aiohttp.ClientSession, deployment: DeploymentFactory
) -> None:
    # A silence timeout far beyond the wait: only watching the idle peer notices the kill.
    dep = deployment(pp_size=2, handoff=HandoffConfig(heartbeat_interval_s=0.5, peer_timeout_s=60))
    stage0, stage1 = dep.url_of_stage(0), dep.url_of_stage(1)
    deadline = time.monotonic() + 20
    while await peer_up(http, dep.decode_url) != {stage0: 1.0, stage1: 1.0}:
        assert time.monotonic() < deadline, await peer_up(http, dep.decode_url)
        await asyncio.sleep(0.1)
    status, body = await readyz(http, dep.decode_url)
    assert status == 200 and "peers" in body["checks"], body
    assert {p["url"]: p["up"] for p in body["peers"]} == {stage0: True, stage1: True}

    dep.kill(1)  # nothing in flight: no handoff ever named it
    t0 = time.monotonic()
    while (await peer_up(http, dep.decode_url)).get(stage1) != 0.0:
        assert time.monotonic() - t0 < 10, await peer_up(http, dep.decode_url)
        await asyncio.sleep(0.1)
    status, body = await readyz(http, dep.decode_url)
    # One configured prefill still answers: ready, and the section says which is down.
    assert status == 200, body
    assert {p["url"]: p["up"] for p in body["peers"]} == {stage0: True, stage1: False}

    dep.kill(0)
    t0 = time.monotonic()
    while (status := (await readyz(http, dep.decode_url))[0]) != 503:
        assert time.monotonic() - t0 < 10
        await asyncio.sleep(0.1)
    status, body = await readyz(http, dep.decode_url)
    assert body["not_ready"] == ["peers"], body

    dep.restart("prefill-0")  # back: heard again by the next idle ping
    t0 = time.monotonic()
    while (await readyz(http, dep.decode_url))[0] != 200:
        assert time.monotonic() - t0 < 20
        await asyncio.sleep(0.1)
    assert (await peer_up(http, dep.decode_url))[stage0] == 1.0
