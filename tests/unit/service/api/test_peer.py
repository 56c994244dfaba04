"""The peer routes a service serves, seen from a peer's side of a real HTTP connection."""

from __future__ import annotations

import asyncio
import logging

import aiohttp
import pytest

from kvhandoff.pipelines.peer_calls import WATCH
from kvhandoff.service.http.peer_signing import Signer
from kvhandoff.service.runtime.roles import RUNTIME
from kvhandoff.service.serve import serve
from kvhandoff.service.webhooks.signatures import new_secret
from tests.unit.service.handoff_fixtures import WAIT_S, decode_config, extensions, prefill_config


async def test_a_watcher_that_leaves_ends_its_watch_quietly(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # Every watch ends with its watcher closing the connection (its handoffs ended, or it
    # stopped): the stream's next write finds the connection gone, which is no error to log.
    caplog.set_level(logging.DEBUG, logger="kvhandoff")
    config = prefill_config([0, 1], settings={"handoff.heartbeat_interval_s": 0.02})
    async with serve(config, extensions) as server, aiohttp.ClientSession() as http:
        resp = await http.get(server.url + WATCH.path)
        assert resp.status == 200
        assert await resp.content.readline() == b"\n"
        resp.close()  # drops the connection, as a watcher's process or session does

        def ended() -> bool:  # the access log has the request once its handler returned
            return any(
                WATCH.path in r.getMessage() for r in caplog.records if r.name == "kvhandoff.access"
            )

        async with asyncio.timeout(WAIT_S):
            while not ended():
                await asyncio.sleep(0.01)
    assert [r for r in caplog.records if r.levelno >= logging.WARNING] == []
    assert any("watch from" in r.getMessage() and "ended" in r.getMessage() for r in caplog.records)


async def test_a_signed_peer_notice_counts_as_hearing_its_sender() -> None:
    """Under load a busy prefill's heartbeat answers come late while its notices keep coming:
    a verified notice proves its sender alive as a heartbeat does, so the decode does not
    judge it silent (at 1,000 handoffs in flight it had declared live prefills lost). An
    unsigned one (peer auth off) proves nothing; here none is accepted at all."""
    secret = new_secret()
    sender = "http://127.0.0.1:9"  # nothing listens there: only the notice can be heard
    settings = {"auth.peer": secret, "handoff.heartbeat_interval_s": 3600.0}
    async with (
        serve(decode_config(settings), extensions) as server,
        aiohttp.ClientSession() as http,
    ):
        heartbeats = server.app[RUNTIME].heartbeats
        assert all(h.url != sender for h in heartbeats.health())
        raw = b"[]"  # an empty batch: nothing to act on, still a verified message
        path = "/v1/peer/arrivals"
        headers = {
            "Content-Type": "application/json",
            **Signer(secret, sender).headers("POST", path, raw, recipient=server.url),
        }
        async with http.post(server.url + path, data=raw, headers=headers) as resp:
            assert resp.status == 200, await resp.text()
        (heard,) = [h for h in heartbeats.health() if h.url == sender]
        assert heard.last_heard_s is not None and heard.last_heard_s < WAIT_S
        async with http.post(
            server.url + path, data=raw, headers={"Content-Type": "application/json"}
        ) as resp:
            assert resp.status == 401  # unsigned: refused, and not heard
