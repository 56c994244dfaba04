"""Land, verify, commit against real processes (issue 17's tests): decode + PP=2 prefill and a
spare stage-0 prefill, Mooncake TCP on 127.0.0.1, shm pools checked byte for byte.

The two reproductions of issue 17 run as schedules made deterministic by stopping processes
(SIGSTOP) at observed facts, never after a sleep:

- a prefill stage paused inside an engine call (the kernel holds only a few MiB of the call's
  bytes; the rest is still in the paused process) resumes after its handoff failed, was released
  and its pages were reused by a handoff that completed;
- the decode's receive path stalled beyond the transfer timeout: the prefill's call gave up
  (`transport_timeout`; its transport keeps the peer stuck and reports nothing while the
  writes may land), the decode failed the handoff at its deadline, and the rest of the batch
  is still to be sent when the pages have been reused.

Each runs against a landed decode (the late bytes land in a quarantined window: the reuse is
intact) and, unchanged, against a direct one (they land in the reused pages: the test asserts the
corruption), so each landed test is one that fails without landed mode. The late bytes are
accounted on the wire (`tests/integration/wire.py`): the check runs only once every byte of the
paused call is in the decode's memory.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import aiohttp
import numpy as np
import pytest

from kvhandoff.pipelines.prefill.staged import BLOCK_BYTES
from kvhandoff.service.config import HandoffConfig, TransferConfig
from kvhandoff.service.testing.deployment import LocalDeployment
from kvhandoff.transport.config import MooncakeConfig
from tests.integration.handoff_checks import (
    Moved,
    fill_sources,
    finished,
    landed,
    reset_decode,
    rows,
)
from tests.integration.wire import MOONCAKE_HEADER_BYTES, Wire, listening_ports, wire

pytestmark = pytest.mark.integration

MiB = 1 << 20
#: dense-mla, 8 layers over PP=2: stage 0 holds layers 0-3, stage 1 layers 4-8, each page of a
#: layer 73,728 bytes. Requests take 128 contiguous pages: a direct write of a layer is one 9 MiB
#: block, a landed segment of three layers 27 one-MiB blocks, far more than the few MiB a
#: connection's socket buffers hold, so a stopped writer keeps most of its call in its memory.
MODEL = {"num_layers": 8}
N = 128
ITEM = 73_728
FIRST = [0]  # signalled first: its commit shows the destination and the connections are up
REST = [1, 2, 3]  # stage 0's layers the paused call carries
PAUSED_BYTES = len(REST) * N * ITEM
OLD = Moved(src_pages=list(range(N)), dst_pages=list(range(N)), src_slot=None, dst_slot=None)
NEW = Moved(src_pages=list(range(N, 2 * N)), dst_pages=OLD.dst_pages, src_slot=None, dst_slot=None)
#: Writers confirm or are judged silent slowly: the failure is the one the test arranges, and a
#: decode stopped for seconds does not find its healthy prefills silent once it resumes.
HANDOFF = HandoffConfig(peer_timeout_s=60.0)
#: The prefill gives up on a call after 4 s (long enough that a paused call is stopped before
#: on a busy machine; a stalled one still times out), the engine itself after 5 s (its floor),
#: so a writer declares max_call_s = 0.5 + 5 + 64 MiB / 1 GB/s: direct mode's fence after the
#: deadline.
TRANSPORT = MooncakeConfig(transfer_timeout_s=4.0, max_bytes_per_batch=64 * MiB)
WAIT_S = 30.0
#: The stalled-receiver handoff's deadline: past the prefill's transfer timeout once its call
#: began, and early enough that the decode's own verdict (and, direct, the bound after it:
#: + max_call_s) comes within WAIT_S of the decode resuming.
STALL_DEADLINE_S = 15.0
#: A stage-failed report (request line, headers and its JSON body) is larger than this.
REPORT_MIN_BYTES = 256
#: What a stopped writer must still hold of its call for the test to be mid-transfer: dozens of
#: pages of each layer (a connection's socket buffers take up to a few MiB of a 9 MiB block).
LATE_MIN_BYTES = 2 * MiB


def _deployment(mode: str) -> LocalDeployment:
    return LocalDeployment(
        preset="dense-mla",
        model=MODEL,
        pp_size=2,
        spares=[[0]],
        num_pages=2 * N,
        decode_pages=N,
        num_slots=4,
        handoff=HANDOFF,
        transport=TRANSPORT,
        transfer=TransferConfig(
            mode=mode, landing_bytes=256 * MiB, window_bytes=64 * MiB, staging_bytes=64 * MiB
        ),
        ready_timeout_s=120,  # a busy machine starts torch slowly
    )


@pytest.fixture(scope="module")
def landed_dep() -> Iterator[LocalDeployment]:
    with _deployment("landed") as dep:
        yield dep


@pytest.fixture(scope="module")
def direct_dep() -> Iterator[LocalDeployment]:
    with _deployment("direct") as dep:
        yield dep


# --------------------------------------------------------------------------------------------
# Playing router and engines


async def post(http: aiohttp.ClientSession, url: str, body: Any) -> tuple[int, Any]:
    async with http.post(url, json=body) as resp:
        return resp.status, await resp.json(content_type=None)


async def create(
    http: aiohttp.ClientSession, dep: LocalDeployment, hid: str, prefill: list[str], **extra: Any
) -> None:
    body = {"id": hid, "prefill": prefill, "dst_pages": OLD.dst_pages, **extra}
    status, answer = await post(http, f"{dep.decode_url}/v1/handoffs", body)
    assert status == 201, answer


async def ready(
    http: aiohttp.ClientSession,
    url: str,
    hid: str,
    rank: int,
    m: Moved,
    layers: list[int] | None = None,
) -> None:
    body: dict[str, Any] = {"src_pages": m.src_pages}
    if layers is not None:
        body["layers"] = layers
    status, answer = await post(http, f"{url}/v1/handoffs/{hid}/stages/{rank}/ready", body)
    assert status == 202, answer


async def released(http: aiohttp.ClientSession, dep: LocalDeployment, hid: str) -> dict[str, Any]:
    url = f"{dep.decode_url}/v1/handoffs/{hid}?wait_s={WAIT_S}&until=released"
    async with http.get(url) as resp:
        view: dict[str, Any] = await resp.json()
    assert view["released"], view
    return view


async def abort(http: aiohttp.ClientSession, dep: LocalDeployment, hid: str) -> tuple[int, Any]:
    async with http.delete(f"{dep.decode_url}/v1/handoffs/{hid}") as resp:
        return resp.status, await resp.json(content_type=None)


async def reuse(http: aiohttp.ClientSession, dep: LocalDeployment, hid: str) -> None:
    """The released pages go to a handoff from the healthy stages (the spare stage 0 and
    stage 1), which completes with its own bytes in them."""
    spare, stage1 = dep.spare_urls[0], dep.prefill_urls[1]
    await create(http, dep, hid, [spare, stage1])
    await ready(http, spare, hid, 0, NEW)
    await ready(http, stage1, hid, 1, NEW)
    view = await finished(http, dep, hid)
    assert view["state"] == "completed", view
    assert landed(dep, [NEW]) == []


async def until(fact: Any, what: str, timeout_s: float = WAIT_S) -> Any:
    """Poll `fact()` until it returns something true (a fact that, once true, stays true)."""
    deadline = time.monotonic() + timeout_s
    while not (value := fact()):
        assert time.monotonic() < deadline, f"not observed within {timeout_s} s: {what}"
        await asyncio.sleep(0.002)
    return value


async def next_event(
    http: aiohttp.ClientSession, url: str, hid: str, tag: str, timeout_s: float = WAIT_S
) -> dict[str, Any]:
    """The first `tag` event of handoff `hid` on the service at `url` (its SSE stream)."""
    async with asyncio.timeout(timeout_s), http.get(f"{url}/v1/handoffs/{hid}/events") as resp:
        assert resp.status == 200
        event = None
        async for raw in resp.content:
            line = raw.decode().rstrip("\n")
            if line.startswith("event: "):
                event = line[len("event: ") :]
            elif line.startswith("data: ") and event == tag:
                data: dict[str, Any] = json.loads(line[len("data: ") :])
                return data
    raise AssertionError(f"the stream of {hid} ended without {tag}")


@contextmanager
def stopped(*pids: int) -> Iterator[None]:
    """The processes are resumed whatever happens (a stopped process ignores SIGTERM)."""
    try:
        yield
    finally:
        for pid in pids:
            os.kill(pid, signal.SIGCONT)


# --------------------------------------------------------------------------------------------
# What landed


def pid(dep: LocalDeployment, name: str) -> int:
    popen = dep.process(name).popen
    assert popen is not None
    return popen.pid


async def data_ports(http: aiohttp.ClientSession, dep: LocalDeployment) -> set[int]:
    """The decode's transport data port(s): its listening ports but HTTP and the engine's
    handshake port (the layout's target)."""
    async with http.get(f"{dep.decode_url}/v1/layout") as resp:
        target = (await resp.json())["target"]
    http_port = int(dep.decode_url.rsplit(":", 1)[1])
    ports = listening_ports(pid(dep, "decode")) - {http_port, int(target.rsplit(":", 1)[1])}
    assert ports, "the decode's engine listens on no data port"
    return ports


def call_bytes(dep: LocalDeployment) -> int:
    """Bytes on the wire of the paused call: the layers' bytes plus one header per block (a
    landed segment travels in 1 MiB blocks; a direct write of contiguous pages is one block per
    layer)."""
    landed_mode = dep.transfer.mode == "landed"
    blocks = -(-PAUSED_BYTES // BLOCK_BYTES) if landed_mode else len(REST)
    return PAUSED_BYTES + blocks * MOONCAKE_HEADER_BYTES


def old_rows_in_new_pages(dep: LocalDeployment) -> int:
    """Rows of the reused pages that hold the failed handoff's bytes (stage 0, REST layers)."""
    count = 0
    for i, e in enumerate(dep.decode_layout.kv):
        if e.layer_id in REST:
            got = rows(dep.decode_pool.view(i), e.item_len)[NEW.dst_pages]
            old = rows(dep.stage_pool(0).view(i), e.item_len)[OLD.src_pages]
            count += int(np.all(got == old, axis=1).sum())
    return count


async def begin_paused_call(
    http: aiohttp.ClientSession, dep: LocalDeployment, hid: str, **extra: Any
) -> tuple[Wire, set[int]]:
    """Create `hid` from stage 0 (prefill-0) and stage 1, land stage 0's first layer, then stop
    the decode and signal the rest of stage 0: its engine call starts and cannot finish.
    Returns the wire before the call, once the call's first bytes are on it (the decode still
    stopped: the caller stops the writer or resumes the decode)."""
    fill_sources(dep, seed=int(time.monotonic_ns() % 1000))
    reset_decode(dep)
    writer, decode = pid(dep, "prefill-0"), pid(dep, "decode")
    ports = await data_ports(http, dep)
    await create(http, dep, hid, dep.prefill_urls, **extra)
    await ready(http, dep.prefill_urls[0], hid, 0, OLD, FIRST)
    await until(lambda: not [p for p in landed(dep, [OLD], set(FIRST)) if "wrong" in p], "layer 0")
    # Landed, the decode's answer to that segment carries the stage's next window: stop the
    # decode only once the prefill has it (its `stage.transferred` follows the answer; the
    # stream replays it), or the rest of the stage waits for a window the stopped decode cannot
    # grant and no byte of the call reaches the wire. (Its pages hold layer 0 a turn of the
    # decode's loop before the answer leaves: it waits for the group commit.)
    if dep.transfer.mode == "landed":
        await next_event(http, dep.prefill_urls[0], hid, "stage.transferred")
    before = wire(writer, decode, ports)
    os.kill(decode, signal.SIGSTOP)
    await ready(http, dep.prefill_urls[0], hid, 0, OLD, REST)
    await until(lambda: wire(writer, decode, ports).send_q > MiB, "the call's bytes on the wire")
    return before, ports


def unsent(dep: LocalDeployment, before: Wire, ports: set[int]) -> int:
    """Bytes of the paused call not in any kernel yet (writer and decode both stopped)."""
    now = wire(pid(dep, "prefill-0"), pid(dep, "decode"), ports)
    return call_bytes(dep) - now.acked_since(before) - now.send_q


async def late_bytes_landed(dep: LocalDeployment, before: Wire, ports: set[int]) -> None:
    """Every byte of the paused call was acknowledged by the decode's kernel and read by its
    engine (into the window, or the pages in direct mode)."""
    writer, decode = pid(dep, "prefill-0"), pid(dep, "decode")

    def done() -> bool:
        now = wire(writer, decode, ports)
        return now.acked_since(before) >= call_bytes(dep) and now.send_q == now.recv_q == 0

    await until(done, "every byte of the paused call landed")


# --------------------------------------------------------------------------------------------
# 1. A prefill stage paused mid-transfer


async def paused_writer(http: aiohttp.ClientSession, dep: LocalDeployment, tag: str) -> None:
    """Stage 0's process is stopped inside its engine call; the handoff
    is aborted and released; the pages go to a handoff that completes; then the paused process
    resumes and every byte of its call lands."""
    old, new = f"paused-{tag}", f"paused-{tag}-reuse"
    writer, decode = pid(dep, "prefill-0"), pid(dep, "decode")
    with stopped(decode, writer):
        # The deadline only bounds direct mode's fence (deadline + the writer's max_call_s);
        # it is far beyond the time the call takes to start on a busy machine.
        before, ports = await begin_paused_call(http, dep, old, deadline_s=10.0)
        os.kill(writer, signal.SIGSTOP)
        # Mid-transfer: most of the call is still in the paused process, not in any kernel.
        assert unsent(dep, before, ports) > LATE_MIN_BYTES
        os.kill(decode, signal.SIGCONT)
        # The abort answers once the paused stage acknowledged it (after it resumes).
        aborting = asyncio.create_task(abort(http, dep, old))
        view = await released(http, dep, old)
        assert view["state"] == "aborted", view
        await reuse(http, dep, new)
    await late_bytes_landed(dep, before, ports)
    status, view = await aborting
    assert status == 200 and view["state"] == "aborted", view


async def test_a_paused_writer_resumed_after_reuse_changes_nothing(
    http: aiohttp.ClientSession, landed_dep: LocalDeployment
) -> None:
    await paused_writer(http, landed_dep, "landed")
    # Its late bytes went into its quarantined window: the reuse is whole, nothing else changed.
    assert landed(landed_dep, [NEW]) == []
    assert old_rows_in_new_pages(landed_dep) == 0


async def test_direct_mode_the_same_paused_writer_corrupts_the_reuse(
    http: aiohttp.ClientSession, direct_dep: LocalDeployment
) -> None:
    await paused_writer(http, direct_dep, "direct")
    problems = landed(direct_dep, [NEW])
    assert problems, "direct mode: the late bytes were expected in the reused pages"
    assert all(any(f"layer {la} " in p for la in REST) for p in problems), problems
    assert old_rows_in_new_pages(direct_dep) > 0  # the failed handoff's bytes, in the reuse


# --------------------------------------------------------------------------------------------
# 2. The decode's receive path stalled beyond the transfer timeout


async def timed_out_batches(http: aiohttp.ClientSession, url: str) -> float:
    """The prefill's count of batches whose call outlived its transfer timeout (/metrics)."""
    async with http.get(f"{url}/metrics") as resp:
        text = await resp.text()
    found = re.search(
        r'^kvhandoff_transport_batches_total\{result="timed_out"\} (\S+)$', text, re.M
    )
    return float(found.group(1)) if found else 0.0


async def stalled_receiver(http: aiohttp.ClientSession, dep: LocalDeployment, tag: str) -> None:
    """The decode is stopped while stage 0 writes: the prefill's call times out
    (`transfer_timeout_s`), its engine call gives up after its own allowance, but the engine
    cannot cancel the writes: the prefill's transport holds their batch ids and its lane stays
    stuck, so the prefill does not report the stage stopped while they may still land (T3).
    The writer is stopped with the rest of the batch still in its engine's sessions (so it
    lands after the reuse, the worst order), the decode resumes, fails the handoff at its own
    deadline and releases it, the pages are reused, then the writer's sessions send the rest."""
    old, new = f"stall-{tag}", f"stall-{tag}-reuse"
    writer, decode = pid(dep, "prefill-0"), pid(dep, "decode")
    timed_out = await timed_out_batches(http, dep.prefill_urls[0])
    with stopped(decode, writer):
        before, ports = await begin_paused_call(http, dep, old, deadline_s=STALL_DEADLINE_S)

        async def gave_up() -> None:
            while await timed_out_batches(http, dep.prefill_urls[0]) <= timed_out:
                await asyncio.sleep(0.05)

        await asyncio.wait_for(gave_up(), WAIT_S)  # the prefill's call timed out
        os.kill(writer, signal.SIGSTOP)
        assert unsent(dep, before, ports) > LATE_MIN_BYTES
        os.kill(decode, signal.SIGCONT)
        view = await released(http, dep, old)
        assert view["state"] == "failed" and view["error"]["code"] == "deadline_exceeded", view
        await reuse(http, dep, new)
    await late_bytes_landed(dep, before, ports)


async def test_a_stalled_receiver_lands_the_late_bytes_in_a_window_only(
    http: aiohttp.ClientSession, landed_dep: LocalDeployment
) -> None:
    await stalled_receiver(http, landed_dep, "landed")
    assert landed(landed_dep, [NEW]) == []
    assert old_rows_in_new_pages(landed_dep) == 0


async def test_direct_mode_the_same_stalled_receiver_corrupts_the_reuse(
    http: aiohttp.ClientSession, direct_dep: LocalDeployment
) -> None:
    await stalled_receiver(http, direct_dep, "direct")
    problems = landed(direct_dep, [NEW])
    assert problems, "direct mode: the late bytes were expected in the reused pages"
    assert old_rows_in_new_pages(direct_dep) > 0


# --------------------------------------------------------------------------------------------
# 3. Layer-range and page-range segments in any order, through an arena smaller than a request

#: hybrid-npu-mla at 32 layers over PP=4: per stage two full-attention KV layers (2,048- and
#: 256-byte pages) and six state layers (128 KiB and 6 KiB per slot). A 96-page request is
#: about 5 MiB; the arena holds 1 MiB, a window 160 KiB: every KV layer is cut into page ranges
#: (96 x 2 KiB does not fit one window) and the stages wait for room in turn.
SMALL_MODEL = {"scale": 8, "page_size": 16, "num_layers": 32}
SMALL_ARENA = TransferConfig(landing_bytes=1 * MiB, window_bytes=160 << 10, staging_bytes=1 * MiB)


@pytest.fixture(scope="module")
def small_arena() -> Iterator[LocalDeployment]:
    with LocalDeployment(
        preset="hybrid-npu-mla",
        model=SMALL_MODEL,
        pp_size=4,
        groups=[[0, 1], [2], [3]],  # two stages share a process (and its staging buffer)
        num_pages=256,
        num_slots=4,
        transfer=SMALL_ARENA,
        ready_timeout_s=120,
    ) as dep:
        yield dep


async def test_segments_in_any_order_through_an_arena_smaller_than_a_request(
    http: aiohttp.ClientSession, small_arena: LocalDeployment
) -> None:
    dep = small_arena
    fill_sources(dep, seed=17)
    reset_decode(dep)
    rng = np.random.default_rng(17)
    src, dst = rng.permutation(256), rng.permutation(256)
    moves = [
        Moved(src[:96].tolist(), dst[:96].tolist(), 0, 3),
        Moved(src[96:192].tolist(), dst[96:192].tolist(), 2, 1),
    ]
    request_bytes = {
        r: sum(e.item_len for e in lay.kv) * 96 + sum(s.item_len for s in lay.state)
        for r, lay in dep.stage_layouts.items()
    }
    assert sum(request_bytes.values()) > 4 * SMALL_ARENA.landing_bytes
    signals: list[tuple[str, int, list[int]]] = []
    for i, m in enumerate(moves):
        hid = f"order-{i}"
        body = {"id": hid, "prefill": dep.prefill_urls, "dst_pages": m.dst_pages}
        status, answer = await post(
            http, f"{dep.decode_url}/v1/handoffs", {**body, "dst_slot": m.dst_slot}
        )
        assert status == 201, answer
        for r, lay in dep.stage_layouts.items():
            layers = rng.permutation(
                sorted({e.layer_id for e in lay.kv} | {s.layer_id for s in lay.state})
            )
            # Each stage's layers in a random order, in one to three layers per signal.
            cuts = sorted(rng.choice(np.arange(1, len(layers)), size=3, replace=False).tolist())
            signals += [(hid, r, part.tolist()) for part in np.split(layers, cuts)]
    by_hid = dict(zip((f"order-{i}" for i in range(len(moves))), moves, strict=True))
    # Interleaved across stages and handoffs, every stage's first signal carries its pages.
    for j in rng.permutation(len(signals)):
        hid, r, layers = signals[j]
        m = by_hid[hid]
        body = {"src_pages": m.src_pages, "src_slot": m.src_slot, "layers": layers}
        url = f"{dep.url_of_stage(r)}/v1/handoffs/{hid}/stages/{r}/ready"
        status, answer = await post(http, url, body)
        assert status == 202, answer
    views = [await finished(http, dep, hid) for hid in by_hid]
    errors = [v.get("error") for v in views]
    assert [v["state"] for v in views] == ["completed"] * len(moves), errors
    assert landed(dep, moves) == []
    for view in views:
        committed = [e for e in view["timeline"] if e["type"] == "stage.segment_committed"]
        for r, nbytes in request_bytes.items():
            segments = [e["bytes"] for e in committed if e["pp_rank"] == r]
            # Many segments per stage, none larger than a window, adding up to the stage.
            assert sum(segments) == nbytes and len(segments) >= nbytes // SMALL_ARENA.window_bytes
            assert max(segments) <= SMALL_ARENA.window_bytes
