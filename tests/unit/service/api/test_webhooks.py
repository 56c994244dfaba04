"""Webhook routes and handoff records end to end: a decode app and its prefill app in this
process (local transport, real HTTP, a real SQLite file per decode service), a real receiver on
127.0.0.1 (`tests.receivers`), signatures checked with the `standardwebhooks` package."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from kvhandoff.pipelines.decode.views import HandoffRequest
from kvhandoff.service.config import ConfigError
from kvhandoff.service.http.app import READINESS
from kvhandoff.service.records.handoffs import HandoffRecords
from kvhandoff.service.runtime.persistence import PERSISTENCE, RESTARTED, Persistence, purge_once
from kvhandoff.service.runtime.roles import DECODE
from kvhandoff.service.serve import Server, serve
from kvhandoff.service.storage import FILE_NAME, Database
from kvhandoff.service.webhooks.signatures import new_secret
from tests.receivers import WAIT_S, Answer, WebhookReceiver
from tests.unit.service.handoff_fixtures import (
    Deployment,
    assert_problem,
    decode_config,
    extensions,
    fill_sources,
    open_deployment,
    prefill_config,
)
from tests.unit.service.metrics_checks import parse, promtool_check, value

SRC, DST, SLOT = [3, 4], [10, 11], 1
LOOPBACK: dict[str, Any] = {"webhooks.allow_private": True, "webhooks.backoff_base_s": 0.01}
CALLBACK_SECRET = new_secret()


@pytest.fixture
async def receiver() -> AsyncIterator[WebhookReceiver]:
    r = await WebhookReceiver().start()
    yield r
    await r.stop()


def deployment(**settings: Any) -> Any:
    return open_deployment(decode=decode_config({**LOOPBACK, **settings}))


async def run(d: Deployment, hid: str, dst_pages: list[int] = DST, **extra: Any) -> dict[str, Any]:
    reply = await d.create(hid, dst_pages, SLOT, **extra)
    assert reply.status == 201, reply.body
    for rank in (0, 1):
        assert (await d.ready(hid, rank, SRC, 0)).status == 202
    view = await d.finish(hid)
    assert view["state"] == "completed", view
    return view


async def register(d: Deployment, url: str, **body: Any) -> dict[str, Any]:
    reply = await d.request("POST", f"{d.decode.url}/v1/webhooks", json={"url": url, **body})
    assert reply.status == 201, reply.body
    created: dict[str, Any] = reply.body
    return created


def persistence(server: Server) -> Persistence:
    return server.app[PERSISTENCE]


async def until(check: Callable[[], bool]) -> None:
    """Wait (bounded) for a state the service reaches by itself, re-checking on every turn."""
    async with asyncio.timeout(WAIT_S):
        while not check():
            await asyncio.sleep(0.01)


# ------------------------------------------------------------------------------ deliveries


async def test_every_event_is_delivered_signed_once_and_in_sequence(
    receiver: WebhookReceiver,
) -> None:
    async with deployment() as d:
        fill_sources(d)
        ep = await register(d, receiver.url, types=["handoff.", "stage.arrived"])
        assert ep["secret"].startswith("whsec_") and ep["id"].startswith("ep_")
        view = await run(d, "h1")
        # Subscribed: `handoff.*` and `stage.arrived`, not the segment commits of the timeline.
        wanted = [
            e["type"]
            for e in view["timeline"]
            if e["type"].startswith("handoff.") or e["type"] == "stage.arrived"
        ]
        got = await receiver.count(len(wanted))
        payloads = [r.verified(ep["secret"]) for r in got]  # standardwebhooks, not our code
        assert [p["type"] for p in payloads] == wanted
        assert [p["data"]["seq"] for p in payloads] == sorted(p["data"]["seq"] for p in payloads)
        assert all(p["data"]["handoff_id"] == "h1" for p in payloads)
        assert [p["data"]["type"] for p in payloads[-2:]] == [
            "handoff.completed",
            "handoff.released",  # the pages are free: what an engine waits for
        ]
        assert payloads[-1]["timestamp"].endswith("Z")
        assert len({r.webhook_id for r in got}) == len(got)
        # The secret is shown once: never in the listing or the endpoint itself.
        listed = await d.request("GET", f"{d.decode.url}/v1/webhooks")
        assert [e["id"] for e in listed.body["items"]] == [ep["id"]]
        assert "secret" not in listed.body["items"][0]
        one = await d.request("GET", f"{d.decode.url}/v1/webhooks/{ep['id']}")
        assert "secret" not in one.body and one.body["types"] == ["handoff.", "stage.arrived"]
        await until(lambda: persistence(d.decode).dispatcher.pending_count == 0)
        page = await d.request("GET", f"{d.decode.url}/v1/webhooks/{ep['id']}/deliveries")
        items = page.body["items"]
        assert [i["state"] for i in items] == ["delivered"] * len(wanted)
        assert {i["webhook_id"] for i in items} == {r.webhook_id for r in got}
        assert all(i["history"][0]["status"] == 200 for i in items)
        # The metrics count exactly these deliveries, and the exposition passes promtool.
        async with d.http.get(f"{d.decode.url}/metrics") as resp:
            text = await resp.text()
        promtool_check(text)
        samples = parse(text)
        assert value(samples, "kvhandoff_webhook_deliveries_total", result="delivered") == len(
            wanted
        )
        assert value(samples, "kvhandoff_webhook_deliveries_total", result="failed") == 0
        assert value(samples, "kvhandoff_webhook_attempts_total") == len(wanted)
        assert value(samples, "kvhandoff_webhook_retries_total") == 0
        assert value(samples, "kvhandoff_webhook_outbox_depth") == 0


async def test_a_type_prefix_selects_events_and_a_given_secret_signs(
    receiver: WebhookReceiver,
) -> None:
    secret = new_secret()
    async with deployment() as d:
        fill_sources(d)
        ep = await register(d, receiver.url, types=["handoff.completed"], secret=secret)
        assert ep["secret"] == secret
        await run(d, "h1")
        await run(d, "h2", dst_pages=[20, 21])
        got = await receiver.count(2)
        assert [r.verified(secret)["data"]["handoff_id"] for r in got] == ["h1", "h2"]
        assert {r.type for r in got} == {"handoff.completed"}


async def test_callback_url_receives_its_handoffs_events_signed_with_the_callback_secret(
    receiver: WebhookReceiver,
) -> None:
    async with deployment(**{"webhooks.callback_secret": CALLBACK_SECRET}) as d:
        fill_sources(d)
        await run(d, "h1", callback_url=receiver.url)
        await run(d, "h2", dst_pages=[20, 21])  # no callback: nothing for it
        got = await receiver.wait_for(lambda r: any(x.type == "handoff.completed" for x in r))
        got = await receiver.wait_for(lambda r: any(x.type == "handoff.released" for x in r))
        assert [r.verified(CALLBACK_SECRET)["type"] for r in got] == [
            "handoff.created",
            "handoff.completed",
            "handoff.released",
        ]
        assert {r.handoff_id for r in got} == {"h1"}


async def test_callback_url_needs_a_callback_secret(receiver: WebhookReceiver) -> None:
    async with deployment() as d:
        reply = await d.create("h1", DST, SLOT, callback_url=receiver.url)
        assert_problem(reply, 409, "conflict", field="callback_url")
        assert (await d.get("h1")).status == 404  # refused before anything was accepted


async def test_private_targets_and_hosts_off_the_allow_list_are_refused() -> None:
    settings = {"webhooks.allow_private": False, "webhooks.callback_secret": CALLBACK_SECRET}
    async with deployment(**settings) as d:
        for url in ("http://127.0.0.1:9/hook", "http://10.1.2.3/hook", "http://[::1]:9/x"):
            reply = await d.request("POST", f"{d.decode.url}/v1/webhooks", json={"url": url})
            assert_problem(reply, 422, "webhook_target_refused", field="url")
        reply = await d.create("h1", DST, SLOT, callback_url="http://192.168.0.9/cb")
        assert_problem(reply, 422, "webhook_target_refused", field="callback_url")
        bad = await d.request(
            "POST", f"{d.decode.url}/v1/webhooks", json={"url": "http://x", "secret": "abc"}
        )
        assert_problem(bad, 422, field="secret")
        # Found by the fuzzer (500 before): a host IDNA cannot encode, in a body with odd text.
        fuzzed = {
            "types": [],
            "description": "\udaaf\udc7c\u00fb",
            "url": 'http://x\u00b6"n\u00ac[}mF\ud964\udcb7}9\ud8cf\udc9c',
        }
        reply = await d.request("POST", f"{d.decode.url}/v1/webhooks", json=fuzzed)
        assert_problem(reply, 422, "webhook_target_refused", field="url")
        listed = await d.request("GET", f"{d.decode.url}/v1/webhooks")
        assert listed.body["items"] == []
    async with deployment(**{"webhooks.allow_private": True}) as d:
        # A lone surrogate cannot be stored as UTF-8 text: refused before anything is stored.
        reply = await d.request(
            "POST",
            f"{d.decode.url}/v1/webhooks",
            data=b'{"url": "http://127.0.0.1:9/x", "description": "\\udaaf"}',
        )
        assert_problem(reply, 400, "malformed_body")
        assert (await d.request("GET", f"{d.decode.url}/v1/webhooks")).body["items"] == []
    async with deployment(**{"webhooks.allow_hosts": ["hooks.example.com"]}) as d:
        reply = await d.request(
            "POST", f"{d.decode.url}/v1/webhooks", json={"url": "http://127.0.0.1:9/hook"}
        )
        assert_problem(reply, 422, "webhook_target_refused", field="url")
        assert "allow_hosts" in reply.body["detail"]


async def test_a_receiver_that_is_down_gets_the_same_webhook_id_once_it_is_up() -> None:
    down = WebhookReceiver()  # not started: connections are refused
    async with deployment() as d:
        fill_sources(d)
        ep = await register(d, down.url, types=["handoff.completed"])
        await run(d, "h1")
        outbox = persistence(d.decode).outbox

        def attempts() -> list[dict[str, Any]]:
            page = outbox.deliveries(ep["id"], None, 10, 0)
            return [a for item in page.items for a in item.history]  # type: ignore[misc]

        await until(lambda: len(attempts()) >= 2)
        assert all(a.status is None and a.error for a in attempts())  # type: ignore[attr-defined]
        await down.start()
        try:
            got = await down.count(1)
            got[0].verified(ep["secret"])
            page = outbox.deliveries(ep["id"], None, 10, 0)
            await until(lambda: outbox.deliveries(ep["id"], "delivered", 10, 0).items != [])
            assert got[0].webhook_id == page.items[0].webhook_id
        finally:
            await down.stop()


async def test_410_disables_the_endpoint_and_cancels_what_is_pending(
    receiver: WebhookReceiver,
) -> None:
    receiver.default = Answer(status=410)
    async with deployment(**{"webhooks.concurrency": 1}) as d:
        fill_sources(d)
        ep = await register(d, receiver.url)
        await run(d, "h1")
        await receiver.count(1)
        url = f"{d.decode.url}/v1/webhooks/{ep['id']}"
        await until(lambda: persistence(d.decode).outbox.endpoints[ep["id"]].disabled)
        one = await d.request("GET", url)
        assert "410" in one.body["disabled_reason"]
        states = {i["state"] for i in (await d.request("GET", url + "/deliveries")).body["items"]}
        assert states == {"cancelled"}
        await run(d, "h2", dst_pages=[20, 21])
        assert len(receiver.received) == 1  # a disabled endpoint gets nothing more
        retry = await d.request("POST", f"{url}/deliveries/1/retry")
        assert_problem(retry, 409, "conflict", field="id")
        async with d.http.get(f"{d.decode.url}/metrics") as resp:
            samples = parse(await resp.text())
        assert value(samples, "kvhandoff_webhook_endpoints_disabled_total") == 1
        assert value(samples, "kvhandoff_webhook_deliveries_total", result="delivered") == 0


async def test_a_failed_delivery_can_be_retried_by_hand(receiver: WebhookReceiver) -> None:
    receiver.default = Answer(status=500)
    async with deployment(**{"webhooks.max_attempts": 2}) as d:
        fill_sources(d)
        ep = await register(d, receiver.url, types=["handoff.completed"])
        await run(d, "h1")
        url = f"{d.decode.url}/v1/webhooks/{ep['id']}/deliveries"
        outbox = persistence(d.decode).outbox
        await until(lambda: outbox.deliveries(ep["id"], "failed", 10, 0).items != [])
        failed = (await d.request("GET", url + "?state=failed")).body["items"][0]
        assert failed["attempts"] == 2
        assert [a["status"] for a in failed["history"]] == [500, 500]
        assert failed["last_error"] == "HTTP 500"
        receiver.default = Answer(status=204)
        retried = await d.request("POST", f"{url}/{failed['id']}/retry")
        assert retried.status == 202 and retried.body["state"] == "pending"
        got = await receiver.count(3)
        assert len({r.webhook_id for r in got}) == 1
        await until(lambda: outbox.deliveries(ep["id"], "delivered", 10, 0).items != [])
        bad = await d.request("GET", url + "?state=nope")
        assert_problem(bad, 422, field="state")
        missing = await d.request("POST", f"{url}/999/retry")
        assert_problem(missing, 404, field="delivery_id")
        # Issue 18 B: Unicode digits and ids SQLite cannot hold were a 500.
        for raw in ("%C2%B2", "%E2%91%A0", str(2**63), "9" * 30):
            refused = await d.request("POST", f"{url}/{raw}/retry")
            assert_problem(refused, 422, field="delivery_id")
        largest = await d.request("POST", f"{url}/{2**63 - 1}/retry")
        assert_problem(largest, 404, field="delivery_id")


async def test_deleting_an_endpoint_stops_its_deliveries(receiver: WebhookReceiver) -> None:
    async with deployment() as d:
        fill_sources(d)
        ep = await register(d, receiver.url, types=["handoff.completed"])
        url = f"{d.decode.url}/v1/webhooks/{ep['id']}"
        assert (await d.request("DELETE", url)).status == 204
        assert_problem(await d.request("GET", url), 404, "not_found")
        await run(d, "h1")
        assert receiver.received == []


# ------------------------------------------------------------------------------ records


async def test_a_finished_handoff_is_answered_after_a_restart(tmp_path: Path) -> None:
    config = decode_config({**LOOPBACK, "server.state_dir": str(tmp_path)})
    async with (
        serve(prefill_config([0, 1]), extensions) as prefill,
        aiohttp.ClientSession() as http,
    ):
        async with serve(config, extensions) as first:
            d = Deployment(http, first, [prefill])
            fill_sources(d)
            before = await run(d, "h1", metadata={"router": "r1"})
        async with serve(config, extensions) as again:  # the same state dir, a new process
            d = Deployment(http, again, [prefill])
            after = await d.get("h1")
            assert after.status == 200
            assert after.body["state"] == "completed"
            assert after.body["bytes"] == before["bytes"]
            # The stored timeline runs to the release, as the live one does (issue 18 C).
            tags = [e["type"] for e in after.body["timeline"]]
            assert tags[-2:] == ["handoff.completed", "handoff.released"]
            assert after.body["released"] is True
            body = {"id": "h1", "prefill": d.prefill_urls, "dst_pages": DST, "dst_slot": SLOT}
            body["metadata"] = {"router": "r1"}
            same = await d.request("POST", f"{again.url}/v1/handoffs", json=body)
            assert same.status == 200 and same.body["state"] == "completed"
            other = await d.request(
                "POST", f"{again.url}/v1/handoffs", json={**body, "dst_pages": [1]}
            )
            assert_problem(other, 409, "conflict", field="id")
            assert_problem(await d.get("never"), 404, "not_found")


async def test_a_handoff_in_flight_at_a_crash_fails_as_restarted_with_its_pages_fenced(
    tmp_path: Path, receiver: WebhookReceiver
) -> None:
    # What a killed process leaves behind: an accepted record, and an endpoint to tell.
    now = time.time()
    db = Database(tmp_path / FILE_NAME)
    request = HandoffRequest(id="old", prefill=["http://p"], dst_pages=[5, 6], dst_slot=2)
    with db.transaction() as tx:
        HandoffRecords(db, grace_s=1.0).accepted(tx, request, now, now + 30.0)
    db.close()
    config = decode_config({**LOOPBACK, "server.state_dir": str(tmp_path)})
    async with open_deployment(decode=config) as d:
        fill_sources(d)
        old = await d.get("old")
        assert old.status == 200
        assert old.body["state"] == "failed"
        assert old.body["error"]["code"] == RESTARTED
        # Its old prefill stages may write until the deadline plus the engine timeout.
        fenced = await d.create("new", [6, 7], SLOT)
        assert_problem(fenced, 409, "conflict", field="dst_pages[0]", holder="old")
        slot = await d.create("new", [7], 2)
        assert_problem(slot, 409, "conflict", field="dst_slot", holder="old")
        # The restart's failure is in the outbox: an endpoint registered now does not see it
        # (it was not registered when it happened), so check the outbox's record instead.
        p = persistence(d.decode)
        assert p.records.find("old") is not None
        await run(d, "new2", dst_pages=[8, 9])


async def test_a_landed_handoff_in_flight_at_a_crash_frees_its_pages_at_once(
    tmp_path: Path,
) -> None:
    # Landed, its pages changed only by the dead process's own commits (SAFETY.md S1): the
    # restart fails it as restarted and releases it at once, confirmed; its pages serve the
    # next handoff with no fence to wait out.
    now = time.time()
    db = Database(tmp_path / FILE_NAME)
    request = HandoffRequest(id="old", prefill=["http://p"], dst_pages=[5, 6], dst_slot=2)
    with db.transaction() as tx:
        # Its arena at an address no allocation of this life can have (the first page).
        records = HandoffRecords(db, grace_s=30.0, arena=(4096, 4096))
        records.accepted(tx, request, now, now + 30.0)
    db.close()
    config = decode_config({**LOOPBACK, "server.state_dir": str(tmp_path)})
    async with open_deployment(decode=config) as d:
        fill_sources(d)
        old = await d.get("old")
        assert old.body["state"] == "failed" and old.body["error"]["code"] == RESTARTED
        assert old.body["released"] is True
        released = old.body["timeline"][-1]
        assert released["type"] == "handoff.released" and released["confirmed"] is True
        await run(d, "new", dst_pages=[6, 7])
        p = persistence(d.decode)
        assert p.records.fenced(time.time()) == []
        # This life's handoffs keep this life's arena, for the next restart to check.
        p.records.apply()
        row = p.db.conn.execute("SELECT arena_base, arena_bytes FROM handoffs WHERE id = 'new'")
        assert tuple(row.fetchone()) == d.decode.app[DECODE].pipeline.query.arena_span()


async def test_a_restored_fence_lasts_the_longest_declarable_grace_then_is_released(
    tmp_path: Path, receiver: WebhookReceiver
) -> None:
    # The fence of an earlier life's handoff lasts its deadline plus handoff.max_grace_s (the
    # longest engine call any prefill may declare; the decode's own transport bound is shorter),
    # then ends like any release: handoff.released, the record marked, the pages reusable.
    grace_s = 20.0
    # The fence must still hold when the restarted service first answers: its start-up (and
    # the create below) take well under a second idle, several on a busy machine.
    left_s = 6.0
    now = time.time()
    db = Database(tmp_path / FILE_NAME)
    request = HandoffRequest(id="old", prefill=["http://p"], dst_pages=[5, 6], dst_slot=2)
    with db.transaction() as tx:
        HandoffRecords(db, grace_s=grace_s).accepted(tx, request, now - 60, now - grace_s + left_s)
    db.close()
    settings = {**LOOPBACK, "server.state_dir": str(tmp_path), "handoff.max_grace_s": grace_s}
    async with open_deployment(decode=decode_config(settings)) as d:
        fill_sources(d)
        ep = await register(d, receiver.url, types=["handoff.released"])
        fenced = await d.create("new", [6, 7], SLOT)  # under `left_s` left of the fence
        assert_problem(fenced, 409, "conflict", field="dst_pages[0]", holder="old")
        assert (await d.get("old")).body["released"] is False
        # A router's long poll for the release waits for the fence to lift (issue 18 B: it
        # answered at once with released=false after a restart).
        url = f"{d.decode.url}/v1/handoffs/old"
        async with d.http.get(url, params={"wait_s": "60", "until": "released"}) as resp:
            polled = await resp.json()
        assert polled["released"] is True, polled
        assert (await d.get("old")).body["released"] is True
        released = (await receiver.count(1))[0].verified(ep["secret"])
        assert released["data"]["handoff_id"] == "old"
        assert released["data"]["confirmed"] is False and released["data"]["outcome"] == "failed"
        p = persistence(d.decode)
        assert p.records.fenced(time.time()) == []  # a later restart fences nothing again
        # Its event stream (from its record) ends instead of waiting for ever, and its pages
        # serve a new handoff.
        async with d.http.get(f"{d.decode.url}/v1/handoffs/old/events") as resp:
            async with asyncio.timeout(WAIT_S):
                text = await resp.text()
        assert "event: handoff.failed" in text
        assert text.rstrip().endswith("}") and "event: handoff.released" in text  # runs to it
        await run(d, "new", dst_pages=[6, 7])


async def test_the_restart_failure_reaches_a_webhook_registered_before_the_crash(
    tmp_path: Path, receiver: WebhookReceiver
) -> None:
    config = decode_config({**LOOPBACK, "server.state_dir": str(tmp_path)})
    async with open_deployment(decode=config) as d:  # registers, then "dies" below
        ep = await register(d, receiver.url, types=["handoff.failed"])
    now = time.time()
    db = Database(tmp_path / FILE_NAME)
    request = HandoffRequest(id="old", prefill=["http://p"], dst_pages=[5], dst_slot=2)
    with db.transaction() as tx:
        HandoffRecords(db, grace_s=1.0).accepted(tx, request, now, now + 30.0)
    db.close()
    async with open_deployment(decode=config):
        got = await receiver.count(1)
        payload = got[0].verified(ep["secret"])
        assert payload["data"]["handoff_id"] == "old"
        assert payload["data"]["code"] == RESTARTED


async def test_retention_purges_old_records_but_never_fenced_ones(tmp_path: Path) -> None:
    config = decode_config(
        {**LOOPBACK, "server.state_dir": str(tmp_path), "records.max_records": 1}
    )
    async with open_deployment(decode=config) as d:
        fill_sources(d)
        await run(d, "h1")
        await run(d, "h2", dst_pages=[20, 21])
        p = persistence(d.decode)
        assert purge_once(p, config) == 1
        assert p.records.find("h1") is None and p.records.find("h2") is not None


async def test_a_failed_write_makes_the_service_unready_not_inconsistent() -> None:
    async with deployment() as d:
        fill_sources(d)
        p = persistence(d.decode)
        p.db.conn.execute("PRAGMA query_only = ON")  # every write now fails, like a full disk
        reply = await d.create("h1", DST, SLOT)
        # Its record did not reach the disk: not accepted (a crash would forget it, unfenced),
        # but undone — aborted, its pages released — and refused like any create from now on.
        assert_problem(reply, 503, "not_ready", not_ready=["records"])
        h1 = (await d.request("GET", f"{d.decode.url}/v1/handoffs/h1")).body
        assert (h1["state"], h1["released"]) == ("aborted", True)
        assert await d.decode.app[READINESS].failing() == ["records"]  # /readyz answers 503
        assert p.broken is not None and "readonly" in p.broken
        # No more handoffs without a record: a crash would leave their pages unfenced.
        refused = await d.create("h2", [20, 21], SLOT + 1)
        assert_problem(refused, 503, "not_ready", not_ready=["records"])
        assert (await d.request("GET", f"{d.decode.url}/v1/handoffs/h2")).status == 404
        p.db.conn.execute("PRAGMA query_only = OFF")


async def test_an_unusable_state_dir_stops_start_up_naming_the_key(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    config = decode_config({"server.state_dir": str(blocker / "state")})
    with pytest.raises(ConfigError, match=r"^server.state_dir: cannot open"):
        async with serve(config, extensions):
            pass


async def test_the_number_of_registered_endpoints_is_bounded(
    monkeypatch: pytest.MonkeyPatch, receiver: WebhookReceiver
) -> None:
    """Issue 18 B: endpoints were unbounded (each a delivery lane fed every event it selects).
    Beyond the cap a create is a 409 naming the limit and changes nothing; a delete frees one."""
    import kvhandoff.service.api.webhooks as webhooks_api

    monkeypatch.setattr(webhooks_api, "MAX_ENDPOINTS", 2)
    async with deployment() as d:
        first = await register(d, receiver.url)
        await register(d, receiver.url)
        url = f"{d.decode.url}/v1/webhooks"
        refused = await d.request("POST", url, json={"url": receiver.url})
        assert_problem(refused, 409, "conflict", field="url", limit=2)
        assert len((await d.request("GET", url)).body["items"]) == 2
        assert (await d.request("DELETE", f"{url}/{first['id']}")).status == 204
        await register(d, receiver.url)
