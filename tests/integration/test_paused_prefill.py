"""A prefill the OS leaves unrun for seconds keeps its handoffs under the vLLM engines' settings
(#32): real processes, Mooncake TCP on 127.0.0.1.

In a `make bench-vllm` run a decode failed a handoff with `peer_timeout`: its destination got no
answer from a live prefill worker within the default 5 s peer call. The embedded loops' stall
probe showed why: stalls of up to 2.4 s during which the worker process used about 2 ms of CPU
(every thread idle, no GIL holder, no blocking call; the OS did not run the niced servers at load
16). Here the prefill is stopped (SIGSTOP: no CPU at all, the same from its peers' side) past
that default, while its destination is on its way. The vLLM engine tests' settings
(`tests.vllm.servers.write_kvhandoff_toml`) give a peer call as long as the heartbeats give a
silent peer, so the handoff waits for the prefill and completes, every byte in place.
"""

from __future__ import annotations

import asyncio
import os
import signal
import tomllib
from pathlib import Path

import aiohttp
import pytest

from kvhandoff.service.config import HandoffConfig, PeersConfig
from tests.integration.conftest import DeploymentFactory
from tests.integration.handoff_checks import (
    Moved,
    complete,
    create,
    fill_sources,
    finished,
    landed,
    ready,
    reset_decode,
)
from tests.vllm.servers import write_kvhandoff_toml

pytestmark = pytest.mark.integration

#: Past the default peer call (5 s), as the stall that failed the bench's handoff was not.
PAUSE_S = PeersConfig().request_timeout_s + 2.0


async def test_a_prefill_paused_past_the_default_peer_call_completes_its_handoff(
    deployment: DeploymentFactory, http: aiohttp.ClientSession, tmp_path: Path
) -> None:
    toml = write_kvhandoff_toml(tmp_path, secret="s" * 32, deadline_s=30.0)
    engine = tomllib.loads(toml.read_text())
    request_timeout_s = engine.get("peers", {}).get("request_timeout_s")
    dep = deployment(
        pp_size=1,
        handoff=HandoffConfig(
            default_deadline_s=30.0,
            heartbeat_interval_s=engine["handoff"]["heartbeat_interval_s"],
            peer_timeout_s=engine["handoff"]["peer_timeout_s"],
        ),
        env=(
            {}
            if request_timeout_s is None
            else {"KVHANDOFF_PEERS__REQUEST_TIMEOUT_S": str(request_timeout_s)}
        ),
    )
    fill_sources(dep, 3)
    reset_decode(dep)
    (prefill,) = [p for p in dep.processes if p.role == "prefill"]
    assert prefill.popen is not None
    warm = Moved([0, 1], [0, 1], 0, 0)  # the decode knows the prefill's layout from here on
    await complete(http, dep, "warm", warm)
    assert (await finished(http, dep, "warm"))["state"] == "completed"
    paused = Moved([2, 3], [4, 5], 1, 1)
    os.kill(prefill.popen.pid, signal.SIGSTOP)
    try:
        status, body = await create(http, dep, "paused", paused)
        assert status == 201, body
        await asyncio.sleep(PAUSE_S)  # its destination is waiting for the prefill meanwhile
    finally:
        os.kill(prefill.popen.pid, signal.SIGCONT)
    status, body = await ready(http, dep, "paused", 0, paused)
    assert status == 202, body
    view = await finished(http, dep, "paused")
    assert view["state"] == "completed", view.get("error")
    assert not landed(dep, [warm, paused])
