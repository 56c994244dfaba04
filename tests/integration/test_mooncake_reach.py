"""What a process that speaks only Mooncake can reach (issue 31): on a landed deployment, no byte
of any KV, state or aux entry, on the decode or the prefill; on a direct one, the decode's pages.

The writer is `mooncake_probe.py`, a separate process importing only `mooncake`, with every
address it could learn: the first registered buffer the handshake hands any client, the bases
`GET /v1/layout` publishes, the real addresses of every entry (read from the services'
`/proc/<pid>/maps`, where their shm pools are mapped) and guesses next to the first buffer.
Every pool file is compared byte for byte before and after.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from kvhandoff.service.config import TransferConfig
from kvhandoff.service.testing.deployment import LocalDeployment, ServiceProcess
from kvhandoff.transport.pool_shm import ShmPool, shm_path
from tests.integration.conftest import DeploymentFactory

pytestmark = pytest.mark.integration

PROBE = Path(__file__).with_name("mooncake_probe.py")
SMALL_TRANSFER = dict(landing_bytes=4 << 20, window_bytes=1 << 20, staging_bytes=4 << 20)


def _mapped_at(pid: int, pool: ShmPool) -> int:
    """Where process `pid` maps `pool`'s file (the start of its mapping at file offset 0)."""
    path = shm_path(pool.name)
    for line in Path(f"/proc/{pid}/maps").read_text().splitlines():
        fields = line.split()
        if len(fields) >= 6 and fields[5] == path and int(fields[2], 16) == 0:
            return int(fields[0].split("-")[0], 16)
    raise AssertionError(f"{path} is not mapped by process {pid}")


def _entry_addrs(proc: ServiceProcess, pools: list[ShmPool]) -> list[list[int]]:
    """Every entry's first byte and a byte inside it, at the addresses the service uses."""
    assert proc.popen is not None
    out = []
    for pool in pools:
        start = _mapped_at(proc.popen.pid, pool)
        for offset, region in zip(pool.offsets, pool.regions):
            out += [[start + offset, 255], [start + offset + region.length // 2, 255]]
    return out


def _pool_bytes(pools: list[ShmPool]) -> list[bytes]:
    return [Path(shm_path(p.name)).read_bytes() for p in pools]


async def _layout(http: aiohttp.ClientSession, url: str) -> dict[str, Any]:
    async with http.get(f"{url}/v1/layout") as resp:
        assert resp.status == 200
        layout: dict[str, Any] = await resp.json()
        return layout


async def _probe(http: aiohttp.ClientSession, dep: LocalDeployment) -> list[dict[str, Any]]:
    """Run the probe against the decode and every prefill; its report per service."""
    services = [(dep.process("decode"), [dep.decode_pool])] + [
        (dep.process(p.name), [dep.stage_pool(r) for r in p.ranks])
        for p in dep.processes
        if p.name.startswith("prefill-")
    ]
    targets = []
    for proc, pools in services:
        info = await _layout(http, proc.url)
        published = [
            [e["base"], 255]
            for stage in info["stages"]
            for key in ("kv", "state", "aux")
            for e in stage["layout"].get(key, [])
            if e["base"]
        ]
        addrs = _entry_addrs(proc, pools) + published
        arena = info.get("arena")
        if arena is not None:  # guesses: just outside the arena, both ends
            addrs += [[arena["addr"] - 4096, 255], [arena["addr"] + arena["length"], 255]]
        targets.append({"target": info["target"], "addrs": addrs})
    done = subprocess.run(
        [sys.executable, str(PROBE), json.dumps(targets)],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    return [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]


def _all_pools(dep: LocalDeployment) -> list[ShmPool]:
    return [dep.decode_pool] + [dep.stage_pool(r) for r in range(dep.pp_size)]


async def test_a_mooncake_client_changes_no_kv_state_or_aux_byte_of_a_landed_deployment(
    deployment: DeploymentFactory, http: aiohttp.ClientSession
) -> None:
    dep = deployment(pp_size=2, transfer=TransferConfig(mode="landed", **SMALL_TRANSFER))
    pools = _all_pools(dep)
    before = _pool_bytes(pools)
    reports = await _probe(http, dep)
    assert len(reports) == 3
    for report in reports:
        (first, rc), *rest = report["writes"]
        # The handshake hands out the landing arena (decode) or staging buffer (prefill): the
        # probe reaches the engine and writes there (a denial of service at most: S3's digest).
        assert first == report["first"] and rc == 0, report
        assert all(rc != 0 for _, rc in rest), report  # every other write refused
    after = _pool_bytes(pools)
    changed = [p.name for p, b, a in zip(pools, before, after) if b != a]
    assert not changed, f"a Mooncake-only client changed bytes of {changed}"


async def test_a_direct_decode_s_pages_are_reachable_by_any_mooncake_client(
    deployment: DeploymentFactory, http: aiohttp.ClientSession
) -> None:
    """The twin: what direct mode exposes (README, SAFETY.md), and that the probe can fail the
    test above: the same writes land in a direct decode's KV pool."""
    dep = deployment(pp_size=1, transfer=TransferConfig(mode="direct", **SMALL_TRANSFER))
    before = _pool_bytes([dep.decode_pool])
    reports = await _probe(http, dep)
    assert [rc for _, rc in reports[0]["writes"]].count(0) > 1, reports[0]
    assert _pool_bytes([dep.decode_pool]) != before
