"""What routers read after a decode restart (issue 18 C), against real `kvhandoff serve`
processes with Mooncake over TCP on 127.0.0.1 and the decode's SQLite file on disk: the decode
is SIGKILLed with one handoff finished and one in flight, restarted on the same state
directory, and readers resume with the last id they saw.

Event ids name one event across lives, so a resumed reader gets a `stream.gap` that says the
service restarted and then only this life's events — never an earlier life's frame in place of
a new one, never another type than it filtered for. A stored timeline runs to
`handoff.released`, and the record of the handoff the crash failed keeps its stages and bytes.
"""

from __future__ import annotations

import asyncio
import json
import signal
import time
from collections.abc import Callable, Iterator
from typing import Any

import aiohttp
import httpx
import pytest
from httpx_sse import ServerSentEvent, aconnect_sse

from kvhandoff.service.config import HandoffConfig
from kvhandoff.service.testing.deployment import LocalDeployment
from tests.integration.handoff_checks import (
    Moved,
    complete,
    create,
    fill_sources,
    ready,
    reset_decode,
)

pytestmark = pytest.mark.integration

MODEL = {"scale": 64, "page_size": 16, "num_layers": 8}
WAIT_S = 20.0


@pytest.fixture(scope="module")
def dep() -> Iterator[LocalDeployment]:
    with LocalDeployment(
        preset="hybrid-npu-mla",
        model=MODEL,
        pp_size=2,
        num_pages=64,
        num_slots=8,
        handoff=HandoffConfig(default_deadline_s=20.0, sse_keepalive_s=0.05),
    ) as d:
        fill_sources(d, seed=7)
        reset_decode(d)
        yield d


class Reader:
    """One SSE connection read in the background, as a router reads it (httpx-sse)."""

    def __init__(self, url: str, headers: dict[str, str] | None = None) -> None:
        self.url = url
        self.headers = headers or {}
        self.frames: list[ServerSentEvent] = []
        self.ended = asyncio.Event()
        self.opened = asyncio.Event()
        self._task = asyncio.create_task(self._read())

    async def _read(self) -> None:
        async with (
            httpx.AsyncClient(timeout=httpx.Timeout(WAIT_S, read=None)) as http,
            aconnect_sse(http, "GET", self.url, headers=self.headers) as source,
        ):
            self.opened.set()
            async for sse in source.aiter_sse():
                self.frames.append(sse)
        self.ended.set()

    async def until(self, done: Callable[[list[ServerSentEvent]], bool]) -> None:
        async with asyncio.timeout(WAIT_S):
            while not done(self.frames):
                if self._task.done():
                    self._task.result()  # raises what ended it
                    assert done(self.frames), [f.event for f in self.frames]
                await asyncio.sleep(0.01)

    async def close(self) -> None:
        self._task.cancel()
        await asyncio.gather(self._task, return_exceptions=True)


def seen(handoff_id: str, tag: str) -> Callable[[list[ServerSentEvent]], bool]:
    return lambda frames: any(
        f.event == tag and json.loads(f.data).get("handoff_id") == handoff_id for f in frames
    )


async def view_of(http: aiohttp.ClientSession, dep: LocalDeployment, hid: str) -> dict[str, Any]:
    async with http.get(f"{dep.decode_url}/v1/handoffs/{hid}") as resp:
        assert resp.status == 200, await resp.text()
        body: dict[str, Any] = await resp.json()
        return body


async def test_readers_resuming_after_a_crash_get_only_this_lifes_events(
    dep: LocalDeployment, http: aiohttp.ClientSession
) -> None:
    events = f"{dep.decode_url}/v1/events"
    before = Reader(events)
    await asyncio.wait_for(before.opened.wait(), WAIT_S)
    await complete(http, dep, "old-done", Moved([2, 3], [2, 3], 0, 0))
    live = Moved([9], [30], 1, 1)
    assert (await create(http, dep, "old-live", live))[0] == 201
    assert (await ready(http, dep, "old-live", 0, live))[0] == 202  # stage 1 never is
    await before.until(seen("old-done", "handoff.released"))
    await before.until(seen("old-live", "stage.arrived"))
    await before.close()
    old = {int(f.id): (f.event, f.data) for f in before.frames}
    last_id = max(old)

    await asyncio.to_thread(dep.kill, "decode", signal.SIGKILL)
    restarted_at = time.time()
    await asyncio.to_thread(dep.restart, "decode")

    resumed = Reader(events, {"Last-Event-ID": str(last_id)})
    filtered = Reader(f"{events}?types=handoff.", {"Last-Event-ID": str(last_id)})
    for reader in (resumed, filtered):
        await asyncio.wait_for(reader.opened.wait(), WAIT_S)
    await complete(http, dep, "new", Moved([4], [40], 2, 2))
    for reader in (resumed, filtered):
        await reader.until(seen("new", "handoff.released"))
        await reader.close()
        gap, *rest = reader.frames
        assert gap.event == "stream.gap", gap
        assert gap.json()["reason"] == "restarted" and gap.json()["resumed_from"] == last_id
        # The filtered reader may be told its position (this life's ids too): not an event.
        positions = [f for f in rest if f.event == "stream.position"]
        assert all(int(f.id) > last_id and int(f.id) not in old for f in positions)
        assert reader is filtered or not positions, positions
        rest = [f for f in rest if f not in positions]
        for f in rest:
            data = f.json()
            assert int(f.id) > last_id and int(f.id) not in old, (f.id, f.event)
            assert data["seq"] == int(f.id) and f.event == data["type"]
            assert data["at"] >= restarted_at, f  # this life's, not an old one's replayed
            assert data["handoff_id"] in ("old-live", "new"), f
        tags = [f.event for f in rest]
        assert "handoff.failed" in tags  # old-live, failed by the restart
        if reader is filtered:
            assert all(t.startswith("handoff.") for t in tags), tags
        else:
            assert "stage.arrived" in tags  # new's own

    # A stored timeline runs to `handoff.released`, in GET and in the handoff's stream.
    done = await view_of(http, dep, "old-done")
    assert done["released"] and done["timeline"][-1]["type"] == "handoff.released", done
    own = Reader(f"{dep.decode_url}/v1/handoffs/old-done/events")
    await asyncio.wait_for(own.ended.wait(), WAIT_S)
    assert [f.event for f in own.frames][-2:] == ["handoff.completed", "handoff.released"]
    assert [f.json()["handoff_id"] for f in own.frames] == ["old-done"] * len(own.frames)

    # The handoff the crash failed keeps the stages and bytes it had.
    lost = await view_of(http, dep, "old-live")
    assert lost["state"] == "failed" and lost["error"]["code"] == "service_restarted"
    stages = {s["pp_rank"]: s for s in lost["stages"]}
    assert stages[0]["state"] == "arrived" and stages[0]["bytes"] > 0, lost
    assert stages[1]["state"] == "failed" and stages[1]["bytes"] == 0, lost
    assert lost["bytes"] == stages[0]["bytes"]
    # Its own stream serves its own record (its outcome; its release comes once the fence of
    # its earlier life's writers lifts), never another handoff's frame of the same number.
    own = Reader(f"{dep.decode_url}/v1/handoffs/old-live/events")
    await own.until(lambda frames: len(frames) >= 1)
    await own.close()
    first = own.frames[0].json()
    assert (own.frames[0].event, first["code"]) == ("handoff.failed", "service_restarted")
    assert {f.json()["handoff_id"] for f in own.frames} == {"old-live"}
