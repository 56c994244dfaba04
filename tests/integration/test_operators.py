"""What operators see, against real processes (issue 18 D): peers watched while idle, readiness
that means the service can do its job, an engine start that explains its own noise."""

from __future__ import annotations

import asyncio
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from kvhandoff.service.config import HandoffConfig
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


def test_mooncake_s_start_up_noise_is_explained_next_to_it(tmp_path: Path) -> None:
    """Issue 18 D: a healthy start printed an `E` line ("Local segment descriptor not found")
    and a `W` line ("No RDMA devices found") that operators read as failures. Every error or
    warning the engine prints before the service serves is one the service explains at once."""
    config = tmp_path / "decode.toml"
    config.write_text(MOONCAKE_DECODE.format(port=free_port(), state=tmp_path / "state").lstrip())
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvhandoff.service.cli", "serve", "--config", str(config)],
        stderr=subprocess.PIPE,
        text=True,
    )
    lines: list[str] = []
    try:
        assert proc.stderr is not None
        deadline = time.monotonic() + 60
        while not any("serving at" in line for line in lines):
            assert time.monotonic() < deadline and proc.poll() is None, "".join(lines)
            lines.append(proc.stderr.readline())
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)
    engine_noise = [
        line.split("] ", 1)[1].strip()
        for line in lines
        if re.match(r"^[EW]\d{4} ", line) and "] " in line
    ]
    explanation = next((line for line in lines if "start-up lines" in line), "")
    assert explanation, "".join(lines)
    for noise in engine_noise:
        assert noise.split(",")[0][:25] in explanation, (noise, lines)  # named by its start
    assert any("Local segment descriptor not found" in n for n in engine_noise), lines


MOONCAKE_DECODE = """
role = "decode"
[server]
host = "127.0.0.1"
port = {port}
state_dir = "{state}"
[transport]
backend = "mooncake"
[model]
preset = "dense-mha"
scale = 64
num_layers = 4
[[stages]]
num_pages = 8
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
