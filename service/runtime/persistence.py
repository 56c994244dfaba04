"""Records and webhooks wired into a decode service: the database, the bus listener, restore.

`open_persistence(config, decode, bus, egress)` (entered by the decode role's assembly,
`kvhandoff.service.runtime.roles`, when `records.persist` is on), once the decode pipeline exists:

1. opens `server.state_dir/decode.sqlite3` (`kvhandoff.service.storage`);
2. adds one synchronous bus listener that, for each event, writes its handoff record
   (`kvhandoff.service.records.handoffs`) and its webhook deliveries
   (`kvhandoff.service.webhooks.outbox`) inside `EventBus.publish`, into the group commit
   (`Database.grouped`): committed on the loop's next turn or, sooner, before any answer, peer
   request, SSE frame or webhook leaves the process (`kvhandoff.service.http.egress`), so no one
   learns of a state before it is on disk — then hands the deliveries to the dispatcher
   (`kvhandoff.service.webhooks.dispatch`), which sends them once committed;
3. ends what an earlier process left in flight: each such handoff fails with
   `service_restarted` (a published event: its record, its webhooks), and every page a handoff
   may still be written through stays fenced until its deadline plus the engine's timeout;
4. purges records and deliveries past retention, at start and every `PURGE_INTERVAL_S`.

On shutdown (after the assembly closed the decode pipeline, so the aborts of live handoffs are
recorded) it stops the chores and the dispatcher (pending deliveries stay in the outbox), then
closes the database.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sqlite3
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import msgspec
from aiohttp import web

from kvhandoff.pipelines.decode import DecodePipeline
from kvhandoff.pipelines.decode.views import HandoffView, HeldHandoff
from kvhandoff.pipelines.errors import ConflictError, NotFoundError
from kvhandoff.pipelines.events import (
    TERMINAL_EVENTS,
    Event,
    EventBus,
    HandoffCreated,
    HandoffFailed,
    HandoffReleased,
    StageArrived,
    event_tag,
)
from kvhandoff.service.config import Config, ConfigError
from kvhandoff.service.http.egress import Egress
from kvhandoff.service.records.handoffs import HandoffRecords
from kvhandoff.service.storage import FILE_NAME, Database
from kvhandoff.service.tasks import TaskOwner
from kvhandoff.service.webhooks.dispatch import Dispatcher
from kvhandoff.service.webhooks.outbox import Outbox

log = logging.getLogger("kvhandoff.records")

PURGE_INTERVAL_S = 60.0
CHECKPOINT_INTERVAL_S = 1.0
RESTARTED = "service_restarted"
#: A later event type (from the decode state machine) saying a handoff's pages are free.
RELEASED_TAG = "handoff.released"


@dataclass
class Persistence:
    db: Database
    records: HandoffRecords
    outbox: Outbox
    dispatcher: Dispatcher
    clock: Callable[[], float]
    #: Why the last write failed (disk full, I/O error); /readyz fails while set.
    broken: str | None = None

    def commit_failed(self, exc: Exception) -> None:
        """A group's commit failed (disk full, I/O error): its writes are gone, so the service
        stops being ready — no router is told about state that is not on disk again."""
        self.broken = f"{type(exc).__name__}: {exc}"
        log.error("committing handoff records failed: %s", self.broken, exc_info=exc)

    async def check_callback(self, url: str) -> None:
        """Refuse (naming `callback_url`) a handoff's callback the service may not call."""
        if not self.outbox.callbacks_enabled:
            raise ConflictError(
                "callback_url needs webhooks.callback_secret to be configured",
                field="callback_url",
            )
        await self.dispatcher.policy.check(url, "callback_url")


PERSISTENCE = web.AppKey("persistence", Persistence)


def persistence_of(request: web.Request) -> Persistence:
    found = request.app.get(PERSISTENCE)
    if found is None:
        raise ConflictError(
            "records and webhooks are off on this service (records.persist = false)",
            field="records.persist",
        )
    return found


@contextlib.asynccontextmanager
async def open_persistence(
    config: Config, decode: DecodePipeline, bus: EventBus, egress: Egress
) -> AsyncIterator[Persistence]:
    """The decode's records and webhooks over `decode` and its `bus`, restored, until the
    `async with` ends (the caller closes the pipeline before that, so its shutdown aborts are
    recorded); then the chores and the dispatcher stop (pending deliveries stay in the outbox)
    and the database closes."""
    path = config.server.state_path / FILE_NAME
    try:
        db = Database(path)
    except (OSError, sqlite3.Error) as exc:
        raise ConfigError("server.state_dir", f"cannot open {path}: {exc}") from None
    try:
        persistence = _persistence(config, db, arena=decode.query.arena_span())
        db.on_commit_error = persistence.commit_failed
        egress.add(db.committed)
        bus.add_listener(_Journal(persistence, decode).on_event)
        _restore(persistence, decode, bus.publish, config)
        await persistence.dispatcher.start()
        chores = TaskOwner("records")
        chores.spawn(_purge_every(persistence, config), "kvhandoff-records-purge")
        chores.spawn(_checkpoint_every(db), "kvhandoff-records-checkpoint")
        try:
            yield persistence
        finally:
            await chores.close()
            await persistence.dispatcher.close()
            persistence.outbox.flush()
    finally:
        with contextlib.suppress(ValueError):
            egress.remove(db.committed)
        db.close()


