"""The group commit (`kvhandoff.service.storage`, `kvhandoff.service.http.egress`): the records of
many events share one commit, and nothing outside the process learns of a state before its record
is on disk — checked from a second SQLite connection, as a process restarted after a SIGKILL
would read the file.

The process-level tests widen the group's window (`GROUP_WINDOW_S`) so that an answer, a
frame or a webhook that did not wait for the commit would arrive while the record is still
uncommitted, and the check would fail."""

from __future__ import annotations

import asyncio
import sqlite3
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
from httpx_sse import aconnect_sse

import kvhandoff.service.storage as database
from kvhandoff.service.runtime.persistence import PERSISTENCE
from kvhandoff.service.storage import FILE_NAME, Database
from tests.receivers import Answer, Received, WebhookReceiver
from tests.unit.service.handoff_fixtures import decode_config, fill_sources, open_deployment

WINDOW_S = 0.3
SRC, DST, SLOT = [3, 4], [10, 11], 1


def on_disk(path: Path, handoff_id: str) -> str | None:
    """The record's state as another process would read the file now (committed rows only)."""
    with sqlite3.connect(path) as other:
        row = other.execute("SELECT state FROM handoffs WHERE id = ?", (handoff_id,)).fetchone()
    return None if row is None else str(row[0])


@pytest.fixture
def db(tmp_path: Path) -> AsyncIterator[Database]:
    d = Database(tmp_path / FILE_NAME)
    yield d
    d.close()


def insert(db: Database, handoff_id: str) -> None:
    with db.grouped() as tx:
        tx.execute(
            "INSERT INTO handoffs (id, request, dst_pages, created_at, deadline_at, state)"
            " VALUES (?, x'', x'', 0, 0, 'accepted')",
            (handoff_id,),
        )


async def test_writes_of_one_turn_share_one_commit_and_wait_for_it(db: Database) -> None:
    commits = 0
    real = db.commit

    def counting() -> None:
        nonlocal commits
        commits += db._group
        real()

    db.commit = counting  # type: ignore[method-assign]
    done: list[str] = []
    for i in range(5):
        insert(db, f"h{i}")
        db.after_commit(lambda i=i: done.append(f"h{i}"))
    assert on_disk(db.path, "h0") is None and done == []  # not yet: the group is open
    await db.committed()
    assert [on_disk(db.path, f"h{i}") for i in range(5)] == ["accepted"] * 5
    assert commits == 1 and done == [f"h{i}" for i in range(5)]
    await db.committed()  # nothing pending: returns at once
    db.after_commit(lambda: done.append("now"))
    assert done[-1] == "now"


async def test_a_failing_write_undoes_only_its_own_rows(db: Database) -> None:
    insert(db, "kept")
    with pytest.raises(sqlite3.IntegrityError):
        insert(db, "kept")  # the same primary key: its savepoint is rolled back
    insert(db, "also")
    await db.committed()
    assert (on_disk(db.path, "kept"), on_disk(db.path, "also")) == ("accepted", "accepted")


async def test_a_failed_commit_is_reported_drops_its_waiters_work_and_the_next_group_opens(
    db: Database,
) -> None:
    errors: list[Exception] = []
    db.on_commit_error = errors.append
    sent: list[str] = []

    def fail() -> None:
        raise sqlite3.OperationalError("disk I/O error")

    db.before_commit(fail)
    insert(db, "lost")
    db.after_commit(lambda: sent.append("lost"))
    await db.committed()  # woken, not left waiting
    assert [str(e) for e in errors] == ["disk I/O error"] and sent == []
    assert on_disk(db.path, "lost") is None and not db.conn.in_transaction
    db._before_commit.remove(fail)
    insert(db, "next")
    await db.committed()
    assert on_disk(db.path, "next") == "accepted"


async def test_without_a_loop_a_grouped_write_commits_at_once(tmp_path: Path) -> None:
    def write() -> None:
        d = Database(tmp_path / FILE_NAME)
        try:
            insert(d, "tool")
            assert on_disk(d.path, "tool") == "accepted"
        finally:
            d.close()

    await asyncio.to_thread(write)


# -- across the process boundary --------------------------------------------------------------


@pytest.fixture
def wide_window(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(database, "GROUP_WINDOW_S", WINDOW_S)


@pytest.mark.usefixtures("wide_window")
async def test_no_answer_frame_or_webhook_tells_of_a_record_not_on_disk() -> None:
    receiver = await WebhookReceiver().start()
    settings = {"webhooks.allow_private": True}
    try:
        async with open_deployment(decode=decode_config(settings)) as d:
            fill_sources(d)
            path = d.decode.app[PERSISTENCE].db.path
            seen: list[tuple[str, str | None]] = []  # each webhook, and its record then

            def respond(got: Received) -> Answer:
                seen.append((got.type, on_disk(path, got.handoff_id)))
                return Answer()

            receiver.respond = respond
            reply = await d.request(
                "POST", f"{d.decode.url}/v1/webhooks", json={"url": receiver.url}
            )
            assert reply.status == 201, reply.body
            async with (
                httpx.AsyncClient(timeout=10) as http,
                aconnect_sse(http, "GET", f"{d.decode.url}/v1/events") as sse,
            ):
                frames = sse.aiter_sse()
                reply = await d.create("g1", DST, SLOT)
                # The answer came only once its record was committed.
                assert reply.status == 201 and on_disk(path, "g1") == "accepted"
                first = await anext(frames)
                while first.event != "handoff.created":
                    first = await anext(frames)
                assert on_disk(path, "g1") == "accepted"
                for rank in (0, 1):
                    assert (await d.ready("g1", rank, SRC, 0)).status == 202
                while (await anext(frames)).event != "handoff.completed":
                    pass
                assert on_disk(path, "g1") == "completed"  # the frame waited for it
            await receiver.wait_for(lambda r: any(x.type == "handoff.completed" for x in r))
            # Each delivery was sent only once its event's record was on disk.
            states = dict(seen)
            assert states["handoff.created"] in ("accepted", "completed"), seen
            assert states["handoff.completed"] == "completed", seen
    finally:
        await receiver.stop()
