"""Webhooks and records as a router integrates them: real `kvhandoff serve` processes, Mooncake
over TCP on 127.0.0.1, the decode service's SQLite file on disk, a real receiver in this test,
signatures verified with the `standardwebhooks` package. The decode service is SIGKILLed with
handoffs in flight and deliveries pending, and restarted on the same state directory."""

from __future__ import annotations

import asyncio
import contextlib
import signal
from collections.abc import Iterator
from typing import Any

import aiohttp
import pytest

from kvhandoff.service.client import ApiError, KVHandoffClient
from kvhandoff.service.config import HandoffConfig, TransferConfig, WebhooksConfig
from kvhandoff.service.testing.deployment import LocalDeployment
from tests.integration.handoff_checks import (
    Moved,
    complete,
    create,
    fill_sources,
    reset_decode,
)
from tests.receivers import Answer, Received, WebhookReceiver

pytestmark = pytest.mark.integration

MODEL = {"scale": 64, "page_size": 16, "num_layers": 8}
TERMINAL = ("handoff.completed", "handoff.failed", "handoff.aborted")


@contextlib.contextmanager
def restart_deployment(seed: int, **config: Any) -> Iterator[LocalDeployment]:
    """A decode and two prefill stages (one process each) with sources filled from `seed`,
    and the configuration sections in `config` (webhooks, transfer)."""
    with LocalDeployment(
        preset="hybrid-npu-mla",
        model=MODEL,
        pp_size=2,
        num_pages=64,
        num_slots=8,
        handoff=HandoffConfig(default_deadline_s=20.0),
        **config,
    ) as d:
        fill_sources(d, seed=seed)
        reset_decode(d)
        yield d


@pytest.fixture(scope="module")
def dep() -> Iterator[LocalDeployment]:
    hooks = WebhooksConfig(
        allow_private=True, backoff_base_s=0.05, backoff_max_s=0.5, timeout_s=1.0
    )
    with restart_deployment(3, webhooks=hooks) as d:
        yield d


@pytest.fixture(scope="module")
def direct_dep() -> Iterator[LocalDeployment]:
    with restart_deployment(4, transfer=TransferConfig(mode="direct")) as d:
        yield d


async def test_a_direct_decode_keeps_an_earlier_life_s_pages_fenced(
    direct_dep: LocalDeployment, http: aiohttp.ClientSession
) -> None:
    # The twin of the landed restart below: in direct mode the old prefill stages write into
    # the pages themselves, so after a SIGKILL their pages stay fenced until the handoff's
    # deadline plus the engine timeout, and a new handoff naming them is refused naming it.
    dep = direct_dep
    kv = KVHandoffClient(dep.decode_url, session=http)
    assert (await create(http, dep, "direct-live", Moved([10], [20], 2, 2)))[0] == 201
    await asyncio.to_thread(dep.kill, "decode", signal.SIGKILL)
    await asyncio.to_thread(dep.restart, "decode")
    view = await kv.get("direct-live")
    assert view.state.value == "failed" and view.error is not None
    assert view.error.code == "service_restarted" and not view.released
    with pytest.raises(ApiError) as fenced:
        await kv.create("reuse", [20], dst_slot=7)
    assert fenced.value.status == 409 and fenced.value.problem["holder"] == "direct-live"


