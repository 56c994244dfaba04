"""The webhook dispatcher: sends the outbox's pending deliveries, signed, until each one ends.

Started and stopped by `service.runtime.persistence`; fed by its bus listener (`add`, after the
outbox rows are committed) and by the retry route (`add`); told by the routes when an endpoint
goes away (`drop`). One lane (a task) per endpoint starts deliveries oldest first, at most
`webhooks.concurrency` at a time, and never two of the same handoff at once, so a receiver sees
each handoff's events in sequence order. An attempt's outcome:

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
import logging
import random
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from service.config import WebhooksConfig
from service.http.signatures import sign
from service.runtime.outbox import Delivery, Endpoint, Outbox
from service.runtime.sender import Sender, SendError
from service.runtime.targets import TargetPolicy
from service.runtime.webhook_views import DeliveryState

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
    endpoint: Endpoint
    pending: dict[int, Delivery] = field(default_factory=dict)  # by id: oldest first
    busy: set[str] = field(default_factory=set)  # handoffs with a delivery in flight
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    task: asyncio.Task[None] | None = None
    attempts: set[asyncio.Task[None]] = field(default_factory=set)


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
        self._sender: Sender | None = None
        self.stats = WebhookStats()

    async def start(self) -> None:
        """Resume every pending delivery from the outbox."""
        self._sender = Sender(self.policy, USER_AGENT)
        self.add(self._outbox.pending())

    async def close(self) -> None:
        """Stop every lane and attempt; what was not delivered stays pending in the outbox."""
        tasks: list[asyncio.Task[None]] = []
        for lane in self._lanes.values():
            tasks += [*lane.attempts, *filter(None, [lane.task])]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._lanes.clear()
        if self._sender is not None:
            await self._sender.close()

    def add(self, deliveries: Iterable[Delivery]) -> None:
        """Queue committed pending deliveries on their endpoints' lanes."""
        for d in deliveries:
            lane = self._lane(d.endpoint_id)
            if lane is None:
                continue
            lane.pending[d.id] = d
            lane.wake.set()

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
        return sum(len(lane.pending) for lane in self._lanes.values())

    def _lane(self, endpoint_id: str) -> _Lane | None:
        lane = self._lanes.get(endpoint_id)
        if lane is None:
            endpoint = self._outbox.endpoints.get(endpoint_id)
            if endpoint is None or endpoint.disabled or self._sender is None:
                return None
            lane = self._lanes[endpoint_id] = _Lane(endpoint)
            lane.task = asyncio.get_running_loop().create_task(
                self._run(lane), name=f"kvhandoff-webhooks-{endpoint_id}"
            )
        return lane

    async def _run(self, lane: _Lane) -> None:
        limit = self._settings.concurrency
        while True:
            lane.wake.clear()
            if not lane.pending:
                # Nothing left (an attempt in flight keeps its delivery pending): end the lane;
                # `add` starts a new one. A callback URL's lane lives only this long.
                if self._lanes.get(lane.endpoint.id) is lane:
                    del self._lanes[lane.endpoint.id]
                return
            now = self._clock()
            next_due: float | None = None
            seen: set[str] = set()
            for d in lane.pending.values():
                if len(lane.busy) >= limit:
                    break
                if d.sending or d.handoff_id in seen or d.handoff_id in lane.busy:
                    seen.add(d.handoff_id)  # a handoff's later events wait for its earlier ones
                    continue
                seen.add(d.handoff_id)
                if d.next_at <= now:
                    self._start(lane, d)
                else:
                    next_due = d.next_at if next_due is None else min(next_due, d.next_at)
            timeout = None if next_due is None else max(0.0, next_due - now)
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(timeout):
                    await lane.wake.wait()

    def _start(self, lane: _Lane, d: Delivery) -> None:
        d.sending = True
        lane.busy.add(d.handoff_id)
        task = asyncio.get_running_loop().create_task(self._attempt(lane, d))
        lane.attempts.add(task)
        task.add_done_callback(lane.attempts.discard)

    async def _attempt(self, lane: _Lane, d: Delivery) -> None:
        try:
            started_at = self._clock()
            status, retry_after, error, latency = await self._send(lane.endpoint, d)
            self._settle(lane, d, started_at, status, retry_after, error, latency)
        finally:
            d.sending = False
            lane.busy.discard(d.handoff_id)
            lane.wake.set()

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
            lane.pending.pop(d.id, None)
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
            lane.pending.pop(d.id, None)
