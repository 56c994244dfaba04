import msgspec

from kvhandoff.pipelines.models import decode_layout, hybrid_npu_mla, partition_layers, stage_layout
from kvhandoff.service.api.validate import install_validate
from tests.unit.service.conftest import ClientFactory

MODEL = hybrid_npu_mla(num_layers=16, scale=64, page_size=16)
PART = partition_layers(16, 4)
JSON = {"Content-Type": "application/json"}


def body(corrupt: bool = False) -> bytes:
    stages = [stage_layout(MODEL, PART, r, num_pages=8, num_slots=2) for r in range(4)]
    if corrupt:
        s = stages[2]
        stages[2] = msgspec.structs.replace(
            s, state=(msgspec.structs.replace(s.state[0], item_len=3), *s.state[1:])
        )
    dec = decode_layout(MODEL, num_pages=8, num_slots=2)
    return msgspec.json.encode({"prefill": stages, "decode": dec})


async def test_validate_reports_ok_and_per_stage_numbers(make_client: ClientFactory) -> None:
    client = await make_client(extensions=[install_validate])
    resp = await client.post("/v1/validate", data=body(), headers=JSON)
    assert resp.status == 200
    report = await resp.json()
    assert report["ok"] is True
    assert [s["kv_pairs"] for s in report["stages"]] == [2, 2, 2, 2]


async def test_validate_names_the_layer_and_kind(make_client: ClientFactory) -> None:
    client = await make_client(extensions=[install_validate])
    report = await (await client.post("/v1/validate", data=body(corrupt=True), headers=JSON)).json()
    assert report["ok"] is False
    problem = report["problems"][0]
    assert (problem["code"], problem["pp_rank"], problem["layer_id"], problem["kind"]) == (
        "slot_size_mismatch",
        2,
        8,
        "conv",
    )


async def test_validate_rejects_a_malformed_layout_with_its_path(
    make_client: ClientFactory,
) -> None:
    client = await make_client(extensions=[install_validate])
    resp = await client.post("/v1/validate", json={"prefill": [{"pp_rank": 0}], "decode": {}})
    assert resp.status == 422
    assert resp.content_type == "application/problem+json"
    assert (await resp.json())["field"].startswith("prefill[0]")


async def test_validate_needs_each_side_once(make_client: ClientFactory) -> None:
    client = await make_client(extensions=[install_validate])
    dec = msgspec.to_builtins(decode_layout(MODEL, num_pages=8, num_slots=2))
    for sent, field in (
        ({"decode": dec}, "prefill"),  # no prefill side at all
        ({"prefill": [dec], "prefill_urls": ["http://x:1"], "decode": dec}, "prefill"),
        ({"prefill": [dec], "decode": dec, "decode_url": "http://x:1"}, "decode"),
        ({"prefill": [dec]}, "decode"),  # not a decode service: no default decode side
        ({"prefill_urls": ["ftp://x"], "decode": dec}, "prefill_urls[0]"),
    ):
        resp = await client.post("/v1/validate", json=sent)
        assert resp.status == 422, sent
        assert (await resp.json())["field"] == field, sent