async def test_sigkill_with_handoffs_in_flight_and_deliveries_pending(
    dep: LocalDeployment, http: aiohttp.ClientSession
) -> None:
    receiver = await WebhookReceiver().start()
    kv = KVHandoffClient(dep.decode_url, session=http)
    try:
        endpoint = await kv.register_webhook(receiver.url, types=["handoff."])
        secret = endpoint["secret"]
        # Delivered before the crash.
        await complete(http, dep, "done-1", Moved([1, 2], [1, 2], 0, 0))
        assert (await kv.wait("done-1")).state.value == "completed"
        await receiver.wait_for(
            lambda got: any(r.handoff_id == "done-1" and r.type == "handoff.completed" for r in got)
        )
        # The receiver goes down: what follows stays pending in the outbox.
        await receiver.stop()
        await complete(http, dep, "done-2", Moved([3, 4], [3, 4], 1, 1))
        assert (await kv.wait("done-2")).state.value == "completed"
        in_flight = {f"live-{i}": Moved([10 + i], [20 + i], i + 2, i + 2) for i in range(3)}
        for hid, m in in_flight.items():
            assert (await create(http, dep, hid, m))[0] == 201  # accepted, never signalled
        with pytest.raises(ApiError) as refused:
            await kv.create("never", [10_000], dst_slot=0)
        assert refused.value.status == 422
        pending = await kv.deliveries(endpoint["id"], state="pending")
        pending_ids = {d["webhook_id"] for d in pending if d["handoff_id"] == "done-2"}
        assert pending_ids  # done-2's deliveries wait for the receiver

        await asyncio.to_thread(dep.kill, "decode", signal.SIGKILL)
        await receiver.start()  # up again, same port
        await asyncio.to_thread(dep.restart, "decode")

        # Every accepted id is terminal; the in-flight ones failed as restarted.
        for hid in ("done-1", "done-2"):
            assert (await kv.get(hid)).state.value == "completed"
        for hid in in_flight:
            view = await kv.get(hid)
            assert view.state.value == "failed" and view.error is not None
            assert view.error.code == "service_restarted"
        with pytest.raises(ApiError) as missing:
            await kv.get("never")
        assert missing.value.status == 404
        # Landed (the default): their pages are free at once, since only the dead process's
        # own commits ever wrote them (SAFETY.md S1); a new handoff may lease them.
        await kv.create("reuse", [20], dst_slot=7)
        await kv.abort("reuse")

        # Every terminal event's webhook arrives at least once, signed; none for "never".
        accepted = {"done-1", "done-2", *in_flight}

        def all_terminal(got: list[Received]) -> bool:
            released = {r.handoff_id for r in got if r.type == "handoff.released"}
            return (
                accepted <= {r.handoff_id for r in got if r.type in TERMINAL}
                and set(in_flight) <= released
            )

        got = await receiver.wait_for(all_terminal, timeout_s=30)
        payloads = [r.verified(secret) for r in got]
        freed = [p["data"] for p in payloads if p["type"] == "handoff.released"]
        assert all(f["confirmed"] for f in freed if f["handoff_id"] in in_flight), freed
        assert "never" not in {p["data"]["handoff_id"] for p in payloads}
        restarted = [p for p in payloads if p["type"] == "handoff.failed"]
        assert {p["data"]["handoff_id"] for p in restarted} == set(in_flight)
        assert {p["data"]["code"] for p in restarted} == {"service_restarted"}
        # done-2's deliveries pending at the crash arrive with the webhook-id they had.
        assert pending_ids <= {r.webhook_id for r in got}
    finally:
        await receiver.stop()


async def test_receivers_that_are_busy_gone_or_slow(
    dep: LocalDeployment, http: aiohttp.ClientSession
) -> None:
    busy, gone, slow = [await WebhookReceiver().start() for _ in range(3)]
    gone.default = Answer(410)
    hold = asyncio.Event()
    # Each scripted answer goes to the first request its receiver *reads*. Which attempt that
    # is depends on load: on a busy machine an attempt can time out (1 s) before this process
    # reads it, and the answer then goes to a retry. The checks below allow such timed-out
    # attempts before the scripted one, and nothing else.
    busy.respond = lambda r: Answer(503, {"Retry-After": "1"}) if not busy.received else Answer()
    # Held until the end of the test: the sender's 1 s timeout ends that attempt.
    slow.respond = lambda r: Answer(200, hold=hold) if not slow.received else Answer()
    kv = KVHandoffClient(dep.decode_url, session=http)
    try:
        endpoints = {
            name: await kv.register_webhook(r.url, types=["handoff.completed"])
            for name, r in (("busy", busy), ("gone", gone), ("slow", slow))
        }
        await complete(http, dep, "receivers", Moved([5], [40], 5, 5))
        assert (await kv.wait("receivers")).state.value == "completed"

        async def history(name: str) -> list[dict[str, object]]:
            async with asyncio.timeout(30):
                while not (items := await kv.deliveries(endpoints[name]["id"], state="delivered")):
                    await asyncio.sleep(0.02)
            return list(items[0]["history"])

        def timed_out(attempt: dict[str, object]) -> bool:
            return "status" not in attempt and "Timeout" in str(attempt["error"])

        for name, r in (("busy", busy), ("slow", slow)):
            attempts = await history(name)
            got = await r.count(2)
            # The same message, again: every request carries the one webhook-id.
            assert {received.webhook_id for received in got} == {got[0].webhook_id}, name
            for received in got:
                assert received.verified(endpoints[name]["secret"])["type"] == "handoff.completed"
            answered = [a for a in attempts if "status" in a]
            assert all(timed_out(a) for a in attempts if "status" not in a), (name, attempts)
            if name == "busy":
                assert [a["status"] for a in answered] == [503, 200], attempts
                gap_s = float(answered[1]["at"]) - float(answered[0]["at"])  # type: ignore[arg-type]
                assert gap_s >= 1.0  # Retry-After
            else:
                assert [a["status"] for a in answered] == [200], attempts
                assert len(attempts) >= 2 and attempts[-1] == answered[0], attempts
        await gone.count(1)
        async with asyncio.timeout(30):
            while True:
                async with http.get(f"{dep.decode_url}/v1/webhooks/{endpoints['gone']['id']}") as r:
                    body = await r.json()
                if "disabled_at" in body:
                    break
                await asyncio.sleep(0.02)
        assert "410" in body["disabled_reason"]
        assert [d["state"] for d in await kv.deliveries(endpoints["gone"]["id"])] == ["cancelled"]
    finally:
        hold.set()
        for r in (busy, gone, slow):
            await r.stop()
