"""The batch routes (`kvhandoff.service.api.batches`): many creates on the decode, many stage
readies on the prefill, each item answered alone under its single route's rules, over real HTTP
between a decode app and its prefill app in this process (`handoff_fixtures`)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest

import kvhandoff.service.api.batches as batches_api
import kvhandoff.service.api.handoffs as handoffs_api
from kvhandoff.service.api.batches import MAX_BATCH_ITEMS
from kvhandoff.service.runtime.roles import DECODE
from tests.unit.service.handoff_fixtures import (
    PP_SIZE,
    Deployment,
    Move,
    Reply,
    assert_decode_is,
    assert_problem,
    decode_config,
    expected_decode,
    fill_decode,
    fill_sources,
    open_deployment,
    prefill_config,
)

MOVES = [Move([3, 4], [10, 11], 2, 1), Move([9], [2], 3, 0), Move([5, 6], [20, 21], 4, 2)]


@pytest.fixture
async def d() -> AsyncIterator[Deployment]:
    async with open_deployment() as deployment:
        fill_sources(deployment)
        yield deployment


def create_item(d: Deployment, hid: str, move: Move, **extra: Any) -> dict[str, Any]:
    body = {"id": hid, "prefill": d.prefill_urls, "dst_pages": move.dst_pages}
    return {**body, "dst_slot": move.dst_slot, **extra}


def ready_item(hid: str, rank: int, move: Move, **extra: Any) -> dict[str, Any]:
    body = {"handoff_id": hid, "pp_rank": rank, "src_pages": move.src_pages}
    return {**body, "src_slot": move.src_slot, **extra}


async def create_batch(d: Deployment, items: Any) -> Reply:
    return await d.request("POST", f"{d.decode.url}/v1/handoff-batches", json={"items": items})


async def ready_batch(d: Deployment, items: Any) -> Reply:
    url = f"{d.prefills[0].url}/v1/stages/ready"
    return await d.request("POST", url, json={"items": items})


async def test_a_batch_creates_and_readies_every_handoff_and_lands_its_bytes(
    d: Deployment,
) -> None:
    before = fill_decode(d)
    ids = [f"b-{i}" for i in range(len(MOVES))]
    created = await create_batch(d, [create_item(d, h, m) for h, m in zip(ids, MOVES)])
    assert created.status == 200, created.body
    assert [(r["status"], r["view"]["id"]) for r in created.body["items"]] == [
        (201, h) for h in ids
    ]
    items = [ready_item(h, rank, m) for rank in (1, 0) for h, m in zip(ids, MOVES)]
    ready = await ready_batch(d, items)
    assert ready.status == 200, ready.body
    assert [r["status"] for r in ready.body["items"]] == [202] * len(items)
    assert ready.body["items"][0]["ack"] == {"handoff_id": "b-0", "pp_rank": 1, "layers": None}
    for hid in ids:
        assert (await d.finish(hid))["state"] == "completed"
    assert_decode_is(d, expected_decode(d, before, *MOVES))
    again = await create_batch(d, [create_item(d, ids[0], MOVES[0])])  # idempotent
    assert again.body["items"][0]["status"] == 200


async def test_a_bad_item_is_answered_alone_naming_its_index_and_field(d: Deployment) -> None:
    first = await d.create("held", [30], 5)
    assert first.status == 201
    items = [
        create_item(d, "ok-0", MOVES[0]),
        create_item(d, "bad-1", Move([0], [10_000], 0, 6)),  # outside the decode pool
        {"id": "bad-2", "dst_pages": "nope"},  # not even the item's type
        create_item(d, "bad-3", Move([0], [30], 0, 7)),  # a page another handoff leases
        create_item(d, "held", Move([0], [31], 0, 5)),  # the id again, another body
        create_item(d, "ok-5", MOVES[1]),
    ]
    reply = await create_batch(d, items)
    assert reply.status == 200, reply.body
    results = reply.body["items"]
    assert [r["status"] for r in results] == [201, 422, 422, 409, 409, 201]
    fields = [r["problem"].get("field") for r in results[1:5]]
    assert fields == ["items[1].dst_pages[0]", "items[2].dst_pages", "items[3].dst_pages[0]",
                      "items[4].id"]  # fmt: skip
    assert [r["problem"]["index"] for r in results[1:5]] == [1, 2, 3, 4]
    for hid in ("bad-1", "bad-2", "bad-3"):  # nothing of them exists
        assert_problem(await d.get(hid), 404)
    held = (await d.get("held")).body
    assert [e["type"] for e in held["timeline"]] == ["handoff.created"]  # item 4 changed nothing
    ready = await ready_batch(
        d,
        [
            ready_item("ok-0", 0, MOVES[0]),
            ready_item("ok-0", 0, Move([10_000], [], 0, 0)),  # outside the source pool
            {"handoff_id": "x/y", "pp_rank": 0},  # not a handoff id
            ready_item("ok-0", 1, MOVES[0], layers=[-1]),
            ready_item("ok-0", 1, MOVES[0]),
        ],
    )
    statuses = [r["status"] for r in ready.body["items"]]
    assert statuses == [202, 409, 422, 422, 202], ready.body
    assert [r["problem"]["field"] for r in ready.body["items"][1:4]] == [
        "items[1].src_pages",
        "items[2].handoff_id",
        "items[3].layers[0]",
    ]
    assert (await d.finish("ok-0"))["state"] == "completed"


async def test_the_item_count_is_bounded_and_the_body_must_be_a_batch(d: Deployment) -> None:
    too_many = [create_item(d, f"n-{i}", MOVES[0]) for i in range(MAX_BATCH_ITEMS + 1)]
    assert_problem(await create_batch(d, too_many), 422, field="items")
    assert_problem(await create_batch(d, []), 422, field="items")
    url = f"{d.decode.url}/v1/handoff-batches"
    assert_problem(await d.request("POST", url, json=[create_item(d, "n", MOVES[0])]), 422)
    assert_problem(await ready_batch(d, [{"handoff_id": "r"}] * (MAX_BATCH_ITEMS + 1)), 422)
    assert_problem(await d.get("n-0"), 404)
    # An item that is not an object is no route's item: the batch is refused whole, as its
    # schema says, and its good items are not created either.
    mixed = [create_item(d, "n-ok", MOVES[0]), 5]
    assert_problem(await create_batch(d, mixed), 422, field="items[1]")
    assert_problem(await d.get("n-ok"), 404)
    assert_problem(await ready_batch(d, [{"handoff_id": "r", "pp_rank": 0}, "x"]), 422)


async def test_a_batch_of_readies_keeps_the_bound_on_handoffs_awaiting_a_destination(
    d: Deployment, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(handoffs_api, "MAX_AWAITING_DESTINATION", 2)
    reply = await ready_batch(d, [ready_item(f"o-{i}", 0, MOVES[0]) for i in range(3)])
    assert [r["status"] for r in reply.body["items"]] == [202, 202, 429]
    assert reply.body["items"][2]["problem"]["field"] == "items[2].handoff_id"


async def test_an_item_that_raises_outside_the_error_tree_is_answered_500_alone(
    d: Deployment, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A bug in one item's handling: the others keep their answers (a router that read a whole
    # 500 would call the created ones rejected and reschedule them: work done twice).
    runtime = d.decode.app[DECODE]
    create = runtime.create

    async def crashing_create(item: Any) -> Any:
        if item.id == "boom":
            raise RuntimeError("a bug")
        return await create(item)

    monkeypatch.setattr(runtime, "create", crashing_create)
    items = [create_item(d, "ok-a", MOVES[0]), create_item(d, "boom", MOVES[1])]
    reply = await create_batch(d, items)
    assert reply.status == 200, reply.body
    ok, boom = reply.body["items"]
    assert (ok["status"], ok["view"]["id"]) == (201, "ok-a")
    assert boom["status"] == 500
    assert (boom["problem"]["field"], boom["problem"]["index"]) == ("items[1]", 1)
    assert boom["problem"]["code"] == "internal_error"
    signal = batches_api.signal_ready

    def crashing_signal(pipeline: Any, handoff_id: str, *args: Any) -> Any:
        if handoff_id == "boom":
            raise RuntimeError("a bug")
        return signal(pipeline, handoff_id, *args)

    monkeypatch.setattr(batches_api, "signal_ready", crashing_signal)
    items = [ready_item("boom", 0, MOVES[1]), ready_item("ok-a", 0, MOVES[0])]
    reply = await ready_batch(d, items)
    assert reply.status == 200, reply.body
    assert [r["status"] for r in reply.body["items"]] == [500, 202]
    assert reply.body["items"][0]["problem"]["field"] == "items[0]"


async def test_batch_routes_take_their_single_routes_credentials() -> None:
    # Separate router and engine credentials: each batch route takes its single route's, and
    # refuses the other role's (and none).
    auth = {"auth.router": "router-secret", "auth.engine": "engine-secret"}
    decode, prefill = decode_config(auth), [prefill_config(range(PP_SIZE), settings=auth)]
    async with open_deployment(decode=decode, prefill=prefill) as d:
        fill_sources(d)
        create = f"{d.decode.url}/v1/handoff-batches"
        ready = f"{d.prefills[0].url}/v1/stages/ready"
        creates = {"items": [create_item(d, "t-0", MOVES[0])]}
        readies = {"items": [ready_item("t-0", 0, MOVES[0])]}
        for token, url, body, status in (
            (None, create, creates, 401),
            ("engine-secret", create, creates, 403),
            (None, ready, readies, 401),
            ("router-secret", ready, readies, 403),
            ("router-secret", create, creates, 200),
            ("engine-secret", ready, readies, 200),
        ):
            headers = {} if token is None else {"Authorization": f"Bearer {token}"}
            async with (
                aiohttp.ClientSession(headers=headers) as http,
                http.post(url, json=body) as resp,
            ):
                assert resp.status == status, (token, url, await resp.text())
                if status == 200:
                    assert (await resp.json())["items"][0]["status"] in (201, 202)


async def test_openapi_documents_the_batch_routes(d: Deployment) -> None:
    for url, path, schema in (
        (d.decode.url, "/v1/handoff-batches", "HandoffBatch"),
        (d.prefills[0].url, "/v1/stages/ready", "StageReadyBatch"),
    ):
        doc = (await d.request("GET", f"{url}/openapi.json")).body
        op = doc["paths"][path]["post"]
        ref = op["requestBody"]["content"]["application/json"]["schema"]["$ref"]
        assert ref.endswith(f"/{schema}")
        items = doc["components"]["schemas"][schema]["properties"]["items"]
        assert items["maxItems"] == 256
        # Each item an object checked alone (one item's 422), so the schema does not promise a
        # whole-request refusal for an item that breaks its single route's schema.
        assert items["items"]["type"] == "object", items
