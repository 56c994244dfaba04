"""The webhook dispatcher over a real outbox file and a real receiver, on a controlled clock:
retry timing is checked against the clock the dispatcher reads, never against sleeps."""

from __future__ import annotations

import asyncio
import random
import socket
import time
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any, ClassVar

import pytest

from kvhandoff.pipelines.events import EventBus, HandoffCompleted, HandoffCreated
from kvhandoff.service.config import WebhooksConfig
from kvhandoff.service.storage import FILE_NAME, Database
from kvhandoff.service.webhooks import outbox as outbox_module
from kvhandoff.service.webhooks.dispatch import Dispatcher, parse_retry_after, retry_delay
from kvhandoff.service.webhooks.outbox import Delivery, Outbox
from kvhandoff.service.webhooks.views import DeliveryView
from tests.fakes import Clock
from tests.receivers import WAIT_S, Answer, Received, WebhookReceiver


class World:
    def __init__(self, path: Path, settings: WebhooksConfig) -> None:
        # Near real time: receivers check webhook-timestamp against it.
        self.clock = Clock(time.time())
        self.bus = EventBus(clock=self.clock)
        self.db = Database(path / FILE_NAME)
        self.outbox = Outbox(self.db, None, [])
        self.settings = settings
        self.dispatcher = Dispatcher(self.outbox, settings, clock=self.clock, rng=random.Random(7))
        self.secret = ""
        self.endpoint_id = ""

    def register(self, url: str) -> None:
        created = self.outbox.create_endpoint(url, [], None, "", self.clock())
        self.secret, self.endpoint_id = created.secret, created.id

    def publish(self, handoff_id: str, *, completed: bool = False) -> None:
        event = self.bus.publish(
            HandoffCompleted(
                handoff_id=handoff_id, role="decode", bytes=1, seconds=0.1, verified=False
            )
            if completed
            else HandoffCreated(handoff_id=handoff_id, role="decode", num_pages=1, pp_size=1)
        )
        with self.db.transaction() as tx:
            deliveries = self.outbox.enqueue(tx, event, None)
        self.dispatcher.add(deliveries)

    def deliveries(self, state: str | None = None) -> list[DeliveryView]:
        return self.outbox.deliveries(self.endpoint_id, state, 100, 0).items  # type: ignore[arg-type]

    async def advance(self, seconds: float) -> None:
        self.clock.now += seconds
        self.dispatcher.poke()
        await settle()

    async def until(self, state: str, n: int = 1) -> list[DeliveryView]:
        async with asyncio.timeout(WAIT_S):
            while len(found := self.deliveries(state)) < n:
                await asyncio.sleep(0.01)
        return found


async def settle() -> None:
    """Let every ready task run (lanes re-scan after a poke) without waiting on time."""
    for _ in range(20):
        await asyncio.sleep(0)


def loopback(**overrides: object) -> WebhooksConfig:
    return WebhooksConfig(allow_private=True, **overrides)  # type: ignore[arg-type]


@pytest.fixture
async def receiver() -> AsyncIterator[WebhookReceiver]:
    r = await WebhookReceiver().start()
    yield r
    await r.stop()


@pytest.fixture
def make_world(tmp_path: Path) -> Iterator[object]:
    worlds: list[World] = []

    def make(settings: WebhooksConfig) -> World:
        worlds.append(World(tmp_path, settings))
        return worlds[-1]

    yield make
    for w in worlds:
        w.db.close()


# ------------------------------------------------------------------------------ policy


def test_backoff_is_full_jitter_under_a_doubling_ceiling() -> None:
    rng = random.Random(1)
    for attempt, ceiling in [(1, 0.5), (2, 1.0), (3, 2.0), (10, 60.0), (30, 60.0)]:
        delays = [retry_delay(attempt, 0.5, 60.0, None, rng) for _ in range(2000)]
        assert min(delays) >= 0.0 and max(delays) <= ceiling
        assert min(delays) < ceiling * 0.05 and max(delays) > ceiling * 0.95  # the full range
    assert retry_delay(1, 0.5, 60.0, 30.0, rng) == 30.0  # a longer Retry-After wins


def test_retry_after_takes_seconds_or_an_http_date() -> None:
    assert parse_retry_after("7", 0.0) == 7.0
    assert parse_retry_after("Wed, 21 Oct 2015 07:28:00 GMT", 1445412470.0) == 10.0
    assert parse_retry_after("soon", 0.0) is None
    assert parse_retry_after(None, 0.0) is None


# ------------------------------------------------------------------------------ dispatcher


