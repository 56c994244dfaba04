"""A decode service and its prefill service(s) in this process, over the local transport.

`open_deployment()` starts one decode app and one or more prefill apps with `serve()` (port 0,
`transport.backend = "local"`, torch:cpu pools), so a handoff crosses real HTTP and real memory.
The helpers drive the HTTP API (`Deployment.create/ready/get/request`), fill and snapshot the
pools (`fill_sources`, `fill_decode`, `snapshot`), compute what the decode pool must hold after
some moves (`expected_decode`) and await events on a service's bus (`watch`) where a test must
know that something happened instead of sleeping.
"""

from __future__ import annotations

import asyncio
import atexit
import shutil
import tempfile
from collections.abc import AsyncIterator, Collection, Mapping, Sequence
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import numpy as np
import numpy.typing as npt

from kvhandoff.pipelines.events import Event, Subscription, event_tag
from kvhandoff.pipelines.memory import PoolMemory
from kvhandoff.service.config import Config
from kvhandoff.service.runtime.roles import DECODE, RUNTIME
from kvhandoff.service.serve import Server, install_service, serve
from tests.fakes import local_config

U8 = npt.NDArray[np.uint8]

#: Full attention on layers 3 and 7 (groups c_kv, k_rope); linear layers 0-2 and 4-6 (conv,
#: temporal state). PP = 2 puts layers 0-3 on stage 0 and 4-7 on stage 1.
MODEL: dict[str, Any] = {"preset": "hybrid-npu-mla", "num_layers": 8, "scale": 64, "page_size": 4}
PP_SIZE = 2
DECODE_PAGES, DECODE_SLOTS = 64, 16
PREFILL_PAGES, PREFILL_SLOTS = 32, 8
#: Every decode byte before a test moves anything, so a stray write shows.
SENTINEL = 0xEE
#: Longest any single wait in these tests may take before the test fails instead of hanging:
#: far beyond what any step takes, even on a busy machine (it bounds failures, not successes).
WAIT_S = 30.0

extensions = [install_service]


def make_config(
    role: str,
    stages: list[dict[str, Any]],
    *,
    model: dict[str, Any] | None = None,
    settings: Mapping[str, Any] | None = None,
) -> Config:
    """A config on a free port over the local transport, with a fresh state directory (records
    and outbox); `settings` maps dotted keys to values, e.g. `{"handoff.max_concurrent": 2}`."""
    state_dir = tempfile.mkdtemp(prefix="kvh-state-")
    atexit.register(shutil.rmtree, state_dir, ignore_errors=True)
    return local_config(role, stages, state_dir, model=model or MODEL, **(settings or {}))


def decode_config(settings: Mapping[str, Any] | None = None) -> Config:
    stages = [{"num_pages": DECODE_PAGES, "num_slots": DECODE_SLOTS}]
    return make_config("decode", stages, settings=settings)


def prefill_config(
    ranks: Sequence[int],
    *,
    model: dict[str, Any] | None = None,
    settings: Mapping[str, Any] | None = None,
) -> Config:
    stages = [
        {"pp_rank": r, "pp_size": PP_SIZE, "num_pages": PREFILL_PAGES, "num_slots": PREFILL_SLOTS}
        for r in ranks
    ]
    return make_config("prefill", stages, model=model, settings=settings)


# ---------------------------------------------------------------------------------------------
# HTTP


@dataclass(frozen=True)
class Reply:
    status: int
    body: Any
    content_type: str


def assert_problem(reply: Reply, status: int, code: str | None = None, **members: Any) -> None:
    """`reply` is an RFC 9457 problem with this status (and code, and extension members)."""
    assert reply.status == status, reply.body
    assert reply.content_type == "application/problem+json", reply.content_type
    assert reply.body["status"] == status
    if code is not None:
        assert reply.body["code"] == code, reply.body
    for key, value in members.items():
        assert reply.body.get(key) == value, (key, reply.body)


