"""Requests that fail around a real SGLang PD pair: every request that completes still answers
the single server's tokens, the failed ones end in kvhandoff's own state, and the pair serves
the next ones.

The transfers these cases interrupt are held under way by the decode's fault hook
(`SLOW_ROOMS`: each landed segment waits `SLOW_COMMIT_S` before its commit), so a client's
disconnect or a prefill's SIGKILL lands while the request's bytes move. What kvhandoff says is
read from its API (`tests/engines/handoffs.py`): a handoff ended means terminal and released
(no lease left), and a settled service has none in flight. The cases run in this order, on the
session's servers (the killed prefill is started again on its own ports); the page-reuse case
counts the killed prefill's failures among those whose pages must be reused, and the requests
that fail by deadline are sent when the killed-prefill case starts, so their deadline runs out
while that case (and its prefill's restart) runs, not as a wait of its own.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import aiohttp
import pytest

from tests.engines.client import (
    Failed,
    Pair,
    handoff_id,
    next_room,
    next_slow_room,
    pd,
    prompts,
)
from tests.engines.conftest import CHUNK_TOKENS, Reference, Servers, run
from tests.engines.handoffs import (
    TERMINAL,
    Records,
    cut_off,
    ended,
    service_urls,
    settled,
    view,
    wait_view,
)
from tests.engines.servers import DEADLINE_S, Server

#: A prompt of this many tokens moves as twelve segments (32 KiB windows, 1 KiB a token), two
#: at a time: with each held `SLOW_COMMIT_S` by the decode, its transfer lasts some 18 s after
#: its first commit, well past SGLang's disconnect check (every 4 s) and abort.
LONG = 12 * CHUNK_TOKENS
#: Bound on a failed handoff's release: its deadline plus the longest grace.
RELEASE_BOUND_S = DEADLINE_S + 90.0


@pytest.fixture(scope="module")
def failed_rooms() -> dict[str, list[int]]:
    """Rooms whose requests failed, by cause, for the page-reuse case."""
    return {"abort": [], "deadline": [], "killed stage": []}


class DeadlineRequests:
    """Requests sent to the decode alone through the PP 2 prefill's address (which no case
    kills): the prefill never hears of them, so their handoffs can only reach their deadline.
    They run on a thread (and event loop) of their own, across cases: `sent` is the
    requests' outcomes (each Failed, or the tokens of one that wrongly completed)."""

    def __init__(self, pair: Pair, pool: ThreadPoolExecutor) -> None:
        batch = prompts(2, seed=31, min_len=LONG, max_len=LONG)
        self.rooms = [next_room() for _ in batch]

        async def send(session: aiohttp.ClientSession) -> list[Any]:
            return list(
                await asyncio.gather(
                    *(
                        pd(session, pair, p, room=r, decode_only=True)
                        for p, r in zip(batch, self.rooms, strict=True)
                    ),
                    return_exceptions=True,
                )
            )

        self.sent: Future[list[Any]] = pool.submit(run, send)


@pytest.fixture(scope="module")
def deadline_requests(pair_pp2: Pair) -> Iterator[DeadlineRequests]:
    """Sent when a case first asks (the killed-prefill case), for the page-reuse case."""
    with ThreadPoolExecutor(1) as pool:
        yield DeadlineRequests(pair_pp2, pool)


def committed_segments(v: dict[str, Any]) -> int:
    return sum(1 for e in v.get("timeline", []) if e["type"] == "stage.segment_committed")


def moving(v: dict[str, Any]) -> bool:
    """Some of its bytes are committed (or it ended: the caller's assertion says which)."""
    return committed_segments(v) > 0 or v["state"] in TERMINAL


async def first_moving(
    session: aiohttp.ClientSession, decode_api: str, rooms: list[int], timeout_s: float
) -> dict[str, Any]:
    """The view of the first of the rooms' handoffs found transferring with some of its bytes
    committed; AssertionError after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for r in rooms:
            v = await view(session, decode_api, r)
            if v is not None and v["state"] == "transferring" and committed_segments(v) > 0:
                return v
        await asyncio.sleep(0.1)
    raise AssertionError(f"none of rooms {rooms} moved within {timeout_s:.0f} s")


async def disconnect_mid_transfer(
    session: aiohttp.ClientSession, pair: Pair, decode_api: str, prompt: list[int], room: int
) -> dict[str, Any]:
    """Sends the request, drops both its connections once a segment of it is committed, and
    returns the handoff's view at that moment."""
    request = asyncio.create_task(pd(session, pair, prompt, room=room))
    try:
        return await wait_view(session, decode_api, room, moving, 180.0)
    finally:
        request.cancel()
        with contextlib.suppress(asyncio.CancelledError, Failed, aiohttp.ClientError):
            await request


