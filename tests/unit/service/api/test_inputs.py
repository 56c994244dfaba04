"""Bad input from routers and engines (issue 10 §3): every item is a 4xx problem naming what is
wrong, and the decode pool is unchanged byte for byte afterwards."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import pytest

from kvhandoff.pipelines.decode.views import HANDOFF_ID_PATTERN
from kvhandoff.service.api.validate import MAX_PREFILL
from kvhandoff.service.http.app import MAX_JSON_DEPTH, PEERS, json_depth
from kvhandoff.service.runtime import inputs
from tests.unit.service.handoff_fixtures import (
    Deployment,
    Move,
    Reply,
    assert_decode_is,
    assert_problem,
    expected_decode,
    fill_decode,
    fill_sources,
    make_config,
    open_deployment,
)

JSON = {"Content-Type": "application/json"}


@pytest.fixture
async def d() -> AsyncIterator[Deployment]:
    async with open_deployment() as deployment:
        fill_sources(deployment)
        fill_decode(deployment)
        yield deployment


async def post(d: Deployment, url: str, raw: bytes, headers: dict[str, str] = JSON) -> Reply:
    async with d.http.post(url, data=raw, headers=headers) as resp:
        return Reply(resp.status, await resp.json(content_type=None), resp.content_type)


def nested(depth: int) -> str:
    return "[" * depth + "]" * depth


@pytest.mark.parametrize("where", ["metadata", "stage_ready"])
async def test_deeply_nested_json_is_a_400_problem(d: Deployment, where: str) -> None:
    before = fill_decode(d)
    if where == "metadata":
        url = f"{d.decode.url}/v1/handoffs"
        raw = f'{{"id": "n", "dst_pages": [1], "metadata": {{"x": {nested(1000)}}}}}'
    else:
        url = f"{d.prefill_urls[0]}/v1/handoffs/n/stages/0/ready"
        raw = f'{{"src_pages": [1], "layers": {nested(5000)}}}'
    reply = await post(d, url, raw.encode())
    assert_problem(reply, 400, "malformed_body", field="$")
    assert "levels deep" in reply.body["detail"]
    assert_decode_is(d, before)


async def test_depth_scan_ignores_brackets_in_strings() -> None:
    text = '{"a": "' + "[" * 500 + '\\"[[["}'
    assert json_depth(text.encode()) == 1  # only the object's own brace counts
    deep = ('["[[[\\\\", ' * 40 + "1" + "]" * 40).encode()
    assert json_depth(deep) == 40 <= MAX_JSON_DEPTH
    assert json_depth(nested(65).encode()) == 65


@pytest.mark.parametrize(
    "rank", ["\u00b2", "\u2460", "\uff10", "\u0663", "1 ", "-1", "0x1", "1" * 10]
)
async def test_pp_rank_takes_ascii_digits_only(d: Deployment, rank: str) -> None:
    url = f"{d.prefill_urls[0]}/v1/handoffs/r/stages/{rank}/ready"
    reply = await post(d, url, b'{"src_pages": [1]}')
    assert_problem(reply, 422, "invalid_input", field="pp_rank")


async def test_non_ascii_authorization_is_401_on_every_route() -> None:
    async with open_deployment(token="t") as d:
        url = f"{d.decode.url}/v1/handoffs"
        bad = {
            "Authorization": "Bearer \udcff\udcfe".encode("utf-8", "surrogateescape").decode(
                "latin-1"
            )
        }
        for method, target in (("GET", url), ("GET", f"{d.prefill_urls[0]}/v1/layout")):
            async with d.http.request(method, target, headers=bad) as resp:
                assert resp.status == 401, await resp.text()
                assert resp.content_type == "application/problem+json"


async def test_bearer_scheme_is_case_insensitive() -> None:
    async with open_deployment(token="t") as d:
        for scheme in ("bearer", "BEARER", "Bearer", "bEaReR"):
            headers = {"Authorization": f"{scheme} t"}
            async with d.http.get(f"{d.decode.url}/v1/handoffs", headers=headers) as resp:
                assert resp.status == 200, scheme


@pytest.mark.parametrize(
    "url",
    ["http://", "http://[::1", "http://127.0.0.1:99999", "http://a b:1", "http://h:0", "ftp://h"],
)
async def test_malformed_peer_urls_are_422_naming_the_field(d: Deployment, url: str) -> None:
    before = fill_decode(d)
    body = f'{{"id": "u", "prefill": ["{d.prefill_urls[0]}", "{url}"], "dst_pages": [1]}}'
    reply = await post(d, f"{d.decode.url}/v1/handoffs", body.encode())
    assert reply.status == 422, reply.body
    assert reply.body["field"] in ("prefill[1]",), reply.body
    for field, key in (("prefill_urls[0]", "prefill_urls"), ("decode_url", "decode_url")):
        value: Any = [url] if key == "prefill_urls" else url
        other = {"prefill_urls": [d.prefill_urls[0]]} if key == "decode_url" else {}
        raw = json.dumps({key: value, **other}).encode()
        reply = await post(d, f"{d.decode.url}/v1/validate", raw)
        assert reply.status == 422, reply.body
        assert reply.body["field"] == field, reply.body
    assert_decode_is(d, before)


async def test_validate_fetches_a_repeated_url_once_and_caps_the_list(d: Deployment) -> None:
    fetched = []
    client = d.decode.app[PEERS]
    original = client.get

    async def counting(url: str, path: str, *args: Any, **kwargs: Any) -> Any:
        fetched.append(url)
        return await original(url, path, *args, **kwargs)

    client.get = counting  # type: ignore[method-assign]
    try:
        raw = json.dumps({"prefill_urls": [d.prefill_urls[0]] * 30_000}).encode()
        reply = await post(d, f"{d.decode.url}/v1/validate", raw)
        assert reply.status == 200, reply.body
        assert reply.body["ok"] is True
        assert fetched == [d.prefill_urls[0]]
        many = [f"http://127.0.0.1:{1000 + i}" for i in range(MAX_PREFILL + 1)]
        reply = await post(
            d, f"{d.decode.url}/v1/validate", json.dumps({"prefill_urls": many}).encode()
        )
        assert_problem(reply, 422, "invalid_input", field="prefill_urls")
        assert len(fetched) == 1  # refused before any fetch
    finally:
        client.get = original  # type: ignore[method-assign]


@pytest.mark.parametrize("value", [2**63, 2**64 - 1, 2**64, 10**30])
async def test_page_numbers_beyond_int64_are_named_as_sent(d: Deployment, value: int) -> None:
    before = fill_decode(d)
    raw = f'{{"id": "big", "dst_pages": [1, {value}], "dst_slot": 0}}'.encode()
    reply = await post(d, f"{d.decode.url}/v1/handoffs", raw)
    assert reply.status == 422, reply.body
    assert reply.body["field"] == "dst_pages[1]"
    assert str(value) in reply.body["detail"]
    url = f"{d.prefill_urls[0]}/v1/handoffs/big/stages/0/ready"
    reply = await post(d, url, f'{{"src_pages": [{value}]}}'.encode())
    assert reply.status == 422, reply.body
    assert reply.body["field"] == "src_pages[0]" and str(value) in reply.body["detail"]
    reply = await post(d, url, f'{{"src_pages": [1], "src_slot": {value}}}'.encode())
    assert reply.status == 422 and reply.body["field"] == "src_slot", reply.body
    assert_decode_is(d, before)


@pytest.mark.parametrize("hid", [".", ".."])
async def test_dot_ids_are_refused(d: Deployment, hid: str) -> None:
    raw = f'{{"id": "{hid}", "dst_pages": [1], "dst_slot": 0}}'.encode()
    reply = await post(d, f"{d.decode.url}/v1/handoffs", raw)
    assert_problem(reply, 422, "invalid_input", field="id")
    encoded = hid.replace(".", "%2E")  # a standard client would resolve the bare segment away
    url = f"{d.prefill_urls[0]}/v1/handoffs/{encoded}/stages/0/ready"
    async with d.http.post(url, data=b'{"src_pages": [1]}', headers=JSON) as resp:
        assert resp.status in (404, 422)  # never accepted as a handoff id


async def test_ids_of_dots_and_more_are_fine(d: Deployment) -> None:
    for i, hid in enumerate(("...", ".a", "a.", "a..b")):
        raw = json.dumps({"id": hid, "prefill": d.prefill_urls, "dst_pages": [i], "dst_slot": i})
        reply = await post(d, f"{d.decode.url}/v1/handoffs", raw.encode())
        assert reply.status == 201, (hid, reply.body)


async def test_repeated_stage_ready_with_another_slot_is_409(d: Deployment) -> None:
    url = f"{d.prefill_urls[0]}/v1/handoffs/slot/stages/0/ready"
    assert (await post(d, url, b'{"src_pages": [1, 2], "src_slot": 1}')).status == 202
    assert (await post(d, url, b'{"src_pages": [1, 2], "src_slot": 1}')).status == 202
    assert (await post(d, url, b'{"src_slot": 1}')).status == 202
    reply = await post(d, url, b'{"src_pages": [1, 2], "src_slot": 2}')
    assert_problem(reply, 409, "conflict", field="src_slot", pp_rank=0)


@pytest.mark.parametrize(
    "content_type", [None, "text/plain", "application/x-www-form-urlencoded", "multipart/form-data"]
)
async def test_v1_posts_need_application_json(d: Deployment, content_type: str | None) -> None:
    headers = {} if content_type is None else {"Content-Type": content_type}
    raw = json.dumps({"id": "ct", "prefill": d.prefill_urls, "dst_pages": [1], "dst_slot": 0})
    reply = await post(d, f"{d.decode.url}/v1/handoffs", raw.encode(), headers)
    assert_problem(reply, 415, "unsupported_media_type", field="Content-Type")
    ok = await post(
        d,
        f"{d.decode.url}/v1/handoffs",
        raw.encode(),
        {"Content-Type": "application/json; charset=utf-8"},
    )
    assert ok.status == 201, ok.body


async def test_page_number_helpers() -> None:
    inputs.pages([0, inputs.MAX_PAGE], "p")
    with pytest.raises(Exception, match=r"p\[1\] = 9223372036854775808"):
        inputs.pages([0, inputs.MAX_PAGE + 1], "p")
    assert inputs.ascii_int("012", "r") == 12
    assert inputs.peer_url("https://[::1]:8000/base", "u") == "https://[::1]:8000/base"


async def test_empty_page_lists_are_a_state_only_handoff(d: Deployment) -> None:
    before = fill_decode(d)
    move = Move([], [], 2, 5)
    assert (await d.create("state-only", [], 5)).status == 201
    for rank in (0, 1):
        assert (await d.ready("state-only", rank, [], 2)).status == 202
    view = await d.finish("state-only")
    assert view["state"] == "completed" and view["bytes"] > 0, view
    assert_decode_is(d, expected_decode(d, before, move))  # the slot, and nothing else


async def test_empty_pages_without_state_are_refused() -> None:
    dense = {"preset": "dense-mha", "num_layers": 4, "scale": 64, "page_size": 4}
    stages = [{"pp_rank": r, "pp_size": 2, "num_pages": 8} for r in range(2)]
    decode = make_config("decode", [{"num_pages": 8}], model=dense)
    prefill = make_config("prefill", stages, model=dense)
    async with open_deployment(decode=decode, prefill=[prefill]) as d:
        reply = await d.create("nothing", [], None)
        assert_problem(reply, 422, "invalid_input", field="dst_pages")
        assert (await d.create("something", [1], None)).status == 201


async def test_openapi_is_complete_enough_to_fuzz() -> None:
    async with open_deployment(token="t") as d:
        async with d.http.get(f"{d.decode.url}/openapi.json") as resp:
            decode = await resp.json()
        async with d.http.get(f"{d.prefill_urls[0]}/openapi.json") as resp:
            prefill = await resp.json()
    schemas = decode["components"]["schemas"]
    assert schemas["HandoffRequest"]["additionalProperties"] is False
    create = decode["paths"]["/v1/handoffs"]["post"]
    assert {"200", "201", "400", "401", "403", "409", "413", "415", "422", "429"} <= set(
        create["responses"]
    )
    assert create["security"] == [{"routerBearer": []}]
    listed = decode["paths"]["/v1/handoffs"]["get"]
    assert [p["name"] for p in listed["parameters"]] == ["state", "limit", "cursor"]
    one = decode["paths"]["/v1/handoffs/{id}"]["get"]
    id_schema = next(p for p in one["parameters"] if p["name"] == "id")["schema"]
    assert id_schema["pattern"] == HANDOFF_ID_PATTERN
    assert [p["name"] for p in one["parameters"] if p["in"] == "query"] == ["wait_s", "until"]
    arrivals = decode["paths"]["/v1/peer/arrivals"]["post"]
    assert arrivals["security"] == [{"peerSignature": []}]
    assert {"401", "403", "409"} <= set(arrivals["responses"])
    assert set(decode["components"]["securitySchemes"]) == {"routerBearer", "peerSignature"}
    ready_op = prefill["paths"]["/v1/handoffs/{id}/stages/{pp_rank}/ready"]["post"]
    assert ready_op["security"] == [{"engineBearer": []}]
    rank = next(p for p in ready_op["parameters"] if p["name"] == "pp_rank")["schema"]
    assert rank["pattern"] == "^[0-9]{1,9}$"
    assert prefill["components"]["schemas"]["StageReady"]["additionalProperties"] is False