@dataclass
class Deployment:
    """One decode service and the prefill services hosting every PP stage between them."""

    http: aiohttp.ClientSession
    decode: Server
    prefills: list[Server]
    _stops: list[AsyncExitStack] = field(default_factory=list)

    @property
    def prefill_urls(self) -> list[str]:
        return [p.url for p in self.prefills]

    def host_of(self, rank: int) -> Server:
        for server in self.prefills:
            if any(h.layout.pp_rank == rank for h in server.app[RUNTIME].hosted):
                return server
        raise LookupError(f"no prefill service hosts stage {rank}")

    async def stop_prefill(self, index: int) -> None:
        """Stop one prefill service now (its cleanup contexts run, its port closes)."""
        await self._stops[index].aclose()

    def pass_deadline(self, handoff_id: str) -> float:
        """Run the decode's deadline timer of `handoff_id` now, as the loop would once its
        deadline passed; return how long it still had to run. A test that needs the deadline
        to come after some step sets a deadline that no loaded machine reaches and moves it."""
        pipeline = self.decode.app[DECODE].pipeline
        assert pipeline is not None
        timer = pipeline._handoffs[handoff_id].timer
        assert timer is not None and not timer.cancelled(), "no pending deadline timer"
        expire, args = timer._callback, timer._args  # type: ignore[attr-defined]
        timer.cancel()
        expire(*args)
        return timer.when() - asyncio.get_running_loop().time()

    async def request(
        self, method: str, url: str, *, json: Any = None, data: bytes | None = None
    ) -> Reply:
        headers = {"Content-Type": "application/json"} if data is not None else None
        async with self.http.request(method, url, json=json, data=data, headers=headers) as resp:
            body = await resp.json(content_type=None) if resp.content_length != 0 else None
            return Reply(resp.status, body, resp.content_type)

    async def create(
        self, handoff_id: str, dst_pages: list[int], dst_slot: int | None = 0, **extra: Any
    ) -> Reply:
        body = {
            "id": handoff_id,
            "prefill": self.prefill_urls,
            "dst_pages": dst_pages,
            "dst_slot": dst_slot,
            **extra,
        }
        return await self.request("POST", f"{self.decode.url}/v1/handoffs", json=body)

    async def ready(
        self,
        handoff_id: str,
        rank: int,
        src_pages: list[int] | None = None,
        src_slot: int | None = None,
        layers: list[int] | None = None,
    ) -> Reply:
        body = {"src_pages": src_pages, "src_slot": src_slot, "layers": layers}
        url = f"{self.host_of(rank).url}/v1/handoffs/{handoff_id}/stages/{rank}/ready"
        return await self.request(
            "POST", url, json={k: v for k, v in body.items() if v is not None}
        )

    async def get(self, handoff_id: str, wait_s: float | None = None) -> Reply:
        query = "" if wait_s is None else f"?wait_s={wait_s}"
        return await self.request("GET", f"{self.decode.url}/v1/handoffs/{handoff_id}{query}")

    async def finish(self, handoff_id: str) -> dict[str, Any]:
        """The handoff's view once terminal (long poll); fails the test if it is not by then."""
        reply = await self.get(handoff_id, wait_s=WAIT_S)
        assert reply.status == 200, reply.body
        view: dict[str, Any] = reply.body
        assert view["state"] in ("completed", "failed", "aborted"), view
        return view


@asynccontextmanager
async def open_deployment(
    *,
    split: bool = False,
    decode: Config | None = None,
    prefill: Sequence[Config] | None = None,
    token: str | None = None,
) -> AsyncIterator[Deployment]:
    """Prefill service(s) first (both stages in one, or one each with `split`), then decode.

    With `token`, every service requires it and the test's client session sends it.
    """
    auth = {} if token is None else {"server.token": token}
    if prefill is None:
        groups = [[r] for r in range(PP_SIZE)] if split else [list(range(PP_SIZE))]
        prefill = [prefill_config(ranks, settings=auth) for ranks in groups]
    headers = {} if token is None else {"Authorization": f"Bearer {token}"}
    async with AsyncExitStack() as stack:
        stops, servers = [], []
        for config in prefill:
            stop = await stack.enter_async_context(AsyncExitStack())
            servers.append(await stop.enter_async_context(serve(config, extensions)))
            stops.append(stop)
        dec = await stack.enter_async_context(serve(decode or decode_config(auth), extensions))
        http = await stack.enter_async_context(aiohttp.ClientSession(headers=headers))
        yield Deployment(http, dec, servers, stops)


# ---------------------------------------------------------------------------------------------
# Memory


def memories(server: Server) -> dict[int, PoolMemory]:
    """The pools of a service by pp_rank (the decode service's one stage is rank 0)."""
    return {h.layout.pp_rank: h.memory for h in server.app[RUNTIME].hosted}


def decode_memory(d: Deployment) -> PoolMemory:
    return memories(d.decode)[0]


