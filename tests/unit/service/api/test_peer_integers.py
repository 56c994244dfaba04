"""No peer route answers 500 to an integer (issue 31): every integer field of the landed routes'
messages, set to values numpy's int64 and SQLite cannot hold (and negative ones), is refused by
name (422 naming the field) while the batch's other notices are still answered."""

from __future__ import annotations

import random
from typing import Any

import aiohttp

from kvhandoff.pipelines.layout import MAX_WIRE_INT
from kvhandoff.pipelines.messages import PEER_PROTOCOL_VERSION
from kvhandoff.service.serve import serve
from tests.unit.service.handoff_fixtures import decode_config, extensions

#: The values at the edges, then a seeded spread of huge ones of both signs.
_rng = random.Random(31)
HOSTILE = [MAX_WIRE_INT + 1, 2**64 - 1, 2**64, 10**30, -1, -(2**63) - 1] + [
    _rng.choice((1, -1)) * _rng.randrange(2**63, 2**200) for _ in range(6)
]

SEGMENT: dict[str, Any] = {
    "version": PEER_PROTOCOL_VERSION,
    "handoff_id": "h",
    "sender_url": "http://127.0.0.1:9",
    "sender_incarnation": "p",
    "decode_incarnation": "d",
    "pp_rank": 0,
    "grant_id": 1,
    "rows": [0],
    "starts": [0],
    "ends": [1],
    "bytes": 4096,
    "blocks": 1,
    "digest": "00",
}
ARRIVAL = {
    k: SEGMENT[k]
    for k in (
        "version",
        "handoff_id",
        "sender_url",
        "sender_incarnation",
        "decode_incarnation",
        "pp_rank",
        "bytes",
        "blocks",
    )
}
WINDOW = {k: SEGMENT[k] for k in ARRIVAL if k != "blocks"}
#: Batch routes: each message's integer fields (a list field is set at its index 0).
BATCHES = {
    "/v1/peer/segments": (SEGMENT, ["version", "pp_rank", "grant_id", "bytes", "blocks"]),
    "/v1/peer/arrivals": (ARRIVAL, ["version", "pp_rank", "bytes", "blocks"]),
}
LISTS = ["rows", "starts", "ends"]


def _with(msg: dict[str, Any], field: str, value: int) -> tuple[dict[str, Any], str]:
    if field in LISTS:
        return {**msg, field: [value]}, f"{field}[0]"
    return {**msg, field: value}, field


async def test_every_integer_field_of_the_landed_routes_is_refused_by_name_never_500() -> None:
    async with serve(decode_config(), extensions) as server, aiohttp.ClientSession() as http:
        for path, (msg, fields) in BATCHES.items():
            for field in fields + (LISTS if path.endswith("segments") else []):
                for value in HOSTILE:
                    bad, name = _with(msg, field, value)
                    async with http.post(server.url + path, json=[bad, msg]) as resp:
                        assert resp.status == 200, (path, field, value, await resp.text())
                        first, second = await resp.json()
                    assert first["status"] == 422, (path, field, value, first)
                    assert first["problem"]["field"] == name, (path, field, first)
                    # The batch's other notice is answered on its own (no such handoff here).
                    assert second["status"] == 404, (path, field, second)
        for field in ["version", "pp_rank", "bytes"]:
            for value in HOSTILE:
                bad, name = _with(WINDOW, field, value)
                async with http.post(server.url + "/v1/peer/windows", json=bad) as resp:
                    body = await resp.json()
                    assert resp.status == 422, (field, value, body)
                    assert body["field"] == name
