"""`GET /v1/handoffs` as a router pages through it across a crash: real `kvhandoff serve`
processes, Mooncake over TCP on 127.0.0.1, the decode service's SQLite file on disk. The decode
service is SIGKILLed between two pages and restarted on the same state directory; the router's
cursor goes on where it was, and every handoff of the earlier life is listed once, as
`GET /v1/handoffs/{id}` answers for it."""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Iterator

import aiohttp
import msgspec
import pytest

from kvhandoff.pipelines.decode.views import HandoffPage, HandoffView
from kvhandoff.service.client import KVHandoffClient
from kvhandoff.service.config import HandoffConfig
from kvhandoff.service.testing.deployment import LocalDeployment
from tests.integration.handoff_checks import (
    Moved,
    complete,
    create,
    fill_sources,
    reset_decode,
)

pytestmark = pytest.mark.integration

MODEL = {"scale": 64, "page_size": 16, "num_layers": 8}
_page = msgspec.json.Decoder(HandoffPage)


@pytest.fixture(scope="module")
def dep() -> Iterator[LocalDeployment]:
    with LocalDeployment(
        preset="hybrid-npu-mla",
        model=MODEL,
        pp_size=2,
        num_pages=64,
        num_slots=8,
        handoff=HandoffConfig(default_deadline_s=20.0),
    ) as d:
        fill_sources(d, seed=5)
        reset_decode(d)
        yield d


async def page(
    http: aiohttp.ClientSession, dep: LocalDeployment, limit: int, cursor: int | None = None
) -> HandoffPage:
    params = (
        {"limit": str(limit)} if cursor is None else {"limit": str(limit), "cursor": str(cursor)}
    )
    async with http.get(f"{dep.decode_url}/v1/handoffs", params=params) as resp:
        assert resp.status == 200, await resp.text()
        return _page.decode(await resp.read())


async def test_a_router_pages_through_the_list_across_a_crash(
    dep: LocalDeployment, http: aiohttp.ClientSession
) -> None:
    kv = KVHandoffClient(dep.decode_url, session=http)
    before = [f"before-{i}" for i in range(5)]
    for i, hid in enumerate(before):
        await complete(http, dep, hid, Moved([2 * i, 2 * i + 1], [2 * i, 2 * i + 1], 0, 0))
        assert (await kv.wait(hid)).state.value == "completed"
    assert (await create(http, dep, "in-flight", Moved([9], [30], 1, 1)))[0] == 201
    first = await page(http, dep, 2)
    assert [v.id for v in first.items] == before[:2] and first.next_cursor is not None

    await asyncio.to_thread(dep.kill, "decode", signal.SIGKILL)
    await asyncio.to_thread(dep.restart, "decode")

    await complete(http, dep, "after", Moved([1], [40], 2, 2))
    assert (await kv.wait("after")).state.value == "completed"
    # The router's cursor from before the crash: the rest of the earlier life, then this one's.
    rest: list[HandoffView] = []
    cursor = first.next_cursor
    while cursor is not None:
        got = await page(http, dep, 2, cursor)
        assert 0 < len(got.items) <= 2
        rest += got.items
        cursor = got.next_cursor
    assert [v.id for v in rest] == [*before[2:], "in-flight", "after"]
    everything = [v async for v in kv.list(page_size=3)]
    assert [v.id for v in everything] == [*before, "in-flight", "after"]
    for item in everything:  # each as the single GET answers it, less the timeline
        assert item == msgspec.structs.replace(await kv.get(item.id), timeline=[])
    lost = everything[len(before)]
    assert lost.state.value == "failed" and lost.error is not None
    assert lost.error.code == "service_restarted"
    failed = [v.id async for v in kv.list("failed")]
    assert failed == ["in-flight"]