def stage_memory(d: Deployment, rank: int) -> PoolMemory:
    return memories(d.host_of(rank))[rank]


def num_regions(memory: PoolMemory) -> int:
    return len(memory.layout.region_sizes)


def snapshot(memory: PoolMemory) -> list[U8]:
    return [memory.region(i).copy() for i in range(num_regions(memory))]


def fill_sources(d: Deployment) -> None:
    """Random bytes (never the sentinel) in every prefill region, distinct per stage and entry."""
    for rank in range(PP_SIZE):
        memory = stage_memory(d, rank)
        for i in range(num_regions(memory)):
            view = memory.region(i)
            rng = np.random.default_rng(1000 * rank + i)
            view[:] = rng.integers(0, SENTINEL, view.shape[0], dtype=np.uint8)


def fill_decode(d: Deployment) -> list[U8]:
    memory = decode_memory(d)
    for i in range(num_regions(memory)):
        memory.region(i)[:] = SENTINEL
    return snapshot(memory)


@dataclass(frozen=True)
class Move:
    """One handoff's pages and slots; `layers` limits it to those layers (None: all)."""

    src_pages: list[int]
    dst_pages: list[int]
    src_slot: int
    dst_slot: int
    layers: Collection[int] | None = None


def expected_decode(d: Deployment, before: list[U8], *moves: Move) -> list[U8]:
    """The decode regions `before`, with each move's source rows copied into its destination
    rows of the entry of the same layer and group (KV) or kind (state)."""
    dec = decode_memory(d).layout
    kv_at = {(e.layer_id, e.group): j for j, e in enumerate(dec.kv)}
    state_at = {(s.layer_id, s.kind): len(dec.kv) + j for j, s in enumerate(dec.state)}
    out = [region.copy() for region in before]
    for move in moves:
        for rank in range(PP_SIZE):
            memory = stage_memory(d, rank)
            src = memory.layout
            for i, e in enumerate(src.kv):
                if move.layers is None or e.layer_id in move.layers:
                    rows = memory.region(i)[: e.nbytes].reshape(-1, e.item_len)
                    j = kv_at[e.layer_id, e.group]
                    dst = out[j][: dec.kv[j].nbytes].reshape(-1, e.item_len)
                    dst[move.dst_pages] = rows[move.src_pages]
            for i, s in enumerate(src.state):
                if move.layers is None or s.layer_id in move.layers:
                    n = s.item_len
                    region = memory.region(len(src.kv) + i)
                    dst_region = out[state_at[s.layer_id, s.kind]]
                    a, b = move.dst_slot * n, move.src_slot * n
                    dst_region[a : a + n] = region[b : b + n]
    return out


def assert_decode_is(d: Deployment, expected: list[U8]) -> None:
    """Every decode region equals `expected` byte for byte; a mismatch names the entry."""
    memory = decode_memory(d)
    layout = memory.layout
    names = (
        [f"kv layer {e.layer_id} group {e.group}" for e in layout.kv]
        + [f"state layer {s.layer_id} kind {s.kind}" for s in layout.state]
        + [f"aux entry {i}" for i in range(len(layout.aux))]
    )
    for i, name in enumerate(names):
        landed, want = memory.region(i), expected[i]
        if not np.array_equal(landed, want):
            first = int(np.flatnonzero(landed != want)[0])
            raise AssertionError(f"decode {name}: first differing byte at offset {first}")


def stage_bytes(d: Deployment, rank: int, num_pages: int) -> int:
    """Bytes stage `rank` moves for a request of `num_pages` pages and one state slot."""
    layout = stage_memory(d, rank).layout
    return num_pages * sum(e.item_len for e in layout.kv) + sum(s.item_len for s in layout.state)


# ---------------------------------------------------------------------------------------------
# Events


class Watch:
    """Events a service published since the watch began, awaited by tag and field values."""

    def __init__(self, sub: Subscription) -> None:
        self._sub = sub

    async def next(self, tag: str, handoff_id: str, **fields: Any) -> Event:
        async with asyncio.timeout(WAIT_S):
            while True:
                event = await self._sub.queue.get()
                if (
                    event_tag(event) == tag
                    and event.handoff_id == handoff_id
                    and all(getattr(event, k) == v for k, v in fields.items())
                ):
                    return event


@asynccontextmanager
async def watch(server: Server) -> AsyncIterator[Watch]:
    sub = server.app[RUNTIME].bus.subscribe()
    try:
        yield Watch(sub)
    finally:
        sub.close()