async def test_503_with_retry_after_is_retried_exactly_then(
    make_world: object, receiver: WebhookReceiver
) -> None:
    w: World = make_world(loopback())  # type: ignore[operator]
    receiver.script.append(Answer(503, {"Retry-After": "30"}))
    w.register(receiver.url)
    await w.dispatcher.start()
    try:
        w.publish("a")
        first = (await receiver.count(1))[0]
        async with asyncio.timeout(WAIT_S):
            while not (d := w.deliveries())[0].attempts:
                await asyncio.sleep(0.01)
        assert d[0].state == "pending" and d[0].last_status == 503
        assert d[0].next_at == pytest.approx(w.clock.now + 30.0)
        await w.advance(29.9)
        assert len(receiver.received) == 1  # not before Retry-After
        await w.advance(0.1)
        second = (await receiver.count(2))[1]
        await w.until("delivered")
        assert second.webhook_id == first.webhook_id
        assert second.verified(w.secret) == first.verified(w.secret)
    finally:
        await w.dispatcher.close()


async def test_a_slow_receiver_times_out_and_the_retry_carries_the_same_id(
    make_world: object, receiver: WebhookReceiver
) -> None:
    # Every retry is due within 1 s of the clock, so each `advance(1.0)` releases the next one;
    # attempts never run out, however many a loaded machine lets time out.
    settings = loopback(timeout_s=0.2, backoff_base_s=1.0, backoff_max_s=1.0, max_attempts=10_000)
    w: World = make_world(settings)  # type: ignore[operator]
    hold = asyncio.Event()

    def respond(r: Received) -> Answer:
        # The first request the receiver *reads* is held past the client's timeout. Which attempt
        # that is depends on load: on a busy machine an attempt can time out before the server
        # reads it at all, so the test keeps releasing retries until one is answered in time.
        return Answer(200, hold=hold) if not receiver.received else Answer(200)

    receiver.respond = respond
    w.register(receiver.url)
    await w.dispatcher.start()
    try:
        w.publish("a")
        async with asyncio.timeout(WAIT_S):
            while not w.deliveries("delivered"):
                await w.advance(1.0)
                await asyncio.sleep(0.05)
        history = w.deliveries("delivered")[0].history
        assert len(receiver.received) >= 2
        assert {r.webhook_id for r in receiver.received} == {receiver.received[0].webhook_id}
        assert [(a.status, a.error) for a in history[:-1]] == [
            (None, "TimeoutError: timed out")
        ] * (len(history) - 1)
        assert len(history) >= 2 and history[-1].status == 200
    finally:
        hold.set()
        await w.dispatcher.close()


async def test_one_handoffs_events_wait_for_each_other_while_others_go_on(
    make_world: object, receiver: WebhookReceiver
) -> None:
    w: World = make_world(loopback(concurrency=4))  # type: ignore[operator]
    failed_once: set[str] = set()

    def respond(r: Received) -> Answer:
        if r.handoff_id == "a" and r.type == "handoff.created" and not failed_once:
            failed_once.add(r.webhook_id)
            return Answer(500)
        return Answer(200)

    receiver.respond = respond
    w.register(receiver.url)
    await w.dispatcher.start()
    try:
        w.publish("a")
        w.publish("b")
        w.publish("a", completed=True)
        w.publish("b", completed=True)
        await w.until("delivered", 2)  # b's two events
        # a's refused attempt is recorded (its retry due within 1 s of *this* clock) before the
        # clock moves: b's two round trips may well end first on a loaded machine.
        async with asyncio.timeout(WAIT_S):
            while not [d for d in w.deliveries() if d.handoff_id == "a" and d.attempts]:
                await asyncio.sleep(0.01)
        sent = [(r.handoff_id, r.type) for r in receiver.received]
        assert ("a", "handoff.completed") not in sent  # a's second waits for its first
        assert sent.index(("b", "handoff.created")) < sent.index(("b", "handoff.completed"))
        await w.advance(1.0)
        await w.until("delivered", 4)
        a_sent = [r.type for r in receiver.received if r.handoff_id == "a"]
        assert a_sent == ["handoff.created", "handoff.created", "handoff.completed"]
    finally:
        await w.dispatcher.close()


async def test_attempt_and_age_ceilings_end_a_delivery_as_failed(
    make_world: object, receiver: WebhookReceiver
) -> None:
    w: World = make_world(loopback(max_attempts=3, max_age_s=100.0))  # type: ignore[operator]
    receiver.default = Answer(500)
    w.register(receiver.url)
    await w.dispatcher.start()
    try:
        w.publish("a")
        for n in (1, 2):
            await receiver.count(n)
            async with asyncio.timeout(WAIT_S):
                while w.deliveries()[0].attempts < n:
                    await asyncio.sleep(0.01)
            await w.advance(10.0)
        failed = await w.until("failed")
        assert failed[0].attempts == 3 and len(receiver.received) == 3
        receiver.script.append(Answer(503, {"Retry-After": "500"}))  # beyond max_age_s
        w.publish("b")
        failed = await w.until("failed", 2)
        assert failed[0].handoff_id == "b" and failed[0].attempts == 1
    finally:
        await w.dispatcher.close()


