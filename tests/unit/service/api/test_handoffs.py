"""The HTTP handoff service end to end: a decode app and its prefill app(s) in this process.

Both roles run with `serve()` over the local transport (see `handoff_fixtures`), so every test
crosses real HTTP between real apps and checks real pool bytes. The last tests cover
`service.heartbeat.Heartbeats` alone, with a fake clock and fake peers.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import msgspec
import numpy as np
import pytest

from kvhandoff.pipelines.models import hybrid_npu_mla
from kvhandoff.service.runtime.roles import DECODE
from kvhandoff.service.serve import serve
from tests.unit.service.handoff_fixtures import (
    DECODE_PAGES,
    MODEL,
    PREFILL_PAGES,
    WAIT_S,
    Deployment,
    Move,
    Reply,
    assert_decode_is,
    assert_problem,
    decode_config,
    decode_memory,
    expected_decode,
    extensions,
    fill_decode,
    fill_sources,
    make_config,
    open_deployment,
    prefill_config,
    snapshot,
    stage_bytes,
    stage_memory,
    watch,
)

SRC, DST = [3, 4, 9], [10, 11, 2]
SRC_SLOT, DST_SLOT = 2, 1
MOVE = Move(SRC, DST, SRC_SLOT, DST_SLOT)


@pytest.fixture
async def d() -> AsyncIterator[Deployment]:
    """Both prefill stages in one prefill app; sources random, decode pool all sentinel."""
    async with open_deployment() as deployment:
        fill_sources(deployment)
        fill_decode(deployment)
        yield deployment


async def ready_all(d: Deployment, handoff_id: str, move: Move = MOVE) -> None:
    for rank in (1, 0):
        reply = await d.ready(handoff_id, rank, move.src_pages, move.src_slot)
        assert reply.status == 202, reply.body


def tags(view: dict[str, Any]) -> list[str]:
    return [event["type"] for event in view["timeline"]]


def live_leases(d: Deployment) -> int:
    pipeline = d.decode.app[DECODE].pipeline
    assert pipeline is not None
    return len(pipeline.leases)


# ------------------------------------------------------------------------------- the happy path


@pytest.mark.parametrize(
    ("split", "verify"),
    [(False, False), (True, True)],
    ids=["one-prefill-app", "prefill-app-per-stage-verified"],
)
async def test_handoff_lands_every_byte_in_its_layer_group_and_page(
    split: bool, verify: bool
) -> None:
    async with open_deployment(split=split) as d:
        fill_sources(d)
        before = fill_decode(d)
        created = await d.create("req-1", DST, DST_SLOT, verify=verify, metadata={"user": "u"})
        assert created.status == 201, created.body
        assert created.body["state"] == "pending"
        assert [s["state"] for s in created.body["stages"]] == ["waiting", "waiting"]
        for rank in (1, 0):
            ack = await d.ready("req-1", rank, SRC, SRC_SLOT)
            assert (ack.status, ack.body) == (
                202,
                {"handoff_id": "req-1", "pp_rank": rank, "layers": None},
            )

        view = await d.finish("req-1")

        assert view["state"] == "completed", view.get("error")
        assert_decode_is(d, expected_decode(d, before, MOVE))
        per_stage = [stage_bytes(d, rank, len(SRC)) for rank in (0, 1)]
        assert view["bytes"] == sum(per_stage)
        assert view["stages"] == [
            {"pp_rank": rank, "peer": d.host_of(rank).url, "state": "arrived", "bytes": n}
            for rank, n in enumerate(per_stage)
        ]
        assert view["metadata"] == {"user": "u"}
        # Landed (the default): each stage's segment is committed by the decode before it
        # arrives (one segment per stage here).
        assert tags(view) == [
            "handoff.created",
            "stage.segment_committed",
            "stage.arrived",
            "stage.segment_committed",
            "stage.arrived",
            "handoff.completed",
            "handoff.released",
        ]
        # Landed: every segment's digest was checked before its commit, `verify` or not.
        assert view["timeline"][-2]["verified"] is True and view["verification"] == "passed"
        assert view["released"] is True and view["timeline"][-1]["confirmed"] is True
        assert live_leases(d) == 0


async def test_a_decode_holding_a_prefix_receives_the_pages_after_it_only(d: Deployment) -> None:
    # The engine signals the request's every page; the decode holds the first two (a prefix it
    # cached) and gives pages for the rest: only those are written, from their positions.
    src, dst = [5, 6, *SRC], DST
    before = snapshot(decode_memory(d))
    created = await d.create("pre", dst, DST_SLOT, prefix_pages=2)
    assert created.status == 201, created.body
    for rank in (1, 0):
        assert (await d.ready("pre", rank, src, SRC_SLOT)).status == 202
    view = await d.finish("pre")
    assert view["state"] == "completed", view.get("error")
    assert (view["prefix_pages"], view["num_pages"]) == (2, len(dst))
    assert_decode_is(d, expected_decode(d, before, Move(src[2:], dst, SRC_SLOT, DST_SLOT)))
    assert view["bytes"] == sum(stage_bytes(d, rank, len(dst)) for rank in (0, 1))
    url = f"{d.decode.url}/v1/handoffs"
    bad = await d.request("POST", url, json={"id": "neg", "dst_pages": [1], "prefix_pages": -1})
    assert_problem(bad, 422, "invalid_input", field="prefix_pages")
    none = await d.request("POST", url, json={"id": "none", "dst_pages": [1], "fan_out": 0})
    assert_problem(none, 422, "invalid_input", field="fan_out")


async def test_layers_land_as_they_are_signalled_and_the_handoff_waits_for_the_rest(
    d: Deployment,
) -> None:
    before = snapshot(decode_memory(d))
    assert (await d.create("req-1", DST, DST_SLOT)).status == 201
    async with watch(d.host_of(1)) as prefill_events:
        # The KV of layer 7 first (the stage's first signal carries its pages), then the state
        # of layer 4 alone; each lands before the next signal is sent.
        first = await d.ready("req-1", 1, SRC, SRC_SLOT, layers=[7])
        assert first.status == 202, first.body
        await prefill_events.next("stage.transferred", "req-1", pp_rank=1)
        second = await d.ready("req-1", 1, layers=[4])
        assert second.status == 202, second.body
        await prefill_events.next("stage.transferred", "req-1", pp_rank=1)

    assert_decode_is(d, expected_decode(d, before, Move(SRC, DST, SRC_SLOT, DST_SLOT, {4, 7})))
    view = (await d.get("req-1")).body
    assert view["state"] in ("pending", "transferring")
    assert [s["state"] for s in view["stages"]] == ["waiting", "waiting"]

    await ready_all(d, "req-1")
    assert (await d.finish("req-1"))["state"] == "completed"
    assert_decode_is(d, expected_decode(d, before, MOVE))


async def test_concurrent_handoffs_all_land_byte_exact(d: Deployment) -> None:
    before = snapshot(decode_memory(d))
    moves = {
        f"req-{k}": Move(
            [4 * k, 4 * k + 1, 4 * k + 2], [8 * k + 7, 8 * k + 1, 8 * k + 4], k, 15 - k
        )
        for k in range(8)
    }
    created = await asyncio.gather(
        *(d.create(h, m.dst_pages, m.dst_slot) for h, m in moves.items())
    )
    assert [r.status for r in created] == [201] * 8
    await asyncio.gather(*(ready_all(d, hid, move) for hid, move in moves.items()))

    views = await asyncio.gather(*(d.finish(hid) for hid in moves))

    assert [v["state"] for v in views] == ["completed"] * 8
    assert_decode_is(d, expected_decode(d, before, *moves.values()))


# ------------------------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    ("dst_pages", "field", "detail"),
    [
        ([1, 2, DECODE_PAGES], "dst_pages[2]", "outside"),
        ([5, 6, 5], "dst_pages[2]", "repeats dst_pages[0]"),
    ],
    ids=["out-of-range", "duplicate"],
)
async def test_bad_destination_pages_are_refused_naming_the_field(
    d: Deployment, dst_pages: list[int], field: str, detail: str
) -> None:
    before = snapshot(decode_memory(d))
    reply = await d.create("req-1", dst_pages, DST_SLOT)
    assert_problem(reply, 422, "plan_error", field=field)
    assert detail in reply.body["detail"]
    assert_problem(await d.get("req-1"), 404, "not_found")
    assert live_leases(d) == 0
    assert_decode_is(d, before)


async def test_bad_ready_signals_are_refused_naming_field_and_layer(d: Deployment) -> None:
    assert (await d.create("req-1", DST, DST_SLOT)).status == 201
    bad_page = await d.ready("req-1", 0, [1, PREFILL_PAGES], SRC_SLOT)
    assert_problem(bad_page, 422, "plan_error", field="src_pages[1]", layer_id=3, group=0)
    foreign_layer = await d.ready("req-1", 0, SRC, SRC_SLOT, layers=[7])
    assert_problem(foreign_layer, 422, "invalid_input", field="layers", layer_id=7, pp_rank=0)
    url = f"{d.prefills[0].url}/v1/handoffs/req-1/stages/2/ready"
    no_stage = await d.request("POST", url, json={"src_pages": SRC, "src_slot": SRC_SLOT})
    assert_problem(no_stage, 404, "not_found", field="pp_rank", pp_rank=2)


async def test_malformed_and_unknown_bodies_are_refused(d: Deployment) -> None:
    url = f"{d.decode.url}/v1/handoffs"
    unknown = await d.request("POST", url, json={"id": "x", "dst_pages": [1], "bogus": 1})
    assert_problem(unknown, 422, "invalid_input", field="bogus")
    assert "bogus" in unknown.body["detail"]
    assert_problem(await d.request("POST", url, data=b"{not json"), 400, "malformed_body")
    wrong_type = await d.request("POST", url, json={"id": "x", "dst_pages": [1, "2"]})
    assert_problem(wrong_type, 422, "invalid_input", field="dst_pages[1]")
    bad_state = await d.request("GET", f"{url}?state=done")
    assert_problem(bad_state, 422, "invalid_input", field="state")


async def test_create_is_idempotent_for_the_same_body_and_fenced_otherwise(d: Deployment) -> None:
    first = await d.create("req-1", [1, 2], 0)
    again = await d.create("req-1", [1, 2], 0)
    assert (first.status, again.status) == (201, 200)
    assert again.body["created_at"] == first.body["created_at"]
    assert_problem(await d.create("req-1", [1, 3], 0), 409, "conflict", field="id")
    leased = await d.create("req-2", [7, 2], 1)
    assert_problem(leased, 409, "conflict", field="dst_pages[1]", holder="req-1")
    slot_taken = await d.create("req-2", [7], 0)
    assert_problem(slot_taken, 409, "conflict", field="dst_slot", holder="req-1")
    assert_problem(await d.get("req-2"), 404)


async def test_list_filters_by_state_and_pages_by_cursor(d: Deployment) -> None:
    for k, hid in enumerate(["a", "b", "c"]):
        assert (await d.create(hid, [k], k)).status == 201
    await ready_all(d, "b", Move([5], [1], SRC_SLOT, 1))
    assert (await d.finish("b"))["state"] == "completed"
    url = f"{d.decode.url}/v1/handoffs"

    page1 = (await d.request("GET", f"{url}?limit=2")).body
    page2 = (await d.request("GET", f"{url}?limit=2&cursor={page1['next_cursor']}")).body
    completed = (await d.request("GET", f"{url}?state=completed")).body

    assert [v["id"] for v in page1["items"]] == ["a", "b"]
    assert [v["id"] for v in page2["items"]] == ["c"] and page2["next_cursor"] is None
    assert [v["id"] for v in completed["items"]] == ["b"]
    assert "timeline" not in completed["items"][0]  # lists leave timelines out
    assert_problem(await d.request("GET", f"{url}?limit=0"), 422, field="limit")


async def test_abort_stops_the_handoff_before_any_byte_and_refuses_later_signals(
    d: Deployment,
) -> None:
    before = snapshot(decode_memory(d))
    assert (await d.create("req-1", DST, DST_SLOT)).status == 201
    async with watch(d.host_of(0)) as prefill_events:
        # Stage 0 started (its source pages known) but no layer is ready yet. Once it emitted
        # its empty chunk the prefill side holds the destination, so the abort is not racing it.
        assert (await d.ready("req-1", 0, SRC, SRC_SLOT, layers=[])).status == 202
        await prefill_events.next("stage.chunks_emitted", "req-1", pp_rank=0)

    aborted = await d.request("DELETE", f"{d.decode.url}/v1/handoffs/req-1")

    assert aborted.status == 200 and aborted.body["state"] == "aborted"
    # DELETE answers once the pages are free: the outcome, then the release.
    assert tags(aborted.body)[-2:] == ["handoff.aborted", "handoff.released"]
    assert aborted.body["released"] is True
    for rank in (0, 1):
        late = await d.ready("req-1", rank, SRC, SRC_SLOT)
        assert_problem(late, 409, "conflict", field="handoff_id")
    assert (await d.get("req-1")).body["state"] == "aborted"
    again = await d.request("DELETE", f"{d.decode.url}/v1/handoffs/req-1")
    assert (again.status, again.body["state"]) == (200, "aborted")
    assert (await d.create("req-2", DST, DST_SLOT)).status == 201  # the pages were released
    assert_decode_is(d, before)


async def test_handoffs_beyond_max_concurrent_are_refused_with_429() -> None:
    async with open_deployment(decode=decode_config({"handoff.max_concurrent": 2})) as d:
        assert [(await d.create(h, [k], k)).status for k, h in enumerate("ab")] == [201, 201]
        assert_problem(await d.create("c", [5], 5), 429, "capacity_exceeded", live=2)
        await ready_all(d, "a", Move([5], [0], SRC_SLOT, 0))
        assert (await d.finish("a"))["state"] == "completed"
        assert (await d.create("c", [5], 5)).status == 201  # a finished handoff frees its place


# ------------------------------------------------------------------------------- pairing


def _slot_size_model() -> dict[str, Any]:
    """The same model, except the conv state slot of every linear layer is 8 bytes longer."""
    spec = msgspec.to_builtins(
        hybrid_npu_mla(
            num_layers=MODEL["num_layers"], scale=MODEL["scale"], page_size=MODEL["page_size"]
        )
    )
    spec["state_kinds"][0]["slot_bytes"] += 8
    return {"spec": spec}


PAIRING_CASES: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
    "slot-size": (_slot_size_model(), {"layer_id": 0, "kind": "conv", "pp_rank": 0}),
    "extra-layers": ({**MODEL, "num_layers": 12}, {"layer_id": 11, "group": 0, "pp_rank": 1}),
    "dropped-layers": ({**MODEL, "num_layers": 4}, {"layer_id": 7, "group": 0}),
}
VALIDATE_CODES = {
    "slot-size": "slot_size_mismatch",
    "extra-layers": "missing_destination",
    "dropped-layers": "unfilled_destination",
}


@pytest.mark.parametrize("case", list(PAIRING_CASES))
async def test_create_refuses_a_prefill_that_does_not_pair_naming_the_entry(case: str) -> None:
    model, where = PAIRING_CASES[case]
    async with open_deployment(prefill=[prefill_config([0, 1], model=model)]) as d:
        before = fill_decode(d)
        reply = await d.create("req-1", DST, DST_SLOT)
        assert_problem(reply, 422, "pairing_error", **where)
        assert reply.body["problems"]
        assert_problem(await d.get("req-1"), 404)
        assert live_leases(d) == 0
        assert_decode_is(d, before)


@pytest.mark.parametrize("case", list(PAIRING_CASES))
async def test_validate_reports_what_the_published_layouts_get_wrong(case: str) -> None:
    model, where = PAIRING_CASES[case]
    async with open_deployment(prefill=[prefill_config([0, 1], model=model)]) as d:
        prefill_info = (await d.request("GET", f"{d.prefills[0].url}/v1/layout")).body
        decode_info = (await d.request("GET", f"{d.decode.url}/v1/layout")).body
        body = {
            "prefill": [s["layout"] for s in prefill_info["stages"]],
            "decode": decode_info["stages"][0]["layout"],
        }
        report = await d.request("POST", f"{d.decode.url}/v1/validate", json=body)
    assert report.status == 200 and report.body["ok"] is False
    first = report.body["problems"][0]
    assert first["code"] == VALIDATE_CODES[case]
    assert {k: first.get(k) for k in where} == where


async def test_validate_accepts_the_deployed_layouts(d: Deployment) -> None:
    prefill_info = (await d.request("GET", f"{d.prefills[0].url}/v1/layout")).body
    decode_info = (await d.request("GET", f"{d.decode.url}/v1/layout")).body
    assert (prefill_info["role"], decode_info["role"]) == ("prefill", "decode")
    body = {
        "prefill": [s["layout"] for s in prefill_info["stages"]],
        "decode": decode_info["stages"][0]["layout"],
    }
    report = (await d.request("POST", f"{d.decode.url}/v1/validate", json=body)).body
    assert report["ok"] is True and report["problems"] == []


# ------------------------------------------------------------------------------- failures


async def test_deadline_fails_the_handoff_naming_the_stage_still_waiting(d: Deployment) -> None:
    # Stage 0 must arrive before the deadline, however slow the machine: the deadline is long,
    # and passes (its timer runs) only once stage 0 arrived. The timer itself is proven on
    # real time in tests/unit/pipelines/test_handoff_pipelines.py.
    assert (await d.create("req-1", DST, DST_SLOT, deadline_s=600)).status == 201
    async with watch(d.decode) as decode_events:
        assert (await d.ready("req-1", 0, SRC, SRC_SLOT)).status == 202
        await decode_events.next("stage.arrived", "req-1", pp_rank=0)
    assert 0 < d.pass_deadline("req-1") <= 600

    view = await d.finish("req-1")

    assert view["state"] == "failed"
    assert view["error"]["code"] == "deadline_exceeded"
    assert view["error"]["pp_rank"] == 1
    assert "deadline of 600 s passed with stages [1] still to arrive" in view["error"]["reason"]
    assert [s["state"] for s in view["stages"]] == ["arrived", "failed"]
    outcome = [t for t in tags(view) if t in ("handoff.failed", "handoff.released")]
    assert outcome in (["handoff.failed"], ["handoff.failed", "handoff.released"])


async def test_a_stopped_prefill_service_fails_its_handoffs_as_soon_as_its_port_refuses() -> None:
    # All three services share this test's loop: on a loaded machine it may stall for seconds,
    # so silence is judged only after 60 s (a healthy stage is never judged silent here). The
    # stopped service is lost by its watch and refused probes, neither by silence nor by the
    # deadline (both far later): the reason says which.
    patient = {"handoff.heartbeat_interval_s": 1.0, "handoff.peer_timeout_s": 60.0}
    prefill = [prefill_config([rank], settings=patient) for rank in (0, 1)]
    async with open_deployment(decode=decode_config(patient), prefill=prefill) as d:
        assert (await d.create("req-1", DST, DST_SLOT, deadline_s=600)).status == 201
        async with watch(d.decode) as decode_events:
            assert (await d.ready("req-1", 0, SRC, SRC_SLOT)).status == 202
            await decode_events.next("stage.arrived", "req-1", pp_rank=0)
        lost_url = d.prefills[1].url

        await d.stop_prefill(1)  # stage 1 never signalled; its service is gone
        view = await d.finish("req-1")

    assert view["state"] == "failed"
    error = view["error"]
    assert error["code"] == "peer_unreachable"
    assert (error["pp_rank"], error["context"]) == (1, {"peer": lost_url})
    assert f"prefill peer {lost_url} (stage 1) refuses connections" in error["reason"]


# ------------------------------------------------------------------------------- auth, schema


async def test_a_shared_bearer_token_guards_every_service() -> None:
    async with open_deployment(token="s3cret") as d:
        fill_sources(d)
        before = fill_decode(d)
        assert (await d.create("req-1", DST, DST_SLOT)).status == 201
        await ready_all(d, "req-1")
        assert (await d.finish("req-1"))["state"] == "completed"
        assert_decode_is(d, expected_decode(d, before, MOVE))

        async with aiohttp.ClientSession() as anonymous:
            for url, scheme in (
                (f"{d.decode.url}/v1/handoffs/req-1", "Bearer"),
                (f"{d.prefills[0].url}/v1/layout", "KVHandoff-Signature"),  # a peer route
            ):
                async with anonymous.get(url) as resp:
                    body = await resp.json(content_type=None)
                    reply = Reply(resp.status, body, resp.content_type)
                    assert resp.headers["WWW-Authenticate"].startswith(scheme)
                assert_problem(reply, 401, "unauthorized")
            async with anonymous.get(f"{d.decode.url}/healthz") as resp:
                assert resp.status == 200  # only /v1 routes need the token


def _schema_ref(operation: dict[str, Any], status: str) -> str:
    ref: str = operation["responses"][status]["content"]["application/json"]["schema"]["$ref"]
    return ref


def _request_ref(operation: dict[str, Any]) -> str:
    ref: str = operation["requestBody"]["content"]["application/json"]["schema"]["$ref"]
    return ref


async def test_openapi_documents_the_handoff_routes_with_their_schemas(d: Deployment) -> None:
    docs = [await d.request("GET", f"{s.url}/openapi.json") for s in (d.decode, d.prefills[0])]
    assert [r.status for r in docs] == [200, 200], [r.body.get("detail") for r in docs]
    decode_doc, prefill_doc = (r.body for r in docs)
    paths = decode_doc["paths"]
    ready = prefill_doc["paths"]["/v1/handoffs/{id}/stages/{pp_rank}/ready"]["post"]

    create = paths["/v1/handoffs"]["post"]
    assert _request_ref(create).endswith("/HandoffRequest")
    assert _schema_ref(create, "201").endswith("/HandoffView")
    assert {"409", "422", "429"} <= set(create["responses"])
    assert _schema_ref(paths["/v1/handoffs"]["get"], "200").endswith("/HandoffPage")
    assert _schema_ref(paths["/v1/handoffs/{id}"]["get"], "200").endswith("/HandoffView")
    assert _schema_ref(paths["/v1/handoffs/{id}"]["delete"], "200").endswith("/HandoffView")
    assert _request_ref(ready).endswith("/StageReady")
    assert _schema_ref(ready, "202").endswith("/StageReadyAck")
    for doc in (decode_doc, prefill_doc):
        assert _schema_ref(doc["paths"]["/v1/layout"]["get"], "200").endswith("/LayoutInfo")
    request_schema = decode_doc["components"]["schemas"]["HandoffRequest"]
    assert {"id", "dst_pages"} <= set(request_schema["required"])
    assert {"dst_slot", "dst_slots", "dst_aux", "prefix_pages"} <= set(request_schema["properties"])
    assert "aux row" in json.dumps(request_schema["properties"]["dst_aux"])
    assert set(prefill_doc["components"]["schemas"]["StageReady"]["properties"]) == {
        "src_pages",
        "src_slot",
        "src_slots",
        "src_aux",
        "layers",
        "decode_url",
        "pages_from",
        "last_pages",
    }
    assert "/v1/handoffs" not in prefill_doc["paths"]  # each role documents its own routes


async def test_prefill_urls_are_compared_in_one_canonical_form(d: Deployment) -> None:
    """Issue 18 B: a prefill URL ending in "/" was accepted (201) but none of its stages'
    arrivals counted (they name the prefill's public_url), so the handoff failed at its
    deadline. Trailing slashes (and host case, a default port: `test_config`) name the same
    service."""
    spelled = [u + "/" for u in d.prefill_urls]
    reply = await d.create("slashes", DST, DST_SLOT, prefill=spelled, deadline_s=10)
    assert reply.status == 201, reply.body
    assert reply.body["prefill"] == d.prefill_urls  # as the services name themselves
    again = await d.create("slashes", DST, DST_SLOT, prefill=spelled, deadline_s=10)
    assert again.status == 200, again.body  # the same body, spelled the same way
    await ready_all(d, "slashes")
    view = await d.finish("slashes")
    assert view["state"] == "completed", view


async def test_a_prefill_holds_a_bounded_number_of_handoffs_awaiting_a_destination(
    d: Deployment, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 18 B: every ready signal for an id no destination named opened a handoff on the
    prefill, without bound. Beyond the cap a new one is a 429 naming `id`; a handoff whose
    destination arrived first, or one already open, is never refused."""
    import kvhandoff.service.api.handoffs as handoffs_api

    monkeypatch.setattr(handoffs_api, "MAX_AWAITING_DESTINATION", 3)
    for i in range(3):
        assert (await d.ready(f"orphan-{i}", 0, SRC, SRC_SLOT)).status == 202
    refused = await d.ready("orphan-3", 0, SRC, SRC_SLOT)
    assert_problem(refused, 429, "capacity_exceeded", field="id", limit=3)
    assert (await d.ready("orphan-0", 1, SRC, SRC_SLOT)).status == 202  # open already
    assert (await d.create("real", DST, DST_SLOT)).status == 201  # its destination first
    async with asyncio.timeout(WAIT_S):  # until the prefill holds its destination
        while (await d.get("real")).body["state"] == "pending":
            await asyncio.sleep(0.01)
    await ready_all(d, "real")
    assert (await d.finish("real"))["state"] == "completed"


async def test_two_decodes_sharing_a_prefill_may_use_the_same_handoff_id() -> None:
    """Issue 18 B: ids are the router's, unique per decode only. Two decodes create "same"
    through one prefill; the engine names each request's decode in its ready signals, and each
    decode gets exactly its own request's KV. A ready naming no decode while both are open is
    refused (409 naming `decode_url`): it could belong to either."""
    async with (
        serve(prefill_config([0, 1]), extensions) as prefill,
        serve(decode_config(), extensions) as first,
        serve(decode_config(), extensions) as second,
        aiohttp.ClientSession() as http,
    ):
        a, b = Deployment(http, first, [prefill]), Deployment(http, second, [prefill])
        fill_sources(a)
        before_a, before_b = fill_decode(a), fill_decode(b)
        move_a = Move(src_pages=[5, 6], dst_pages=[1, 2], src_slot=2, dst_slot=0)
        move_b = Move(src_pages=[7, 8], dst_pages=[3, 4], src_slot=3, dst_slot=1)
        for d, m in ((a, move_a), (b, move_b)):
            reply = await d.create("same", m.dst_pages, m.dst_slot)
            assert reply.status == 201, reply.body
        url = f"{prefill.url}/v1/handoffs/same/stages/0/ready"
        ambiguous = await a.request("POST", url, json={"src_pages": [5, 6], "src_slot": 2})
        assert_problem(ambiguous, 409, field="decode_url")
        for d, m in ((b, move_b), (a, move_a)):  # b's signals first: order does not matter
            for rank in (1, 0):
                body = {
                    "src_pages": m.src_pages,
                    "src_slot": m.src_slot,
                    "decode_url": d.decode.url,
                }
                url = f"{prefill.url}/v1/handoffs/same/stages/{rank}/ready"
                reply = await d.request("POST", url, json=body)
                assert reply.status == 202, reply.body
        for d in (a, b):
            assert (await d.finish("same"))["state"] == "completed"
        assert_decode_is(a, expected_decode(a, before_a, move_a))
        assert_decode_is(b, expected_decode(b, before_b, move_b))
        bad = await a.request("POST", url, json={"src_pages": [1], "decode_url": "decode-1"})
        assert_problem(bad, 422, field="decode_url")


async def test_an_abort_from_one_decode_stops_only_its_own_handoff_of_a_shared_id() -> None:
    async with (
        serve(prefill_config([0, 1]), extensions) as prefill,
        serve(decode_config(), extensions) as first,
        serve(decode_config(), extensions) as second,
        aiohttp.ClientSession() as http,
    ):
        a, b = Deployment(http, first, [prefill]), Deployment(http, second, [prefill])
        fill_sources(a)
        before_a = fill_decode(a)
        move = Move(src_pages=[5, 6], dst_pages=[1, 2], src_slot=2, dst_slot=0)
        for d in (a, b):
            assert (await d.create("shared", move.dst_pages, move.dst_slot)).status == 201
        aborted = await b.request("DELETE", f"{second.url}/v1/handoffs/shared")
        assert aborted.status == 200 and aborted.body["state"] == "aborted", aborted.body
        for rank in (0, 1):  # naming no decode: only a's handoff of that id is open now
            assert (await a.ready("shared", rank, move.src_pages, move.src_slot)).status == 202
        assert (await a.finish("shared"))["state"] == "completed"
        assert_decode_is(a, expected_decode(a, before_a, move))


# ---------------------------------------------------------------------------------------------
# Slots per state component and the aux row, over HTTP

SLOTS_MODEL: dict[str, Any] = {
    "spec": {
        "name": "hybrid-components-aux",
        "num_layers": 8,
        "full_attention_layers": [3, 7],
        "attention": "mha",
        "kv_groups": [{"name": "k", "bytes_per_token": 4}, {"name": "v", "bytes_per_token": 4}],
        "state_kinds": [
            {"kind": "conv", "slot_bytes": 32, "component": "mamba"},
            {"kind": "tail", "slot_bytes": 16, "component": "ring"},
        ],
        "page_size": 4,
        "aux_row_bytes": [8, 24],
    }
}


async def test_a_handoff_moves_each_component_s_slot_and_the_aux_row_over_http() -> None:
    decode = make_config("decode", [{"num_pages": 16, "num_slots": 6}], model=SLOTS_MODEL)
    stages = [{"pp_rank": r, "pp_size": 2, "num_pages": 16, "num_slots": 6} for r in (0, 1)]
    prefill = make_config("prefill", stages, model=SLOTS_MODEL)
    async with open_deployment(decode=decode, prefill=[prefill]) as d:
        fill_sources(d)
        before = fill_decode(d)
        for extra, field in (
            ({}, "dst_aux"),  # the decode layout has aux entries: the row is required
            ({"dst_aux": 6}, "dst_aux"),  # 6 aux rows: 0..5
            ({"dst_aux": 1, "dst_slots": {"swa": 1}}, "dst_slots.swa"),
            ({"dst_aux": 1, "dst_slots": {"ring": 6}}, "dst_slots.ring"),
        ):
            reply = await d.create("bad", [1], dst_slot=0, **extra)
            assert_problem(reply, 422, field=field)
        assert_decode_is(d, before)  # refused: nothing changed
        created = await d.create("h", [3, 4], dst_slot=2, dst_slots={"ring": 5}, dst_aux=1)
        assert created.status == 201, created.body
        assert created.body["dst_slots"] == {"ring": 5} and created.body["dst_aux"] == 1
        ready = f"{d.prefill_urls[0]}/v1/handoffs/h/stages"
        reply = await d.request(
            "POST", f"{ready}/0/ready", json={"src_pages": [1, 2], "src_slot": 4, "src_aux": 0}
        )
        assert_problem(reply, 422, field="src_aux")  # stage 0 sends no aux rows
        for rank, body in (
            (0, {"src_pages": [1, 2], "src_slot": 4, "src_slots": {"ring": 0}}),
            (1, {"src_pages": [1, 2], "src_slot": 3, "src_aux": 2}),
        ):
            reply = await d.request("POST", f"{ready}/{rank}/ready", json=body)
            assert reply.status == 202, reply.body
        view = await d.finish("h")
        assert view["state"] == "completed", view
        dec = decode_memory(d)
        k = len(dec.layout.kv)
        for rank, mamba, ring in ((0, 4, 0), (1, 3, 3)):
            src = stage_memory(d, rank)
            for i, s in enumerate(src.layout.state):
                j = dec.layout.state.index(
                    next(
                        x for x in dec.layout.state if (x.layer_id, x.kind) == (s.layer_id, s.kind)
                    )
                )
                row, at = (mamba, 2) if s.component == "mamba" else (ring, 5)
                sent = src.region(len(src.layout.kv) + i)[row * s.item_len :][: s.item_len]
                got = dec.region(k + j)[at * s.item_len :][: s.item_len]
                assert np.array_equal(sent, got), (rank, s.layer_id, s.kind)
        last = stage_memory(d, 1)
        for i, a in enumerate(last.layout.aux):
            sent = last.region(len(last.layout.kv) + len(last.layout.state) + i)
            got = dec.region(k + len(dec.layout.state) + i)
            assert np.array_equal(
                sent[2 * a.item_len :][: a.item_len], got[a.item_len :][: a.item_len]
            )