def test_a_client_that_disconnects_mid_transfer_is_aborted_on_both_sides(
    pair: Pair,
    prefill: Server,
    decode_api: str,
    reference: Reference,
    failed_rooms: dict[str, list[int]],
) -> None:
    prompt = prompts(1, seed=11, min_len=LONG, max_len=LONG)[0]
    room = next_slow_room()
    nxt = prompts(4, seed=12, min_len=8, max_len=3 * CHUNK_TOKENS)

    async def go(session: aiohttp.ClientSession) -> tuple[Any, ...]:
        at_disconnect = await disconnect_mid_transfer(session, pair, decode_api, prompt, room)
        final = await wait_view(session, decode_api, room, ended, RELEASE_BOUND_S)
        # The prefill's service holds nothing of it either (a destination it still had would
        # count there), nor does the decode.
        await settled(session, [decode_api, *service_urls(prefill, "prefill")], 60.0)
        after = list(await asyncio.gather(*(pd(session, pair, p) for p in nxt)))
        return at_disconnect, final, after

    at_disconnect, final, after = run(go)
    failed_rooms["abort"].append(room)
    assert at_disconnect["state"] == "transferring", at_disconnect  # cut off mid-transfer
    assert cut_off(final["state"], (final.get("error") or {}).get("code")), final
    assert final["released"], final
    assert after == reference.of(nxt)


def test_a_killed_prefill_fails_its_requests_naming_the_stage_then_serves_after_restart(
    servers: Servers,
    prefill: Server,
    pair: Pair,
    pair_pp2: Pair,
    decode_api: str,
    reference: Reference,
    failed_rooms: dict[str, list[int]],
    deadline_requests: DeadlineRequests,
) -> None:
    """SIGKILL the PP 1 prefill (every process of it) while its requests' bytes move; the PP 2
    prefill's requests, in flight at the same time into the same decode, are untouched."""
    doomed = prompts(3, seed=21, min_len=LONG, max_len=LONG)
    rooms = [next_slow_room() for _ in doomed]
    bystanders = prompts(4, seed=22, min_len=8, max_len=3 * CHUNK_TOKENS)
    nxt = prompts(4, seed=23, min_len=8, max_len=3 * CHUNK_TOKENS)
    killed_urls = service_urls(prefill, "prefill")

    async def go(session: aiohttp.ClientSession) -> tuple[Any, ...]:
        sent = [
            asyncio.create_task(pd(session, pair, p, room=r, prefill_may_fail=True))
            for p, r in zip(doomed, rooms, strict=True)
        ]
        others = asyncio.gather(*(pd(session, pair_pp2, p) for p in bystanders))
        at_kill = await first_moving(session, decode_api, rooms, 180.0)
        await asyncio.to_thread(prefill.kill)
        outcomes = await asyncio.gather(*sent, return_exceptions=True)
        untouched = await others
        restart = asyncio.create_task(asyncio.to_thread(servers.restart, prefill))
        # A doomed request the decode had not yet made a handoff for has none: its create
        # was refused (the client's answer says so below).
        finals = [
            None
            if await view(session, decode_api, r) is None
            else await wait_view(session, decode_api, r, ended, RELEASE_BOUND_S)
            for r in rooms
        ]
        await restart
        after = list(await asyncio.gather(*(pd(session, pair, p) for p in nxt)))
        return at_kill, outcomes, untouched, finals, after

    at_kill, outcomes, untouched, finals, after = run(go)
    expected = reference.of(doomed)
    failures = 0
    for room, out, want, final in zip(rooms, outcomes, expected, finals, strict=True):
        if isinstance(out, list):  # all its bytes had landed: it completed, and right
            assert final is not None and final["state"] == "completed", final
            assert out == want, room
            continue
        failures += 1
        assert isinstance(out, Failed), out
        if final is None:  # refused before a handoff existed, naming the peer
            assert "create refused" in out.text, out.text
            assert any(u in out.text for u in killed_urls), out.text
            continue
        failed_rooms["killed stage"].append(room)
        # The client is told which handoff failed and where; kvhandoff's record says the same.
        assert handoff_id(room) in out.text, out.text
        assert final["state"] == "failed", final
        error = final["error"]
        names_stage = error.get("pp_rank") == 0 or "stage 0" in error["reason"]
        names_peer = error.get("context", {}).get("peer") in killed_urls or any(
            u in error["reason"] for u in killed_urls
        )
        assert names_stage or names_peer, error
    assert failures >= 1, (at_kill, finals)  # the one moving at the kill was cut off
    assert untouched == reference.of(bystanders)
    assert after == reference.of(nxt)