async def test_pending_deliveries_resume_from_the_outbox_after_a_restart(
    make_world: object, receiver: WebhookReceiver
) -> None:
    w: World = make_world(loopback())  # type: ignore[operator]
    w.register(receiver.url)
    w.publish("a")  # committed; this dispatcher never ran (the process "died")
    w.publish("a", completed=True)
    w.db.close()  # the process died: its lock on the state directory went with it
    again: World = make_world(loopback())  # type: ignore[operator]
    again.endpoint_id, again.secret = w.endpoint_id, w.secret
    await again.dispatcher.start()
    try:
        got = await receiver.count(2)
        assert [r.verified(w.secret)["type"] for r in got] == [
            "handoff.created",
            "handoff.completed",
        ]
        await again.until("delivered", 2)
    finally:
        await again.dispatcher.close()


@pytest.mark.parametrize("host", ["127.0.0.1", "localhost"])
async def test_a_private_target_is_refused_at_send_time_too(
    make_world: object, receiver: WebhookReceiver, host: str
) -> None:
    # Registered while allowed (or resolving elsewhere); the dispatcher checks every connection.
    w: World = make_world(WebhooksConfig(allow_private=False))  # type: ignore[operator]
    w.register(receiver.url.replace("127.0.0.1", host))
    await w.dispatcher.start()
    try:
        w.publish("a")
        async with asyncio.timeout(WAIT_S):
            while not w.deliveries()[0].attempts:
                await asyncio.sleep(0.01)
        attempt = w.deliveries()[0].history[0]
        assert attempt.status is None and "non-public" in (attempt.error or "")
        assert receiver.received == []
    finally:
        await w.dispatcher.close()


async def test_a_lane_ends_when_its_endpoint_has_nothing_pending(
    make_world: object, receiver: WebhookReceiver
) -> None:
    w: World = make_world(loopback())  # type: ignore[operator]
    w.register(receiver.url)
    await w.dispatcher.start()
    try:
        for n in (1, 2):
            w.publish("a" if n == 1 else "b")
            await receiver.count(n)
            await w.until("delivered", n)
            async with asyncio.timeout(WAIT_S):
                while w.dispatcher.lanes:
                    await asyncio.sleep(0.01)
    finally:
        await w.dispatcher.close()


# ------------------------------------------------------------------------------ backlog


class CountingDelivery(Delivery):
    """A delivery that counts every read of its fields, by whether it is part of the backlog."""

    reads: ClassVar[Counter[str]] = Counter()

    def __getattribute__(self, name: str) -> Any:
        if not name.startswith("__"):
            old = object.__getattribute__(self, "handoff_id").startswith("old")
            CountingDelivery.reads["backlog" if old else "new"] += 1
        return object.__getattribute__(self, name)


def seed(w: World, handoffs: int, per_handoff: int, wait_s: float) -> list[Delivery]:
    """Committed deliveries of handoffs `old0`... that failed once and are due in `wait_s`."""
    with w.db.transaction() as tx:
        out = [
            d
            for n in range(per_handoff)
            for i in range(handoffs)
            for d in w.outbox.enqueue(
                tx,
                w.bus.publish(
                    HandoffCompleted(
                        handoff_id=f"old{i}", role="decode", bytes=n, seconds=0.1, verified=False
                    )
                ),
                None,
            )
        ]
    for d in out:
        w.outbox.record_attempt(d, w.clock(), 0.001, None, "refused", "pending", w.clock() + wait_s)
    w.outbox.flush()
    return out


