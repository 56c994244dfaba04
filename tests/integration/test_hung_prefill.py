"""A hung prefill cannot starve the landing arena (issue 31): real processes, Mooncake TCP on
127.0.0.1, an arena of 4 windows shared by a healthy prefill and one stopped with SIGSTOP.

Requests routed to the stopped prefill are created first (each destination took a first window
before: one per handoff, all quarantined until deadline + max_grace_s once they failed, so the
healthy prefill's handoffs ran into their deadline). Now a peer's windows are capped at its share
of the arena (`transfer.peer_share`), a peer whose destination is unanswered gets no first window,
and the windows of a destination that never arrived go back as soon as its handoff ends.
"""

from __future__ import annotations

import os
import signal

import aiohttp
import pytest

from kvhandoff.service.config import HandoffConfig, TransferConfig
from tests.integration.conftest import DeploymentFactory
from tests.integration.handoff_checks import (
    Moved,
    create,
    fill_sources,
    finished,
    landed,
    ready,
    reset_decode,
)

pytestmark = pytest.mark.integration

WINDOW = 64 * 1024
HUNG = 4  # requests routed to the stopped prefill: as many as the arena has windows
HEALTHY = 3
PAGES = 4  # pages per request: more than one window's worth per stage


async def test_a_stopped_prefill_does_not_fail_a_healthy_prefill_s_handoffs(
    deployment: DeploymentFactory, http: aiohttp.ClientSession
) -> None:
    dep = deployment(
        pp_size=1,
        spares=[[0]],
        num_pages=64,
        num_slots=8,
        handoff=HandoffConfig(default_deadline_s=30.0),
        transfer=TransferConfig(
            landing_bytes=4 * WINDOW, window_bytes=WINDOW, staging_bytes=4 * WINDOW
        ),
    )
    fill_sources(dep, 31)
    reset_decode(dep)
    (hung,) = [p for p in dep.processes if p.name.startswith("spare-")]
    assert hung.popen is not None
    # One handoff through it first: the decode knows its layout (a create fetches it once).
    warm = Moved(list(range(PAGES)), list(range(60, 64)), 0, 7)
    assert (await create(http, dep, "warm", warm, prefill=[hung.url]))[0] == 201
    url = f"{hung.url}/v1/handoffs/warm/stages/0/ready"
    async with http.post(url, json={"src_pages": warm.src_pages, "src_slot": 0}) as resp:
        assert resp.status == 202, await resp.text()
    assert (await finished(http, dep, "warm"))["state"] == "completed"
    os.kill(hung.popen.pid, signal.SIGSTOP)
    try:
        for i in range(HUNG):
            m = Moved(list(range(PAGES)), list(range(i * PAGES, (i + 1) * PAGES)), 0, i)
            status, body = await create(http, dep, f"hung-{i}", m, prefill=[hung.url])
            assert status == 201, body
        moves = []
        for i in range(HEALTHY):
            first = (HUNG + i) * PAGES
            m = Moved(list(range(PAGES)), list(range(first, first + PAGES)), 1, HUNG + i)
            status, body = await create(http, dep, f"ok-{i}", m, deadline_s=10.0)
            assert status == 201, body
            assert (await ready(http, dep, f"ok-{i}", 0, m))[0] == 202
            moves.append(m)
        for i in range(HEALTHY):
            view = await finished(http, dep, f"ok-{i}", timeout_s=30.0)
            assert view["state"] == "completed", view.get("error")
        assert not landed(dep, [warm, *moves])
    finally:
        os.kill(hung.popen.pid, signal.SIGCONT)
