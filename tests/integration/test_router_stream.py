"""A router following outcomes on one event stream (`kvhandoff.service.tools.outcome_stream`),
against real processes (decode + PP=2 prefill, Mooncake over TCP on loopback): every outcome
arrives, with many handoffs at once, when the stream is cut mid-run, when it stays down, and when
the decode's replay buffer no longer holds what the reader missed (`stream.gap`) or the reader
falls behind (`stream.overflow`), when its last outcome is older than that buffer (it resumes
from the decode's `stream.position`), and when an ended handoff is driven again. The stream goes
through a TCP relay the test cuts; the per-handoff GET (the fallback) goes to the decode
directly."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from urllib.parse import urlsplit

import aiohttp
import pytest

from kvhandoff.service.config import HandoffConfig
from kvhandoff.service.testing.deployment import LocalDeployment
from kvhandoff.service.tools.outcome_stream import OutcomeStream
from kvhandoff.service.tools.router_client import RouterClient

pytestmark = pytest.mark.integration
DeploymentFactory = Callable[..., LocalDeployment]
WAIT_S = 60.0


class Relay:
    """A TCP relay to `target`: `cut()` drops every open connection, `down` refuses new ones,
    `delay_s` holds a new one that long before it reaches `target`."""

    def __init__(self, target: str) -> None:
        parts = urlsplit(target)
        self.host, self.port = parts.hostname or "127.0.0.1", parts.port or 80
        self.down = False
        self.delay_s = 0.0
        self.cuts = 0
        self._writers: set[asyncio.StreamWriter] = set()
        self._server: asyncio.Server | None = None

    async def __aenter__(self) -> Relay:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return self

    async def __aexit__(self, *_: object) -> None:
        self.cut()
        assert self._server is not None
        self._server.close()

    @property
    def url(self) -> str:
        assert self._server is not None
        return f"http://127.0.0.1:{self._server.sockets[0].getsockname()[1]}"

    def cut(self) -> None:
        self.cuts += 1
        for writer in list(self._writers):
            writer.transport.abort()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self.down:
            writer.transport.abort()
            return
        await asyncio.sleep(self.delay_s)
        up_reader, up_writer = await asyncio.open_connection(self.host, self.port)
        self._writers |= {writer, up_writer}
        try:
            await asyncio.gather(_pipe(reader, up_writer), _pipe(up_reader, writer))
        finally:
            for w in (writer, up_writer):
                self._writers.discard(w)
                w.transport.abort()


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    with contextlib.suppress(ConnectionError, OSError):
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
    writer.transport.abort()


class Router(RouterClient):
    """`RouterClient` whose stream goes through `relay` (its long polls go straight)."""

    def __init__(self, http: aiohttp.ClientSession, dep: LocalDeployment, relay: Relay) -> None:
        super().__init__(http, dep)
        # Patience beyond the test's timeout: an outcome the stream lost fails the test.
        self.stream = OutcomeStream(http, relay.url, self._polled, patience_s=10 * WAIT_S)
        self._stream = self.stream


async def drive(router: Router, ids: range) -> None:
    outcomes = await asyncio.gather(
        *(router.handoff(f"rs-{i}", [i % 60], [i % 60], i % 60, i % 60) for i in ids)
    )
    assert [(o.state, o.bytes > 0) for o in outcomes] == [("completed", True)] * len(ids), outcomes


async def test_outcomes_of_many_handoffs_at_once_come_on_the_stream(
    deployment: DeploymentFactory,
) -> None:
    dep = deployment(pp_size=2, num_slots=64)
    async with aiohttp.ClientSession() as http, Relay(dep.decode_url) as relay:
        async with Router(http, dep, relay) as router, asyncio.timeout(WAIT_S):
            await drive(router, range(0, 48))
            # A failure too: a page the decode pool does not have fails nothing (rejected), a
            # source page the prefill pool does not have fails the handoff on the stream.
            failed = await router.handoff("rs-bad", [10_000], [1], None, None)
        assert failed.state in ("failed", "rejected"), failed
        assert router.stream.fallbacks == 0  # no GET per handoff: the stream told every one


async def test_a_stream_cut_mid_run_or_down_still_yields_every_outcome(
    deployment: DeploymentFactory,
) -> None:
    dep = deployment(pp_size=2, num_slots=64)
    async with aiohttp.ClientSession() as http, Relay(dep.decode_url) as relay:
        async with Router(http, dep, relay) as router, asyncio.timeout(WAIT_S):
            running = asyncio.create_task(drive(router, range(0, 40)))
            for _ in range(4):  # cut again and again while handoffs run: resumes by id
                await asyncio.sleep(0.05)
                relay.cut()
            await running
            relay.down = True  # the stream cannot come back: every handoff is looked up
            relay.cut()
            await drive(router, range(40, 56))
            assert router.stream.fallbacks >= 16
            relay.down = False
            while not router.stream.up:  # it re-opens by itself, and follows again
                await asyncio.sleep(0.05)
            looked_up = router.stream.fallbacks
            await drive(router, range(56, 64))
        assert router.stream.fallbacks == looked_up


async def test_a_gap_is_filled_by_looking_each_handoff_up(
    deployment: DeploymentFactory,
) -> None:
    # A replay buffer of 8 events (a handoff publishes 7 on the decode).
    dep = deployment(pp_size=2, num_slots=64, handoff=HandoffConfig(sse_buffer=8))
    async with aiohttp.ClientSession() as http, Relay(dep.decode_url) as relay:
        async with Router(http, dep, relay) as router, asyncio.timeout(WAIT_S):
            await drive(router, range(0, 4))  # the stream has an id to resume from
            # The stream stays down while more handoffs end than the buffer holds (each is
            # looked up); its resume then asks for ids the decode no longer has: a gap, on
            # which whatever waits is looked up, and nothing is lost.
            relay.down = True
            relay.cut()
            await drive(router, range(4, 12))
            relay.down = False
            while not router.stream.gaps:
                await asyncio.sleep(0.05)
            await drive(router, range(12, 20))
        assert router.stream.fallbacks >= 8


async def test_a_stream_cut_after_a_buffer_of_other_events_resumes_with_no_look_up(
    deployment: DeploymentFactory,
) -> None:
    """Review finding 8: the reader's last outcome is long gone from the decode's buffer (8
    events) when the stream is cut, after 24 creates whose stages are not ready yet; it
    resumes from the decode's last `stream.position` (one per 2 events it skips), so it gets
    no `stream.gap` and looks none of the 24 up."""
    dep = deployment(pp_size=2, num_slots=64, handoff=HandoffConfig(sse_buffer=8))
    async with aiohttp.ClientSession() as http, Relay(dep.decode_url) as relay:
        async with Router(http, dep, relay) as router, asyncio.timeout(WAIT_S):
            stream = router.stream
            await drive(router, range(0, 2))  # the stream has an outcome's id
            ids = [f"rs-{i}" for i in range(2, 26)]
            futures = {h: stream.expect(h) for h in ids}
            for i, h in enumerate(ids, start=2):
                assert await router.create(h, [i], i) is None
            async with http.get(f"{dep.decode_url}/v1/handoffs/{ids[-1]}") as resp:
                last_created = (await resp.json())["timeline"][0]["seq"]
            while (stream._last_id or 0) < last_created - 2:  # a position at most 2 behind
                await asyncio.sleep(0.02)
            relay.cut()
            waiting = [asyncio.ensure_future(stream.outcome(h, futures[h])) for h in ids]
            for i, h in enumerate(ids, start=2):
                assert await router.signal_stages(h, [i], i) == []
            outcomes = await asyncio.gather(*waiting)
        assert [o.state for o in outcomes] == ["completed"] * len(ids), outcomes
        assert (stream.gaps, stream.fallbacks, relay.cuts) == (0, 0, 1)


async def test_an_overflow_resumes_and_every_outcome_still_arrives(
    deployment: DeploymentFactory,
) -> None:
    # A reader queue of 4 events: the reader falls behind, is cut off and resumes by its id.
    dep = deployment(pp_size=2, num_slots=64, handoff=HandoffConfig(sse_queue=4))
    async with aiohttp.ClientSession() as http, Relay(dep.decode_url) as relay:
        async with Router(http, dep, relay) as router, asyncio.timeout(WAIT_S):
            # Every outcome arrives (`drive` asserts it): from the resume's replay, as a
            # patience beyond the test's timeout leaves nothing else to tell it.
            await drive(router, range(0, 48))
        assert router.stream.overflows > 0


async def test_re_driving_an_ended_handoff_answers_at_once(
    deployment: DeploymentFactory,
) -> None:
    dep = deployment(pp_size=2, num_slots=64)
    async with aiohttp.ClientSession() as http, Relay(dep.decode_url) as relay:
        async with Router(http, dep, relay) as router, asyncio.timeout(WAIT_S):
            first = await router.handoff("rd-1", [1], [1], 1, 1)
            # The same request again (a router retrying): 200 with the ended view, whose
            # outcome event the stream will not repeat; the view is the outcome.
            again = await asyncio.wait_for(router.handoff("rd-1", [1], [1], 1, 1), 5)
        assert first.state == "completed" and again == first
        assert router.stream.fallbacks == 0


async def test_a_coalescing_router_sends_what_one_turn_issues_as_one_batch(
    deployment: DeploymentFactory,
) -> None:
    dep = deployment(pp_size=2, num_slots=64)
    async with aiohttp.ClientSession() as http:
        async with RouterClient(http, dep, coalesce=True) as router, asyncio.timeout(WAIT_S):
            outcomes = await asyncio.gather(
                *(router.handoff(f"co-{i}", [i], [i], i, i) for i in range(40)),
                router.handoff("co-bad", [1], [10_000], None, None),  # refused alone
            )
        assert [o.state for o in outcomes] == ["completed"] * 40 + ["rejected"], outcomes
        assert "dst_pages[0]" in (outcomes[-1].error or ""), outcomes[-1]
        assert (router.creates.batches, router.creates.items) == (1, 41)
        # One prefill service per stage: one batch each, of every handoff's ready.
        assert [(b.batches, b.items) for b in router.readies.values()] == [(1, 41), (1, 41)]
