"""The role assembly: one build function per role used by every door, each resource closed
once, and route modules that install in any order."""

from __future__ import annotations

import asyncio
import contextlib
import logging

import aiohttp
import pytest

from kvhandoff.pipelines.decode import DecodePipeline
from kvhandoff.pipelines.events import EventBus, HandoffAborted, HandoffCompleted, HandoffFailed
from kvhandoff.pipelines.prefill import PrefillPipeline
from kvhandoff.service.api.dashboard import install_dashboard
from kvhandoff.service.api.events import install_events
from kvhandoff.service.api.handoffs import install_handoffs
from kvhandoff.service.api.metrics import install_metrics
from kvhandoff.service.api.validate import install_validate
from kvhandoff.service.api.webhooks import install_webhooks
from kvhandoff.service.embedded import EmbeddedService
from kvhandoff.service.http.app import Extension
from kvhandoff.service.runtime import roles
from kvhandoff.service.runtime.roles import DECODE, PREFILL, RUNTIME, install_runtime
from kvhandoff.service.serve import install_service, serve
from tests.unit.service.handoff_fixtures import decode_config, prefill_config


@pytest.mark.parametrize("role", ["decode", "prefill"])
async def test_each_role_s_pipeline_is_closed_once_on_shutdown(
    role: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    cls: type[DecodePipeline] | type[PrefillPipeline] = (
        DecodePipeline if role == "decode" else PrefillPipeline
    )
    closed: list[object] = []
    real_close = cls.close

    async def counting_close(self: object, *args: object) -> None:
        closed.append(self)
        await real_close(self, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(cls, "close", counting_close)
    config = decode_config() if role == "decode" else prefill_config([0, 1])
    async with serve(config, [install_service]) as server:
        runtime = server.app[RUNTIME]
        assert runtime.role == role
        typed = server.app[DECODE] if role == "decode" else server.app[PREFILL]
        assert typed is runtime and isinstance(typed.pipeline, cls)
        assert (PREFILL if role == "decode" else DECODE) not in server.app
    assert closed == [runtime.pipeline]


def test_the_embedded_service_is_built_by_the_same_function_as_the_http_app(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    built: list[roles.DecodeRuntime] = []
    real = roles.build_decode

    def spy(*args: object) -> roles.DecodeRuntime:
        runtime = real(*args)  # type: ignore[arg-type]
        built.append(runtime)
        return runtime

    monkeypatch.setattr(roles, "build_decode", spy)
    with EmbeddedService(decode_config()) as svc:
        assert len(built) == 1
        assert svc._running_server().app[DECODE] is built[0]


async def test_route_modules_install_in_any_order() -> None:
    """No order-sensitive list: what a route module needs of the runtime waits for it."""
    installs: list[Extension] = [
        install_webhooks,
        install_dashboard,
        install_metrics,
        install_events,
        install_handoffs,
        install_validate,
        install_runtime,
    ]
    async with (
        serve(decode_config(), installs) as server,
        aiohttp.ClientSession() as http,
    ):
        async with http.get(f"{server.url}/readyz") as ready:
            assert ready.status == 200, await ready.text()
        async with http.get(f"{server.url}/metrics") as metrics:
            text = await metrics.text()
        # Collectors the metrics module attaches once the runtime (and its records) exist.
        assert "kvhandoff_webhook_attempts" in text
        assert "kvhandoff_peer" in text or "kvhandoff_handoffs_in_flight" in text


def _closed_port_url() -> str:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


async def _readyz(http: aiohttp.ClientSession, url: str) -> tuple[int, dict[str, object]]:
    async with http.get(f"{url}/readyz") as resp:
        return resp.status, await resp.json(content_type=None)


async def test_a_decode_is_ready_only_while_a_configured_prefill_is_reachable() -> None:
    """Issue 18 D: `/readyz` means the decode can do its job. With `peers.prefill` configured
    and none of them reachable it is not ready (503 naming `peers`); its `peers` section says
    which are up. The heartbeats ping configured peers while idle, so a prefill that stops
    while nothing is in flight turns the decode not ready without any handoff."""
    dead = _closed_port_url()
    fast = {"handoff.heartbeat_interval_s": 0.1, "handoff.peer_timeout_s": 0.5}
    async with aiohttp.ClientSession() as http:
        async with serve(decode_config({**fast, "peers.prefill": [dead]}), [install_service]) as d:
            status, body = 0, {}
            for _ in range(300):  # until the runtime runs and the heartbeats tried the peer
                status, body = await _readyz(http, d.url)
                if "peers" in body:
                    break
                await asyncio.sleep(0.01)
            assert status == 503 and body["code"] == "not_ready", body
            assert body["not_ready"] == ["peers"], body
            assert body["peers"] == [
                {"url": dead, "up": False, "configured": True, "last_heard_s": None}
            ]
        stop = contextlib.AsyncExitStack()
        prefill = await stop.enter_async_context(serve(prefill_config([0, 1]), [install_service]))
        config = decode_config({**fast, "peers.prefill": [prefill.url, dead]})
        async with serve(config, [install_service]) as d:
            for _ in range(300):
                status, body = await _readyz(http, d.url)
                if status == 200:
                    break
                await asyncio.sleep(0.01)
            assert status == 200, body
            assert "peers" in body["checks"]
            peers = {p["url"]: (p["up"], p["configured"]) for p in body["peers"]}
            assert peers == {prefill.url: (True, True), dead: (False, True)}
            await stop.aclose()  # the prefill stops with nothing in flight
            for _ in range(1000):
                status, body = await _readyz(http, d.url)
                if status == 503:
                    break
                await asyncio.sleep(0.01)
            assert status == 503 and body["not_ready"] == ["peers"], body
            assert {p["url"]: p["up"] for p in body["peers"]} == {prefill.url: False, dead: False}


async def test_a_decode_without_configured_prefill_and_a_prefill_need_no_peer_to_be_ready() -> None:
    # Routers name the prefill of each handoff (the Kubernetes base): nothing to ask about.
    async with aiohttp.ClientSession() as http:
        for config in (decode_config(), prefill_config([0, 1])):
            async with serve(config, [install_service]) as server:
                status, body = await _readyz(http, server.url)
                assert status == 200 and "peers" not in body["checks"], body


def test_an_outcome_that_did_not_complete_says_why_in_its_info_line(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The info log alone tells why a handoff failed or was aborted (its code and reason), and a
    reason from a peer cannot start a line of its own; a completion stays one short line."""
    bus = EventBus()
    bus.add_listener(roles._log_event)
    with caplog.at_level(logging.INFO, logger="kvhandoff.handoffs"):
        bus.publish(
            HandoffCompleted(handoff_id="a", role="decode", bytes=1, seconds=0.1, verified=True)
        )
        bus.publish(
            HandoffFailed(
                handoff_id="b", role="decode", code="deadline_exceeded", reason="no stage in 2 s"
            )
        )
        bus.publish(HandoffAborted(handoff_id="c", role="prefill", reason="peer said\nforged"))
    assert [r.getMessage() for r in caplog.records if r.levelno == logging.INFO] == [
        "handoff.completed decode a",
        "handoff.failed decode b code='deadline_exceeded' reason='no stage in 2 s'",
        "handoff.aborted prefill c reason='peer said\\nforged'",
    ]