@pytest.fixture
def dead_url() -> Iterator[str]:
    """A port that is bound but never listens: every connection is refused at once."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        yield f"http://127.0.0.1:{s.getsockname()[1]}/hook"


async def test_new_events_do_not_scan_a_dead_endpoints_backlog(
    make_world: object, dead_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # 20,000 deliveries of 5,000 handoffs wait an hour to retry; 1,000 new handoffs' events are
    # each attempted once. A lane that scanned its backlog per wake would read the backlog's
    # deliveries thousands of times per wake; this one never touches them after loading.
    monkeypatch.setattr(outbox_module, "Delivery", CountingDelivery)
    w: World = make_world(loopback(max_held=25_000))  # type: ignore[operator]
    w.register(dead_url)
    seed(w, 5_000, 4, 3600.0)
    await w.dispatcher.start()
    assert w.dispatcher.held_count == 20_000
    CountingDelivery.reads.clear()
    try:
        for i in range(1_000):
            w.publish(f"new{i}")
            if i % 50 == 49:
                await asyncio.sleep(0)  # the lane runs between publishes, as in the service
        async with asyncio.timeout(WAIT_S):
            while w.dispatcher.stats.attempts < 1_000:
                assert CountingDelivery.reads["backlog"] == 0
                await asyncio.sleep(0.01)
        await settle()
        assert w.dispatcher.stats.attempts == 1_000  # each new one once; the backlog not yet
        assert w.dispatcher.pending_count == 21_000
        assert CountingDelivery.reads["backlog"] == 0
        assert CountingDelivery.reads["new"] <= 1_000 * 40  # a bounded number per event
    finally:
        await w.dispatcher.close()


async def test_beyond_max_held_deliveries_wait_in_the_outbox_in_order_and_none_is_lost(
    make_world: object, receiver: WebhookReceiver
) -> None:
    w: World = make_world(loopback(max_held=8, concurrency=4))  # type: ignore[operator]
    up = False
    accepted: list[Received] = []

    def respond(r: Received) -> Answer:
        if up:
            accepted.append(r)
            return Answer(200)
        return Answer(503)

    receiver.respond = respond
    w.register(receiver.url)
    await w.dispatcher.start()
    try:
        for completed in (False, True):
            for i in range(15):
                w.publish(f"h{i}", completed=completed)
        assert w.dispatcher.held_count == 8 and w.dispatcher.pending_count == 30
        await receiver.count(8)  # the held handoffs' first events, each refused once
        assert {r.handoff_id for r in receiver.received} == {f"h{i}" for i in range(8)}
        up = True
        async with asyncio.timeout(WAIT_S):
            while w.dispatcher.pending_count:
                assert w.dispatcher.held_count <= 8
                await w.advance(1.0)  # every retry is due within 0.5 s
                await asyncio.sleep(0.01)
        assert len(w.deliveries("delivered")) == 30
        assert len({r.webhook_id for r in accepted}) == len(accepted) == 30
        for i in range(15):
            mine = [r.type for r in accepted if r.handoff_id == f"h{i}"]
            assert mine == ["handoff.created", "handoff.completed"], i
    finally:
        await w.dispatcher.close()


async def test_a_restart_holds_max_held_and_loads_the_rest_as_the_lane_drains(
    make_world: object, receiver: WebhookReceiver
) -> None:
    w: World = make_world(loopback())  # type: ignore[operator]
    w.register(receiver.url)
    for completed in (False, True):
        for i in range(10):
            w.publish(f"h{i}", completed=completed)  # committed; this dispatcher never ran
    w.db.close()  # the process died: its lock on the state directory went with it
    again: World = make_world(loopback(max_held=5))  # type: ignore[operator]
    again.endpoint_id, again.secret = w.endpoint_id, w.secret
    await again.dispatcher.start()
    try:
        assert again.dispatcher.held_count == 5 and again.dispatcher.pending_count == 20
        got = await receiver.count(20)
        await again.until("delivered", 20)
        for i in range(10):
            mine = [r.type for r in got if r.handoff_id == f"h{i}"]
            assert mine == ["handoff.created", "handoff.completed"], i
        async with asyncio.timeout(WAIT_S):
            while again.dispatcher.lanes:
                await asyncio.sleep(0.01)
        assert again.dispatcher.pending_count == 0
    finally:
        await again.dispatcher.close()


async def test_a_manual_retry_is_held_even_while_the_lane_is_beyond_its_cap(
    make_world: object, receiver: WebhookReceiver
) -> None:
    w: World = make_world(loopback(max_held=2, max_attempts=1))  # type: ignore[operator]
    receiver.default = Answer(500)
    w.register(receiver.url)
    await w.dispatcher.start()
    try:
        w.publish("a")
        (failed,) = await w.until("failed")
        # The lane is at its cap with 2 held (due in an hour), and 3 more wait in the outbox.
        for d in seed(w, 5, 1, 3600.0):
            w.dispatcher.add([d])
        assert w.dispatcher.held_count == 2 and w.dispatcher.pending_count == 5
        receiver.default = Answer(200)
        w.dispatcher.add([w.outbox.retry(w.endpoint_id, failed.id, w.clock())])
        assert w.dispatcher.held_count == 3 and w.dispatcher.pending_count == 6
        await w.until("delivered")
        assert receiver.received[-1].webhook_id == failed.webhook_id
    finally:
        await w.dispatcher.close()
