"""Webhooks and records as a router integrates them: real `kvhandoff serve` processes, Mooncake
over TCP on 127.0.0.1, the decode service's SQLite file on disk, a real receiver in this test,
signatures verified with the `standardwebhooks` package. The decode service is SIGKILLed with
handoffs in flight and deliveries pending, and restarted on the same state directory."""

from __future__ import annotations

import asyncio
import signal
from collections.abc import AsyncIterator, Iterator

import aiohttp
import pytest

from service.client import ApiError, KVHandoffClient
from service.config import HandoffConfig, WebhooksConfig
from service.tools.deployment import LocalDeployment
from tests.integration.handoff_checks import Moved, create, fill_sources, ready, reset_decode
from tests.receivers import Received, WebhookReceiver

pytestmark = pytest.mark.integration

MODEL = {"scale": 64, "page_size": 16, "num_layers": 8}
TERMINAL = ("handoff.completed", "handoff.failed", "handoff.aborted")


@pytest.fixture(scope="module")
def dep() -> Iterator[LocalDeployment]:
    with LocalDeployment(
        preset="hybrid-npu-mla",
        model=MODEL,
        pp_size=2,
        num_pages=64,
        num_slots=8,
        handoff=HandoffConfig(default_deadline_s=20.0),
        webhooks=WebhooksConfig(allow_private=True, backoff_base_s=0.05, backoff_max_s=0.5),
    ) as d:
        fill_sources(d, seed=3)
        reset_decode(d)
        yield d


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as session:
        yield session


async def complete(http: aiohttp.ClientSession, dep: LocalDeployment, hid: str, m: Moved) -> None:
    assert (await create(http, dep, hid, m))[0] == 201
    for r in range(dep.pp_size):
        assert (await ready(http, dep, hid, r, m))[0] == 202


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
        # Their pages stay fenced: the old prefill stages may write until deadline + timeout.
        with pytest.raises(ApiError) as fenced:
            await kv.create("reuse", [20], dst_slot=7)
        assert fenced.value.status == 409 and fenced.value.problem["holder"] == "live-0"

        # Every terminal event's webhook arrives at least once, signed; none for "never".
        accepted = {"done-1", "done-2", *in_flight}

        def all_terminal(got: list[Received]) -> bool:
            return accepted <= {r.handoff_id for r in got if r.type in TERMINAL}

        got = await receiver.wait_for(all_terminal, timeout_s=30)
        payloads = [r.verified(secret) for r in got]
        assert "never" not in {p["data"]["handoff_id"] for p in payloads}
        restarted = [p for p in payloads if p["type"] == "handoff.failed"]
        assert {p["data"]["handoff_id"] for p in restarted} == set(in_flight)
        assert {p["data"]["code"] for p in restarted} == {"service_restarted"}
        # done-2's deliveries pending at the crash arrive with the webhook-id they had.
        assert pending_ids <= {r.webhook_id for r in got}
    finally:
        await receiver.stop()