def test_pages_that_failed_requests_freed_serve_others_with_the_right_tokens(
    pair: Pair,
    pair_pp2: Pair,
    decode_api: str,
    decode_records: Records,
    reference: Reference,
    failed_rooms: dict[str, list[int]],
    deadline_requests: DeadlineRequests,
) -> None:
    """Requests fail by abort (the client gone mid-transfer) and by deadline (the prefill never
    hears of them; sent since the case above) while waves of others run through both
    prefills; the waves go on until the decode has given pages of each cause's failed
    requests (the killed prefill's too, from the case above) to requests that then completed.
    Every request that completed answered the single server's tokens."""
    abort_prompts = prompts(2, seed=32, min_len=LONG, max_len=LONG)
    good_rooms: list[int] = []
    wave_size, max_waves = 16, 12

    def reused() -> dict[str, bool]:
        records = decode_records.all()
        taken = [
            records[handoff_id(r)].dst_pages
            for r in good_rooms
            if handoff_id(r) in records and records[handoff_id(r)].state == "completed"
        ]
        return {
            cause: any(
                records[handoff_id(r)].dst_pages & pages
                for r in rooms
                if handoff_id(r) in records
                for pages in taken
            )
            for cause, rooms in failed_rooms.items()
            if rooms
        }

    async def wave(session: aiohttp.ClientSession, seed: int) -> None:
        batch = prompts(wave_size, seed=seed, min_len=2 * CHUNK_TOKENS, max_len=3 * CHUNK_TOKENS)
        rooms = [next_room() for _ in batch]
        got = await asyncio.gather(
            *(
                pd(session, pair if i % 2 else pair_pp2, p, room=r)
                for i, (p, r) in enumerate(zip(batch, rooms, strict=True))
            )
        )
        good_rooms.extend(rooms)
        assert list(got) == await asyncio.to_thread(reference.of, batch), seed

    deadline_rooms = deadline_requests.rooms

    async def go(session: aiohttp.ClientSession) -> list[int]:
        seed = 100
        await wave(session, seed)
        abort_rooms = []
        for p in abort_prompts:
            room = next_slow_room()
            cut, _ = await asyncio.gather(
                disconnect_mid_transfer(session, pair, decode_api, p, room),
                wave(session, seed := seed + 1),
            )
            assert cut["state"] == "transferring", cut
            abort_rooms.append(room)
        failed_rooms["abort"] += abort_rooms
        while not deadline_requests.sent.done():  # others take pages until the deadline
            await wave(session, seed := seed + 1)
        failed_rooms["deadline"] += deadline_rooms
        for r in [*deadline_rooms, *abort_rooms]:
            await wait_view(session, decode_api, r, ended, RELEASE_BOUND_S)
        waves = 0
        while not all(reused().values()) and waves < max_waves:
            await wave(session, seed := seed + 1)
            waves += 1
        await settled(session, [decode_api], 60.0)
        return abort_rooms

    abort_rooms = run(go)
    timed_out = deadline_requests.sent.result(timeout=RELEASE_BOUND_S)
    for room, out in zip(deadline_rooms, timed_out, strict=True):
        assert isinstance(out, Failed), out
        assert handoff_id(room) in out.text and "deadline" in out.text, out.text
    records = decode_records.all()
    assert {records[handoff_id(r)].state for r in deadline_rooms} == {"failed"}
    for r in abort_rooms:
        assert cut_off(records[handoff_id(r)].state, records[handoff_id(r)].error_code), r
    assert all(reused().values()), reused()
