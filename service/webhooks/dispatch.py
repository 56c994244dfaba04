"""The webhook dispatcher: sends the outbox's pending deliveries, signed, until each one ends.

Started and stopped by `kvhandoff.service.runtime.persistence`; fed by its bus listener (`add`,
after the outbox rows are committed) and by the retry route (`add`); told by the routes when an
endpoint goes away (`drop`). One lane (a task) per endpoint starts deliveries oldest first, at most
`webhooks.concurrency` at a time, and never two of the same handoff at once, so a receiver sees
each handoff's events in sequence order.

A lane's cost per event and per attempt does not grow with its backlog (an endpoint that is down
collects one; the lane runs on the loop that serves handoffs): it queues each handoff's
deliveries in order and keeps only each idle handoff's head in a heap by due time, so a wake
pops what is due and sleeps until the next head is; an attempt that ends promotes its handoff's
next delivery. At most `webhooks.max_held` deliveries of an endpoint are held in memory: beyond
that they stay in the outbox, where they are committed already, and the lane loads them oldest
first (the same query as at start-up) once it has drained to half of that. An attempt's outcome:

- 2xx: delivered. 410: the endpoint is disabled and its pending deliveries cancelled.
- anything else (status, timeout, refused connection, refused target): retried after a delay
  drawn uniformly from [0, min(backoff_max_s, backoff_base_s * 2**(attempt - 1))] ("full
  jitter"), or after `Retry-After` when that is longer; given up (`failed`) after
  `max_attempts` attempts or `max_age_s`.

Every attempt is committed (attempt row + delivery state) before the next one is considered, so
a restarted dispatcher resumes where this one stopped; a crash between a receiver's 2xx and that
commit sends the delivery again (at least once; receivers dedupe by `webhook-id`).
"""

from __future__ import annotations

import asyncio
import contextlib
import email.utils
import functools
import heapq
import logging
import random
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from kvhandoff.service.config import WebhooksConfig
from kvhandoff.service.tasks import TaskOwner
from kvhandoff.service.webhooks.outbox import Delivery, Endpoint, Outbox
from kvhandoff.service.webhooks.sender import Sender, SendError
from kvhandoff.service.webhooks.signatures import sign
from kvhandoff.service.webhooks.targets import TargetPolicy
from kvhandoff.service.webhooks.views import DeliveryState

log = logging.getLogger("kvhandoff.webhooks")
USER_AGENT = "kvhandoff-webhooks/1"


def retry_delay(
    attempt: int, base_s: float, max_s: float, retry_after_s: float | None, rng: random.Random
) -> float:
    """Seconds before attempt `attempt + 1`, after `attempt` failed ones (full jitter)."""
    ceiling = min(max_s, base_s * 2 ** max(0, attempt - 1))
    delay = rng.uniform(0.0, ceiling)
    return max(delay, retry_after_s or 0.0)


def parse_retry_after(value: str | None, now: float) -> float | None:
    """`Retry-After` as seconds from now: delta-seconds or an HTTP date; None if absent/bad."""
    if not value:
        return None
    value = value.strip()
    if value.isdigit():
        return float(value)
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    return max(0.0, when.timestamp() - now)


@dataclass
class _Lane:
    """One endpoint's deliveries held in memory, and where the rest wait in the outbox."""

    endpoint: Endpoint
    held: dict[int, Delivery] = field(default_factory=dict)  # by id: in memory, incl. in flight
    #: Each handoff's held deliveries in sequence order; the head is in flight or in `ready`.
    queues: dict[str, deque[Delivery]] = field(default_factory=dict)
    #: Heads of the handoffs with nothing in flight: a heap of (due time, delivery id, handoff).
    ready: list[tuple[float, int, str]] = field(default_factory=list)
    busy: set[str] = field(default_factory=set)  # handoffs with a delivery in flight
    #: While some of this endpoint's pending deliveries are in the outbox only: every pending
    #: one with an id up to here is held, none above it is, and `unloaded` of them are pending.
    loaded_to: int | None = None
    unloaded: int = 0
    top: int = 0  # the highest delivery id held so far
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    task: asyncio.Task[None] | None = None
    attempts: set[asyncio.Task[None]] = field(default_factory=set)

    def hold(self, d: Delivery) -> None:
        """Queue `d` behind its handoff's held deliveries; a new head becomes ready."""
        queue = self.queues.get(d.handoff_id)
        self.held[d.id] = d
        self.top = max(self.top, d.id)
        if queue is None:
            self.queues[d.handoff_id] = deque([d])
            heapq.heappush(self.ready, (d.next_at, d.id, d.handoff_id))
            self.wake.set()
        else:
            queue.append(d)

    def release(self, d: Delivery) -> None:
        """`d`'s attempt ended: it is ready again if still pending, else its successor is."""
        self.busy.discard(d.handoff_id)
        queue = self.queues[d.handoff_id]
        if d.id not in self.held:
            queue.popleft()
            if not queue:
                del self.queues[d.handoff_id]
                self.wake.set()  # the lane may have drained (load more, or end)
                return
            d = queue[0]
        heapq.heappush(self.ready, (d.next_at, d.id, d.handoff_id))
        self.wake.set()