def _persistence(
    config: Config,
    db: Database,
    clock: Callable[[], float] = time.time,
    arena: tuple[int, int] | None = None,
) -> Persistence:
    hooks = config.webhooks
    outbox = Outbox(db, hooks.callback_secret, hooks.callback_types)
    return Persistence(
        db=db,
        # The longest any prefill may declare its engine calls run (a create is refused beyond it):
        # after a crash, the handoff's own declaration is gone with the process.
        records=HandoffRecords(db, grace_s=config.handoff.max_grace_s, arena=arena),
        outbox=outbox,
        dispatcher=Dispatcher(outbox, hooks, clock=clock),
        clock=clock,
    )


class _Journal:
    """The bus listener: one transaction per event that concerns records or webhooks."""

    def __init__(self, p: Persistence, decode: DecodePipeline) -> None:
        self._p = p
        self._decode = decode

    def on_event(self, event: Event) -> None:
        try:
            self._write(event)
        except sqlite3.Error as exc:
            # Raising into the pipeline would leave its state half-changed; instead the service
            # stops being ready, so no router is told about state that is not on disk again.
            self._p.broken = f"{type(exc).__name__}: {exc}"
            log.exception("recording %s of %s failed", event_tag(event), event.handoff_id)

    def _write(self, event: Event) -> None:
        outbox = self._p.outbox
        h = self._decode.query.find(event.handoff_id)
        tag = event_tag(event)
        callback = h.request.callback_url if h is not None else None
        wanted = outbox.wanted(event, callback)
        # Joins the group commit (`Database.grouped`): on disk before anything leaves the
        # process, and the deliveries are sent only then (`Dispatcher.add`).
        db = self._p.db
        if not wanted and h is not None and db.open_group():
            # Only notes, written when the group commits: no statement, no savepoint.
            self._record(db.conn, event, tag, h)
            return
        with db.grouped() as tx:
            self._record(tx, event, tag, h)
            deliveries = outbox.enqueue(tx, event, callback) if wanted else []
        if deliveries:
            self._p.dispatcher.add(deliveries)

    def _record(
        self, tx: sqlite3.Connection, event: Event, tag: str, h: HeldHandoff | None
    ) -> None:
        """Note the event's record (written merged with the handoff's other notes when the
        group commits: `HandoffRecords.apply`)."""
        records = self._p.records
        decode = self._decode
        if isinstance(event, HandoffCreated) and h is not None:
            records.note_accepted(
                h.request, h.created_at, h.deadline_at, h.seq, self._progress(h.request.id)
            )
        elif isinstance(event, StageArrived) and h is not None:
            # A restart-failed record keeps its stages and bytes.
            records.note_progress(h.request.id, self._progress(h.request.id))
        elif isinstance(event, TERMINAL_EVENTS):
            if h is not None:
                # Published before the pipeline appends it to the handoff's timeline.
                now = decode.get(h.request.id)
                records.note_finished(msgspec.structs.replace(now, timeline=[*now.timeline, event]))
            else:
                view = records.restored_view(tx, event)
                if view is not None:
                    records.finished(tx, view)
        elif isinstance(event, HandoffReleased):
            records.note_released(event)

    def _progress(self, handoff_id: str) -> Callable[[], HandoffView | None]:
        """The handoff's view when its record is written, if it is still held then."""

        def view() -> HandoffView | None:
            try:
                return self._decode.get(handoff_id, timeline=False)
            except NotFoundError:
                return None

        return view


def _restore(
    p: Persistence, decode: DecodePipeline, publish: Callable[[Event], Event], config: Config
) -> None:
    interrupted = p.records.interrupted()
    for old in interrupted:
        publish(
            HandoffFailed(
                handoff_id=old.request.id,
                role="decode",
                code=RESTARTED,
                reason="the decode service restarted while the handoff was in flight",
                metadata=old.request.metadata,
            )
        )
    fenced = p.records.fenced(p.clock())
    decode.adopt(p.records, fenced)
    if interrupted or fenced:
        log.warning(
            "restart: %d in-flight handoff(s) failed with %s; pages of %d kept fenced until "
            "their old writers' deadline plus %.3g s",
            len(interrupted),
            RESTARTED,
            len(fenced),
            config.handoff.max_grace_s,
        )


def purge_once(p: Persistence, config: Config) -> int:
    now = p.clock()
    with p.db.transaction() as tx:
        ids = p.records.purge(tx, now, config.records.retention_s, config.records.max_records)
        p.outbox.purge(tx, now - config.records.retention_s, ids)
    return len(ids)


async def _checkpoint_every(db: Database) -> None:
    while True:
        await asyncio.sleep(CHECKPOINT_INTERVAL_S)
        await asyncio.to_thread(db.checkpoint)


async def _purge_every(p: Persistence, config: Config) -> None:
    while True:
        purged = purge_once(p, config)
        if purged:
            log.info("purged %d handoff record(s) past retention", purged)
        await asyncio.sleep(PURGE_INTERVAL_S)
