"""The webhook outbox: endpoints, and one durable delivery row per (event, endpoint).

Called by the bus listener in `kvhandoff.service.runtime.persistence` (`enqueue`, inside the
transaction that commits the event before anyone sees it), by the dispatcher
(`kvhandoff.service.webhooks.dispatch`: `pending_by_endpoint` and `pending` to load its lanes,
`record_attempt`, `disable`) and by the webhook routes (`kvhandoff.service.api.webhooks`: endpoints,
deliveries, retry). Endpoints live in memory too, so matching an event costs no query; an event no
endpoint wants is not stored at all.

Delivery states: `pending` (to be attempted at `next_at`) → `delivered` (a 2xx) | `failed`
(attempts or age ceiling reached) | `cancelled` (its endpoint was disabled by a 410 or deleted).
A manual retry puts any delivery back to `pending` with a fresh attempt and age budget.
"""

from __future__ import annotations

import asyncio
import datetime
import json
import secrets
import sqlite3
from dataclasses import dataclass, field
from typing import Any

import msgspec

from kvhandoff.pipelines.errors import ConflictError, NotFoundError
from kvhandoff.pipelines.events import Event, HandoffCreated, event_tag
from kvhandoff.service.storage import Database
from kvhandoff.service.webhooks.signatures import new_secret, secret_key
from kvhandoff.service.webhooks.views import (
    AttemptView,
    DeliveryPage,
    DeliveryState,
    EndpointCreated,
    EndpointView,
    delivery_view,
    endpoint_view,
)

_encoder = msgspec.json.Encoder()


@dataclass
class Endpoint:
    id: str
    url: str
    key: bytes
    types: tuple[str, ...]
    handoff_id: str | None
    disabled: bool = False

    def wants(self, tag: str) -> bool:
        return not self.disabled and (not self.types or tag.startswith(self.types))


@dataclass
class Delivery:
    """One pending delivery, as the dispatcher holds it."""

    id: int
    endpoint_id: str
    handoff_id: str
    msg_id: str  # the `webhook-id`: stable across attempts
    body: bytes
    attempts: int
    budget_from: int  # attempts before the last manual retry (the ceiling counts from here)
    since: float  # creation or last manual retry (the age ceiling counts from here)
    next_at: float
    sending: bool = field(default=False)


def webhook_body(event: Event) -> bytes:
    """The Standard Webhooks payload: `{type, timestamp, data}` (data: the event itself)."""
    at = datetime.datetime.fromtimestamp(event.at, datetime.UTC).isoformat().replace("+00:00", "Z")
    data = msgspec.to_builtins(event)
    return _encoder.encode({"type": event_tag(event), "timestamp": at, "data": data})