@dataclass
class WebhookStats:
    """Cumulative delivery counters since start (read at scrape time by the metrics)."""

    attempts: int = 0
    delivered: int = 0
    #: Attempts that did not deliver and were scheduled again.
    retried: int = 0
    #: Deliveries given up after `max_attempts` or `max_age_s`.
    failed: int = 0
    #: Endpoints disabled by a 410 answer.
    disabled: int = 0
    #: Seconds each delivered attempt took, summed (with `delivered`, the mean latency).
    delivered_latency_s: float = 0.0


class Dispatcher:
    def __init__(
        self,
        outbox: Outbox,
        settings: WebhooksConfig,
        *,
        clock: Callable[[], float] = time.time,
        rng: random.Random | None = None,
    ) -> None:
        self._outbox = outbox
        self._settings = settings
        self._clock = clock
        self._rng = rng or random.Random()
        self.policy = TargetPolicy(settings.allow_hosts, settings.allow_private)
        self._lanes: dict[str, _Lane] = {}
        self._tasks = TaskOwner("webhooks")  # every lane and attempt
        self._sender: Sender | None = None
        self.stats = WebhookStats()

    async def start(self) -> None:
        """Resume every pending delivery from the outbox (each lane loads up to its cap)."""
        self._sender = Sender(self.policy, USER_AGENT)
        for endpoint_id, (first, count) in self._outbox.pending_by_endpoint().items():
            lane = self._lane(endpoint_id)
            if lane is not None:
                lane.loaded_to, lane.unloaded = first - 1, count
                self._load(lane)

    async def close(self) -> None:
        """Stop every lane and attempt; what was not delivered stays pending in the outbox."""
        await self._tasks.close()
        self._lanes.clear()
        if self._sender is not None:
            await self._sender.close()

    def add(self, deliveries: Iterable[Delivery]) -> None:
        """Queue pending deliveries on their endpoints' lanes once they are committed (the
        group commit, `Database.after_commit`): a webhook never tells of an event a killed
        process did not keep."""
        self._outbox.db.after_commit(functools.partial(self._hold, list(deliveries)))

    def _hold(self, deliveries: list[Delivery]) -> None:
        """Each in O(log n); those beyond a lane's cap are left to the outbox, to be loaded as
        the lane drains."""
        cap = self._settings.max_held
        for d in deliveries:
            lane = self._lane(d.endpoint_id)
            if lane is None or d.id in lane.held:
                continue
            if lane.loaded_to is None and len(lane.held) >= cap and d.id > lane.top:
                # Every pending delivery of the lane so far is held (ids are committed, and
                # added, in order): from here on the outbox holds the newer ones.
                lane.loaded_to = lane.top
            if lane.loaded_to is not None and d.id > lane.loaded_to:
                lane.unloaded += 1
            else:
                # An older id is a manual retry of a delivery that had ended: held even beyond
                # the cap (retries come one request at a time), as the outbox cursor is past it.
                lane.hold(d)

    def drop(self, endpoint_id: str) -> None:
        """Forget an endpoint's lane (deleted or disabled): its attempts are cancelled."""
        lane = self._lanes.pop(endpoint_id, None)
        if lane is None:
            return
        for task in [*lane.attempts, *filter(None, [lane.task])]:
            if task is not asyncio.current_task():
                task.cancel()

    def poke(self) -> None:
        """Re-check every lane now (a test that moved its clock forward)."""
        for lane in self._lanes.values():
            lane.wake.set()

    @property
    def lanes(self) -> int:
        """Endpoints with a running lane (those with deliveries pending)."""
        return len(self._lanes)

    @property
    def pending_count(self) -> int:
        """Deliveries pending (held in memory or waiting in the outbox for their lane)."""
        return sum(len(lane.held) + lane.unloaded for lane in self._lanes.values())

    @property
    def held_count(self) -> int:
        """Deliveries held in memory (at most `max_held` per endpoint, plus manual retries)."""
        return sum(len(lane.held) for lane in self._lanes.values())

    def _lane(self, endpoint_id: str) -> _Lane | None:
        lane = self._lanes.get(endpoint_id)
        if lane is None:
            endpoint = self._outbox.endpoints.get(endpoint_id)
            if endpoint is None or endpoint.disabled or self._sender is None:
                return None
            if self._tasks.closing:
                return None  # stopping: what is pending stays in the outbox for the next start
            lane = self._lanes[endpoint_id] = _Lane(endpoint)
            lane.task = self._tasks.spawn(self._run(lane), f"kvhandoff-webhooks-{endpoint_id}")
        return lane

    def _load(self, lane: _Lane) -> None:
        """Hold the lane's oldest deliveries from the outbox, up to its cap."""
        assert lane.loaded_to is not None
        room = self._settings.max_held - len(lane.held)
        rows = self._outbox.pending(lane.endpoint.id, lane.loaded_to, room)
        for d in rows:
            if d.id not in lane.held:
                lane.hold(d)
                lane.unloaded = max(0, lane.unloaded - 1)
        if len(rows) < room:  # the outbox has no more: the lane holds all its pending ones
            lane.loaded_to, lane.unloaded = None, 0
        elif rows:
            lane.loaded_to = rows[-1].id

    async def _run(self, lane: _Lane) -> None:
        limit = self._settings.concurrency
        low_water = self._settings.max_held // 2
        while True:
            lane.wake.clear()
            if lane.loaded_to is not None and len(lane.held) <= low_water:
                self._load(lane)
            if not lane.held:
                # Nothing left (an attempt in flight keeps its delivery held): end the lane;
                # `add` starts a new one. A callback URL's lane lives only this long.
                if self._lanes.get(lane.endpoint.id) is lane:
                    del self._lanes[lane.endpoint.id]
                return
            now = self._clock()
            ready = lane.ready
            while ready and ready[0][0] <= now and len(lane.busy) < limit:
                _, _, handoff_id = heapq.heappop(ready)
                self._start(lane, lane.queues[handoff_id][0])
            timeout = None
            if ready and len(lane.busy) < limit:
                timeout = max(0.0, ready[0][0] - now)
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(timeout):
                    await lane.wake.wait()

    def _start(self, lane: _Lane, d: Delivery) -> None:
        d.sending = True
        lane.busy.add(d.handoff_id)
        task = self._tasks.spawn(self._attempt(lane, d), f"kvhandoff-webhook-{d.id}")
        lane.attempts.add(task)
        task.add_done_callback(lane.attempts.discard)

    async def _attempt(self, lane: _Lane, d: Delivery) -> None:
        try:
            started_at = self._clock()
            status, retry_after, error, latency = await self._send(lane.endpoint, d)
            self._settle(lane, d, started_at, status, retry_after, error, latency)
        finally:
            d.sending = False
            lane.release(d)

    async def _send(
        self, endpoint: Endpoint, d: Delivery
    ) -> tuple[int | None, str | None, str | None, float]:
        """One POST: (status, Retry-After, error, latency_s); never raises for the network."""
        assert self._sender is not None
        timestamp = int(time.time())  # the receiver checks it against its own clock
        headers = (
            ("webhook-id", d.msg_id),
            ("webhook-timestamp", str(timestamp)),
            ("webhook-signature", sign(endpoint.key, d.msg_id, timestamp, d.body)),
        )
        started = time.perf_counter()
        # A delivery loaded from the outbox may be of the open group: on disk before it is sent.
        await self._outbox.db.committed()
        try:
            answer = await self._sender.post(
                endpoint.url, headers, d.body, self._settings.timeout_s
            )
        except TimeoutError:
            return None, None, "TimeoutError: timed out", time.perf_counter() - started
        except SendError as exc:
            return None, None, str(exc), time.perf_counter() - started
        latency = time.perf_counter() - started
        status = answer.status
        return (
            status,
            answer.retry_after,
            None if 200 <= status < 300 else f"HTTP {status}",
            latency,
        )

    def _settle(
        self,
        lane: _Lane,
        d: Delivery,
        started_at: float,
        status: int | None,
        retry_after: str | None,
        error: str | None,
        latency_s: float,
    ) -> None:
        now = self._clock()
        if lane.endpoint.id not in self._outbox.endpoints:
            return  # deleted while the attempt ran
        self.stats.attempts += 1
        state: DeliveryState
        if error is None:
            state, next_at = "delivered", now
            self.stats.delivered += 1
            self.stats.delivered_latency_s += latency_s
        elif status == 410:
            self.stats.disabled += 1
            self._outbox.record_attempt(d, started_at, latency_s, status, error, "cancelled", now)
            lane.held.pop(d.id, None)
            self._outbox.disable(lane.endpoint.id, "the receiver answered 410 Gone", now)
            log.warning("webhook endpoint %s answered 410: disabled", lane.endpoint.id)
            self.drop(lane.endpoint.id)
            return
        else:
            s = self._settings
            tried = d.attempts + 1 - d.budget_from
            wait = retry_delay(
                tried,
                s.backoff_base_s,
                s.backoff_max_s,
                parse_retry_after(retry_after, now),
                self._rng,
            )
            next_at = now + wait
            exhausted = tried >= s.max_attempts or next_at - d.since > s.max_age_s
            state = "failed" if exhausted else "pending"
            if exhausted:
                self.stats.failed += 1
            else:
                self.stats.retried += 1
        self._outbox.record_attempt(d, started_at, latency_s, status, error, state, next_at)
        if state != "pending":
            lane.held.pop(d.id, None)
