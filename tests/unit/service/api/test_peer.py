"""The peer routes a service serves, seen from a peer's side of a real HTTP connection."""

from __future__ import annotations

import asyncio
import logging

import aiohttp
import pytest

from service.peers.protocol import WATCH_PATH
from service.serve import serve
from tests.unit.service.handoff_fixtures import WAIT_S, extensions, prefill_config


async def test_a_watcher_that_leaves_ends_its_watch_quietly(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # Every watch ends with its watcher closing the connection (its handoffs ended, or it
    # stopped): the stream's next write finds the connection gone, which is no error to log.
    caplog.set_level(logging.DEBUG, logger="kvhandoff")
    config = prefill_config([0, 1], settings={"handoff.heartbeat_interval_s": 0.02})
    async with serve(config, extensions) as server, aiohttp.ClientSession() as http:
        resp = await http.get(server.url + WATCH_PATH)
        assert resp.status == 200
        assert await resp.content.readline() == b"\n"
        resp.close()  # drops the connection, as a watcher's process or session does

        def ended() -> bool:  # the access log has the request once its handler returned
            return any(
                WATCH_PATH in r.getMessage() for r in caplog.records if r.name == "kvhandoff.access"
            )

        async with asyncio.timeout(WAIT_S):
            while not ended():
                await asyncio.sleep(0.01)
    assert [r for r in caplog.records if r.levelno >= logging.WARNING] == []
    assert any("watch from" in r.getMessage() and "ended" in r.getMessage() for r in caplog.records)
