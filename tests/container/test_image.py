"""`make image-test`: a decode service and a PP=2 prefill (one process per stage), each started
from the container image, run real handoffs through the HTTP API with every byte checked, then
stop on SIGTERM with status 0.

Not collected by `make test` (pytest's `norecursedirs` leaves out `tests/container`), so the suite
needs neither podman nor buildah; `make image-test` builds the image and runs this file with
`KVHANDOFF_TEST_IMAGE` naming it.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import numpy as np
import pytest

from kvhandoff.service.serve import SHUTDOWN_TIMEOUT_S
from kvhandoff.service.tools.router_client import RouterClient
from tests.container.image_deployment import ImageDeployment
from tests.integration.conftest import SMALL
from tests.integration.handoff_checks import Moved, fill_sources, landed, reset_decode

IMAGE = os.environ.get("KVHANDOFF_TEST_IMAGE", "")

PP = 2
HANDOFFS = SMALL["num_slots"]  # one decode slot each, disjoint decode pages
PAGES_PER_HANDOFF = 6
#: What the services promise for a clean SIGTERM with a handoff live, with margin. The server
#: waits up to `SHUTDOWN_TIMEOUT_S` for open requests; the decode then waits up to
#: `handoff.shutdown_grace_s` for its handoffs' pages to be released — all of it here, as the
#: prefill services stop at the same moment and none confirms (measured outside the image: the
#: prefills exit after ~1 s, the decode after ~6.1 s, idle or under 4 busy loops on 2 cores);
#: then it closes the engine and exits. The rest is generous room for that, `buildah run`'s
#: teardown and a loaded CI machine: a shutdown that hangs, or waits past a bound it promises,
#: still fails. (Docker's default stop timeout is 10 s: the decode's own bounds alone sum to it.)
TEARDOWN_MARGIN_S = 10.0


@pytest.fixture(scope="module")
def dep() -> Iterator[ImageDeployment]:
    if not IMAGE:
        pytest.fail("KVHANDOFF_TEST_IMAGE must name a built image: run `make image-test`")
    deployment = ImageDeployment(IMAGE, pp_size=PP, ready_timeout_s=120.0, **SMALL)
    with deployment:
        yield deployment


def _moves(dep: ImageDeployment, seed: int) -> list[Moved]:
    """Fragmented, shuffled page lists: sources may repeat across handoffs, destinations not."""
    rng = np.random.default_rng(seed)
    num_pages = dep.decode_layout.kv[0].num_items
    dst = rng.permutation(num_pages)[: HANDOFFS * PAGES_PER_HANDOFF].reshape(HANDOFFS, -1)
    return [
        Moved(
            src_pages=sorted(rng.choice(num_pages, PAGES_PER_HANDOFF, replace=False).tolist()),
            dst_pages=dst[i].tolist(),
            src_slot=int(rng.integers(0, SMALL["num_slots"])),
            dst_slot=i,
        )
        for i in range(HANDOFFS)
    ]


def test_services_run_as_the_image_user(dep: ImageDeployment) -> None:
    for proc in dep.processes:
        status = Path(f"/proc/{dep.service_pid(proc.name)}/status").read_text()
        uid_line = next(line for line in status.splitlines() if line.startswith("Uid:"))
        assert uid_line.split()[1:] == [str(dep.uid)] * 4, (proc.name, uid_line)
        assert dep.uid != 0


def test_image_healthcheck_passes_against_each_service(dep: ImageDeployment) -> None:
    test = dep.image_config["Healthcheck"]["Test"]
    assert test[0] == "CMD", test
    for proc in dep.processes:
        done = dep.run_in(proc.name, [*test[1:], str(proc.config_path)])
        assert done.returncode == 0, (proc.name, done.stderr)


async def test_handoffs_across_containers_land_byte_for_byte(dep: ImageDeployment) -> None:
    fill_sources(dep, seed=13)
    reset_decode(dep)
    moves = _moves(dep, seed=13)
    async with aiohttp.ClientSession() as http:
        for proc in dep.processes:
            async with http.get(f"{proc.url}/readyz") as resp:
                assert resp.status == 200, proc.name
        # Half with the decode side's end-to-end digest check as well.
        clients = [RouterClient(http, dep, verify=v) for v in (False, True)]
        outcomes = await asyncio.gather(
            *(
                clients[i % 2].handoff(f"img-{i}", m.src_pages, m.dst_pages, m.src_slot, m.dst_slot)
                for i, m in enumerate(moves)
            )
        )
    assert [o.state for o in outcomes] == ["completed"] * HANDOFFS, outcomes
    assert all(o.bytes > 0 for o in outcomes), outcomes
    assert landed(dep, moves) == []


def test_sigterm_stops_every_service_with_status_0(dep: ImageDeployment) -> None:
    # Last in this module (pytest keeps file order): it ends the deployment the others share.
    # A handoff still live (its stages never signalled ready) must not hold up the shutdown.
    body = {"id": "img-live", "prefill": dep.prefill_urls, "dst_pages": [0], "dst_slot": 0}
    status, view = asyncio.run(_create(dep, body))
    assert status == 201, view
    names = [p.name for p in dep.processes]
    stop_timeout_s = SHUTDOWN_TIMEOUT_S + dep.handoff.shutdown_grace_s + TEARDOWN_MARGIN_S
    codes = dep.stop(names, stop_timeout_s)
    logs = {name: dep.process(name).log_tail(1500) for name in names}
    assert codes == dict.fromkeys(names, 0), (codes, logs)
    for name in names:
        assert "Traceback" not in dep.process(name).log_tail(), logs[name]


async def _create(dep: ImageDeployment, body: dict[str, object]) -> tuple[int, object]:
    async with (
        aiohttp.ClientSession() as http,
        http.post(f"{dep.decode_url}/v1/handoffs", json=body) as resp,
    ):
        return resp.status, await resp.json(content_type=None)