class Outbox:
    def __init__(self, db: Database, callback_secret: str | None, callback_types: list[str]):
        self._db = db
        self._callback_key = secret_key(callback_secret) if callback_secret else None
        self._callback_secret = callback_secret
        self._callback_types = tuple(callback_types)
        self.endpoints: dict[str, Endpoint] = {}
        self._callbacks: dict[str, Endpoint] = {}  # handoff id → its callback endpoint
        self._registered: dict[str, Endpoint] = {}  # endpoints for every handoff
        self._attempts: list[tuple[Any, ...]] = []  # recorded, not yet written (see flush)
        self._updates: list[tuple[Any, ...]] = []
        self._flush_scheduled = False
        rows = db.conn.execute(
            "SELECT id, url, secret, types, handoff_id, disabled_at FROM endpoints"
        )
        for eid, url, secret, types, handoff_id, disabled_at in rows:
            self._remember(
                Endpoint(
                    eid,
                    url,
                    secret_key(secret),
                    tuple(json.loads(types)),
                    handoff_id,
                    disabled_at is not None,
                )
            )

    @property
    def db(self) -> Database:
        return self._db

    @property
    def registered_count(self) -> int:
        """Endpoints registered through `POST /v1/webhooks` (not per-handoff callbacks)."""
        return len(self._registered)

    @property
    def callbacks_enabled(self) -> bool:
        return self._callback_key is not None

    def _remember(self, ep: Endpoint) -> None:
        self.endpoints[ep.id] = ep
        if ep.handoff_id is not None:
            self._callbacks[ep.handoff_id] = ep
        else:
            self._registered[ep.id] = ep

    def _msg_id(self, event_id: int) -> str:
        return f"msg_{self._db.instance}_{event_id}"

    # -- endpoints ------------------------------------------------------------------------

    def create_endpoint(
        self,
        url: str,
        types: list[str],
        secret: str | None,
        description: str,
        now: float,
        *,
        handoff_id: str | None = None,
    ) -> EndpointCreated:
        secret = secret or new_secret()
        key = secret_key(secret)  # callers validated it; a bad one is a bug here
        eid = ("cb_" if handoff_id else "ep_") + secrets.token_hex(8)
        with self._db.transaction() as tx:
            tx.execute(
                "INSERT INTO endpoints (id, url, secret, types, description, handoff_id,"
                " created_at) VALUES (?, ?, ?, ?, ?, ?, ?)",
                (eid, url, secret, json.dumps(types), description, handoff_id, now),
            )
        self._remember(Endpoint(eid, url, key, tuple(types), handoff_id))
        return EndpointCreated(
            id=eid,
            url=url,
            types=types,
            description=description,
            handoff_id=handoff_id,
            created_at=now,
            secret=secret,
        )

    def endpoint(self, endpoint_id: str) -> EndpointView:
        self.flush()
        row = self._db.conn.execute(
            "SELECT id, url, types, description, handoff_id, created_at, disabled_at,"
            " disabled_reason FROM endpoints WHERE id = ?",
            (endpoint_id,),
        ).fetchone()
        if row is None:
            raise NotFoundError(f"no webhook endpoint {endpoint_id!r}", field="id")
        return endpoint_view(row)

    def list_endpoints(self) -> list[EndpointView]:
        rows = self._db.conn.execute(
            "SELECT id, url, types, description, handoff_id, created_at, disabled_at,"
            " disabled_reason FROM endpoints WHERE handoff_id IS NULL ORDER BY created_at"
        )
        return [endpoint_view(row) for row in rows]

    def delete_endpoint(self, endpoint_id: str) -> None:
        self.endpoint(endpoint_id)  # 404 if unknown
        with self._db.transaction() as tx:
            tx.execute(
                "DELETE FROM attempts WHERE delivery_id IN"
                " (SELECT id FROM deliveries WHERE endpoint_id = ?)",
                (endpoint_id,),
            )
            tx.execute("DELETE FROM deliveries WHERE endpoint_id = ?", (endpoint_id,))
            tx.execute("DELETE FROM endpoints WHERE id = ?", (endpoint_id,))
        ep = self.endpoints.pop(endpoint_id, None)
        self._registered.pop(endpoint_id, None)
        if ep is not None and ep.handoff_id is not None:
            self._callbacks.pop(ep.handoff_id, None)

    def disable(self, endpoint_id: str, reason: str, now: float) -> None:
        """Stop delivering to an endpoint (it answered 410 Gone): cancel what is pending."""
        self.flush()
        with self._db.transaction() as tx:
            tx.execute(
                "UPDATE endpoints SET disabled_at = ?, disabled_reason = ? WHERE id = ?",
                (now, reason, endpoint_id),
            )
            tx.execute(
                "UPDATE deliveries SET state = 'cancelled', finished_at = ?, last_error = ?"
                " WHERE endpoint_id = ? AND state = 'pending'",
                (now, reason, endpoint_id),
            )
        if endpoint_id in self.endpoints:
            self.endpoints[endpoint_id].disabled = True

    # -- events → deliveries ----------------------------------------------------------------

    def wanted(self, event: Event, callback_url: str | None) -> bool:
        """Whether any endpoint (or the callback `event` would register) wants `event`."""
        if isinstance(event, HandoffCreated) and callback_url and self._callback_secret:
            return True
        tag = event_tag(event)
        callback = self._callbacks.get(event.handoff_id)
        if callback is not None and callback.wants(tag):
            return True
        return any(ep.wants(tag) for ep in self._registered.values())

    def enqueue(
        self, tx: sqlite3.Connection, event: Event, callback_url: str | None
    ) -> list[Delivery]:
        """Within `tx`: a delivery row for every endpoint that wants `event` (registering the
        handoff's callback endpoint on its creation). Returns them for the dispatcher."""
        tag = event_tag(event)
        hid = event.handoff_id
        if isinstance(event, HandoffCreated) and callback_url and self._callback_secret:
            eid = "cb_" + secrets.token_hex(8)
            tx.execute(
                "INSERT INTO endpoints (id, url, secret, types, handoff_id, created_at)"
                " VALUES (?, ?, ?, ?, ?, ?)",
                (
                    eid,
                    callback_url,
                    self._callback_secret,
                    json.dumps(self._callback_types),
                    hid,
                    event.at,
                ),
            )
            assert self._callback_key is not None
            self._remember(
                Endpoint(eid, callback_url, self._callback_key, self._callback_types, hid)
            )
        targets = [ep for ep in self._registered.values() if ep.wants(tag)]
        callback = self._callbacks.get(hid)
        if callback is not None and callback.wants(tag):
            targets.append(callback)
        if not targets:
            return []
        body = webhook_body(event)
        cur = tx.execute(
            "INSERT INTO events (type, handoff_id, body, created_at) VALUES (?, ?, ?, ?)",
            (tag, hid, body, event.at),
        )
        event_id = int(cur.lastrowid or 0)
        msg_id = self._msg_id(event_id)
        out = []
        for ep in targets:
            cur = tx.execute(
                "INSERT INTO deliveries (event_id, endpoint_id, handoff_id, state, since, next_at,"
                " created_at) VALUES (?, ?, ?, 'pending', ?, ?, ?)",
                (event_id, ep.id, hid, event.at, event.at, event.at),
            )
            out.append(
                Delivery(
                    int(cur.lastrowid or 0), ep.id, hid, msg_id, body, 0, 0, event.at, event.at
                )
            )
        return out

    def pending(
        self, endpoint_id: str | None = None, after_id: int = 0, limit: int = -1
    ) -> list[Delivery]:
        """Pending deliveries, oldest first: every one, or one endpoint's with an id above
        `after_id`, at most `limit` (-1: all) — what a dispatcher's lane loads, at start-up and
        whenever it drains below its cap."""
        self.flush()
        query = (
            "SELECT d.id, d.endpoint_id, d.handoff_id, d.event_id, e.body, d.attempts,"
            " d.budget_from, d.since, d.next_at FROM deliveries d{} JOIN events e"
            " ON e.id = d.event_id WHERE d.state = 'pending'{} ORDER BY d.id LIMIT ?"
        )
        if endpoint_id is None:
            rows = self._db.conn.execute(query.format("", ""), (limit,))
        else:
            # By endpoint and id: above a lane's cursor every row is pending (it was never
            # loaded, so never attempted), so a load reads only the rows it returns.
            rows = self._db.conn.execute(
                query.format(
                    " INDEXED BY deliveries_by_endpoint", " AND d.endpoint_id = ? AND d.id > ?"
                ),
                (endpoint_id, after_id, limit),
            )
        return [
            Delivery(did, eid, hid, self._msg_id(ev), bytes(body), att, budget, since, next_at)
            for did, eid, hid, ev, body, att, budget, since, next_at in rows
        ]

    def pending_by_endpoint(self) -> dict[str, tuple[int, int]]:
        """Endpoint id → (its oldest pending delivery's id, how many are pending): where each
        lane of a restarted dispatcher starts loading, and its backlog."""
        self.flush()
        rows = self._db.conn.execute(
            "SELECT endpoint_id, MIN(id), COUNT(*) FROM deliveries WHERE state = 'pending'"
            " GROUP BY endpoint_id"
        )
        return {eid: (first, count) for eid, first, count in rows}

    def record_attempt(
        self,
        d: Delivery,
        at: float,
        latency_s: float,
        status: int | None,
        error: str | None,
        state: DeliveryState,
        next_at: float,
    ) -> None:
        """One attempt's outcome and the delivery's new state. Outcomes that end in the same
        turn of the event loop share one transaction (written at the start of the next turn,
        and before any read or other write here): a crash in between only sends a delivery
        again, which at-least-once allows."""
        d.attempts += 1
        d.next_at = next_at
        finished = None if state == "pending" else at + latency_s
        self._attempts.append((d.id, d.attempts, at, status, latency_s, error))
        self._updates.append((state, d.attempts, next_at, finished, status, error, d.id))
        if not self._flush_scheduled:
            self._flush_scheduled = True
            asyncio.get_running_loop().call_soon(self.flush)

    def flush(self) -> None:
        """Write the attempt outcomes recorded so far (one transaction)."""
        self._flush_scheduled = False
        if not self._attempts:
            return
        attempts, updates = self._attempts, self._updates
        self._attempts, self._updates = [], []
        with self._db.transaction() as tx:
            tx.executemany(
                "INSERT INTO attempts (delivery_id, n, at, status, latency_s, error)"
                " VALUES (?, ?, ?, ?, ?, ?)",
                attempts,
            )
            tx.executemany(
                "UPDATE deliveries SET state = ?, attempts = ?, next_at = ?, finished_at = ?,"
                " last_status = ?, last_error = ? WHERE id = ?",
                updates,
            )

    def retry(self, endpoint_id: str, delivery_id: int, now: float) -> Delivery:
        """Put one delivery back to pending, due now, with fresh ceilings."""
        self.flush()
        ep = self.endpoints.get(endpoint_id)
        if ep is None:
            raise NotFoundError(f"no webhook endpoint {endpoint_id!r}", field="id")
        if ep.disabled:
            raise ConflictError(
                f"webhook endpoint {endpoint_id!r} is disabled; register it again", field="id"
            )
        row = self._db.conn.execute(
            "SELECT d.handoff_id, d.event_id, e.body, d.attempts, d.state FROM deliveries d"
            " JOIN events e ON e.id = d.event_id WHERE d.id = ? AND d.endpoint_id = ?",
            (delivery_id, endpoint_id),
        ).fetchone()
        if row is None:
            raise NotFoundError(
                f"no delivery {delivery_id} to endpoint {endpoint_id!r}", field="delivery_id"
            )
        hid, event_id, body, attempts, state = row
        if state == "pending":
            raise ConflictError(f"delivery {delivery_id} is already pending", field="delivery_id")
        with self._db.transaction() as tx:
            tx.execute(
                "UPDATE deliveries SET state = 'pending', budget_from = attempts, since = ?,"
                " next_at = ?, finished_at = NULL WHERE id = ?",
                (now, now, delivery_id),
            )
        return Delivery(
            delivery_id,
            endpoint_id,
            hid,
            self._msg_id(event_id),
            bytes(body),
            attempts,
            attempts,
            now,
            now,
        )

    def deliveries(
        self,
        endpoint_id: str,
        state: DeliveryState | None,
        limit: int,
        cursor: int,
    ) -> DeliveryPage:
        """Deliveries to one endpoint, newest first, each with its attempts."""
        self.endpoint(endpoint_id)  # 404 if unknown
        query = (
            "SELECT d.id, d.event_id, e.type, d.handoff_id, d.state, d.attempts, d.created_at,"
            " d.next_at, d.finished_at, d.last_status, d.last_error FROM deliveries d"
            " JOIN events e ON e.id = d.event_id WHERE d.endpoint_id = ?"
        )
        args: list[Any] = [endpoint_id]
        if state is not None:
            query += " AND d.state = ?"
            args.append(state)
        if cursor:
            query += " AND d.id < ?"
            args.append(cursor)
        query += " ORDER BY d.id DESC LIMIT ?"
        args.append(limit + 1)
        rows = self._db.conn.execute(query, args).fetchall()
        more = len(rows) > limit
        rows = rows[:limit]
        history: dict[int, list[AttemptView]] = {}
        if rows:
            marks = ",".join("?" * len(rows))
            for did, n, at, status, latency, error in self._db.conn.execute(
                "SELECT delivery_id, n, at, status, latency_s, error FROM attempts"
                f" WHERE delivery_id IN ({marks}) ORDER BY delivery_id, n",
                [r[0] for r in rows],
            ):
                history.setdefault(did, []).append(AttemptView(n, at, latency, status, error))
        items = [delivery_view(row, self._msg_id(row[1]), history.get(row[0], [])) for row in rows]
        return DeliveryPage(items, rows[-1][0] if more else None)

    def purge(self, tx: sqlite3.Connection, before: float, handoff_ids: list[str]) -> None:
        """Within `tx`: drop finished deliveries older than `before`, events nothing refers to,
        and the callback endpoints of purged handoffs."""
        self.flush()
        tx.execute(
            "DELETE FROM attempts WHERE delivery_id IN (SELECT id FROM deliveries"
            " WHERE state != 'pending' AND finished_at < ?)",
            (before,),
        )
        tx.execute("DELETE FROM deliveries WHERE state != 'pending' AND finished_at < ?", (before,))
        tx.execute("DELETE FROM events WHERE id NOT IN (SELECT DISTINCT event_id FROM deliveries)")
        for hid in handoff_ids:
            ep = self._callbacks.get(hid)
            if ep is None:
                continue
            pending = tx.execute(
                "SELECT 1 FROM deliveries WHERE endpoint_id = ? AND state = 'pending' LIMIT 1",
                (ep.id,),
            ).fetchone()
            if pending is None:
                tx.execute("DELETE FROM endpoints WHERE id = ?", (ep.id,))
                self._callbacks.pop(hid, None)
                self.endpoints.pop(ep.id, None)
