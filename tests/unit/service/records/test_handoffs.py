"""Handoff records in a real SQLite file: what a restart finds, what stays fenced, retention."""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest

from kvhandoff.pipelines.decode.views import HandoffRequest, HandoffView
from kvhandoff.pipelines.events import EventBus, HandoffFailed, HandoffReleased
from kvhandoff.pipelines.states import HandoffState
from kvhandoff.service.records.handoffs import HandoffRecords
from kvhandoff.service.storage import FILE_NAME, LIFE_SHIFT, SCHEMA_VERSION, Database

GRACE_S = 11.0


@pytest.fixture
def db(tmp_path: Path) -> Iterator[Database]:
    database = Database(tmp_path / FILE_NAME)
    yield database
    database.close()


def request(hid: str, pages: list[int], slot: int | None = 1) -> HandoffRequest:
    return HandoffRequest(id=hid, prefill=["http://p"], dst_pages=pages, dst_slot=slot)


def view(req: HandoffRequest, state: HandoffState, finished_at: float) -> HandoffView:
    return HandoffView(
        id=req.id,
        state=state,
        created_at=0.0,
        deadline_at=30.0,
        num_pages=len(req.dst_pages),
        dst_slot=req.dst_slot,
        prefill=list(req.prefill),
        verify=False,
        bytes=5,
        stages=[],
        released=state == HandoffState.COMPLETED,  # an outcome view, before handoff.released
        finished_at=finished_at,
    )


def accept(db: Database, r: HandoffRecords, req: HandoffRequest, deadline_at: float = 30.0) -> None:
    with db.transaction() as tx:
        r.accepted(tx, req, 0.0, deadline_at)


def test_a_record_is_found_only_once_it_is_terminal(db: Database) -> None:
    r = HandoffRecords(db, grace_s=GRACE_S)
    req = request("a", [1, 2])
    accept(db, r, req)
    assert r.find("a") is None  # this process holds live ones itself
    assert [i.request for i in r.interrupted()] == [req]
    with db.transaction() as tx:
        r.finished(tx, view(req, HandoffState.COMPLETED, 5.0))
    found = r.find("a")
    assert found is not None and found.request == req
    assert found.view.state == HandoffState.COMPLETED and found.view.bytes == 5
    assert r.interrupted() == []


def test_fenced_pages_are_those_not_released_whose_writers_may_still_write(db: Database) -> None:
    r = HandoffRecords(db, grace_s=GRACE_S)
    live, failed, done, old = (
        request("live", [1]),
        request("failed", [2, 3], 4),
        request("done", [5]),
        request("old", [6]),
    )
    for req in (live, failed, done):
        accept(db, r, req)
    accept(db, r, old, deadline_at=-20.0)  # its deadline plus grace passed already
    with db.transaction() as tx:
        r.finished(tx, view(failed, HandoffState.FAILED, 5.0))  # may still be quiescing
        r.finished(tx, view(done, HandoffState.COMPLETED, 5.0))  # every writer confirmed
    fenced = {f.handoff_id: f for f in r.fenced(now=10.0)}
    assert set(fenced) == {"live", "failed"}
    assert fenced["failed"].dst_pages == [2, 3] and fenced["failed"].dst_slot == 4
    assert fenced["failed"].release_at == 30.0 + GRACE_S
    released = EventBus().publish(
        HandoffReleased(
            handoff_id="failed",
            role="decode",
            outcome="failed",
            confirmed=True,
            seconds_after_outcome=0.5,
        )
    )
    with db.transaction() as tx:
        r.released(tx, released)
    assert {f.handoff_id for f in r.fenced(now=10.0)} == {"live"}
    assert r.fenced(now=30.0 + GRACE_S) == []
    # The stored view says so too, its timeline running to the release (issue 18 C).
    found = r.find("failed")
    assert found is not None and found.view.released
    assert found.view.released_at == released.at
    assert found.view.timeline[-1] == released
    with db.transaction() as tx:  # a repeat (an at-least-once listener) adds nothing
        r.released(tx, released)
    again = r.find("failed")
    assert again is not None and again.view.timeline == found.view.timeline


def test_a_restart_sees_the_arena_each_handoff_was_written_through(tmp_path: Path) -> None:
    # A landed handoff's pages were written only by its own process's commits; its prefills
    # wrote into that life's arena, which a restart checks against its own memory (SAFETY.md
    # S1). The arena is the one the handoff ran with, not the next life's; direct: none.
    path = tmp_path / FILE_NAME
    first = Database(path)
    accept(first, HandoffRecords(first, grace_s=GRACE_S), request("d", [1]))
    accept(first, HandoffRecords(first, grace_s=GRACE_S, arena=(8192, 4096)), request("a", [3]))
    first.close()
    again = Database(path)
    try:
        r = HandoffRecords(again, grace_s=GRACE_S, arena=(65536, 4096))
        accept(again, r, request("l", [2]))
        arenas = {f.handoff_id: f.arena for f in r.fenced(now=10.0)}
        assert arenas == {"d": None, "a": (8192, 4096), "l": (65536, 4096)}
    finally:
        again.close()


def test_a_restored_view_is_built_from_the_record_and_the_event(db: Database) -> None:
    r = HandoffRecords(db, grace_s=GRACE_S)
    req = msgspec.structs.replace(request("a", [1, 2]), metadata={"k": "v"})
    accept(db, r, req)
    event = EventBus().publish(
        HandoffFailed(handoff_id="a", role="decode", code="service_restarted", reason="r")
    )
    with db.transaction() as tx:
        restored = r.restored_view(tx, event)
        assert restored is not None
        r.finished(tx, restored)
        assert r.restored_view(tx, event) is None  # finished: nothing left to restore
    found = r.find("a")
    assert found is not None and found.view.state == HandoffState.FAILED
    assert found.view.error is not None and found.view.error.code == "service_restarted"
    assert found.view.metadata == {"k": "v"} and found.view.timeline == [event]


def test_retention_by_age_and_count_spares_what_may_still_be_written(db: Database) -> None:
    r = HandoffRecords(db, grace_s=GRACE_S)
    for i in range(4):
        req = request(f"h{i}", [i])
        accept(db, r, req, deadline_at=1000.0)
        with db.transaction() as tx:
            state = HandoffState.FAILED if i == 0 else HandoffState.COMPLETED
            r.finished(tx, view(req, state, float(i)))
    with db.transaction() as tx:  # h0 failed unreleased: kept until its deadline + grace
        assert r.purge(tx, now=100.0, retention_s=50.0, max_records=10) == ["h1", "h2", "h3"]
    with db.transaction() as tx:
        assert r.purge(tx, now=2000.0, retention_s=1e9, max_records=0) == ["h0"]
    assert r.find("h0") is None


# ------------------------------------------------------------------------------ the list's order


def finish(db: Database, r: HandoffRecords, hid: str, state: HandoffState, number: int) -> None:
    req = request(hid, [number])
    with db.transaction() as tx:
        r.accepted(tx, req, float(number), 30.0, number)
        r.finished(tx, view(req, state, float(number)))


def test_records_are_listed_in_creation_order_across_lives(tmp_path: Path) -> None:
    path = tmp_path / FILE_NAME
    first = Database(path)
    r = HandoffRecords(first, grace_s=GRACE_S)
    for n, hid in enumerate(["b", "a", "c"], 1):  # ordered by creation, not by id
        finish(first, r, hid, HandoffState.COMPLETED, n)
    accept(first, r, request("live", [9]))  # not finished: the process answers for it itself
    first.close()
    again = Database(path)
    try:
        r = HandoffRecords(again, grace_s=GRACE_S)
        assert again.life == first.life + 1
        finish(again, r, "d", HandoffState.FAILED, 1)  # number 1 again, in a later life
        listed = r.listed(0, None, 10)
        assert [hid for _, hid in listed] == ["b", "a", "c", "d"]
        assert listed[0][0] == r.seq_of(1) - (1 << LIFE_SHIFT)  # the first life's number 1
        assert listed[-1][0] == r.seq_of(1)
        assert [hid for _, hid in r.listed(listed[1][0], None, 2)] == ["c", "d"]
        assert r.listed(0, HandoffState.FAILED, 10) == [listed[-1]]
        assert r.listed(0, HandoffState.PENDING, 10) == []  # what the process itself holds
        assert r.listed(0, HandoffState.COMPLETED, 10, before=listed[2][0]) == listed[:2]
    finally:
        again.close()


def test_a_record_written_without_a_number_comes_after_this_lifes(db: Database) -> None:
    r = HandoffRecords(db, grace_s=GRACE_S)
    finish(db, r, "one", HandoffState.COMPLETED, 5)
    accept(db, r, request("two", [1]))
    accept(db, r, request("three", [2]))
    seqs = dict(
        (hid, seq) for seq, hid in db.conn.execute("SELECT seq, id FROM handoffs").fetchall()
    )
    assert seqs == {"one": r.seq_of(5), "two": r.seq_of(6), "three": r.seq_of(7)}


def test_a_page_reads_its_rows_through_an_index_not_the_table(db: Database) -> None:
    # Count SQLite's virtual-machine steps for one page: with 20 times the records, a page of
    # the list (all, or of a state with fewer rows than the page) costs about the same, so no
    # call walks the table.
    r = HandoffRecords(db, grace_s=GRACE_S)

    def fill(start: int, stop: int) -> None:
        with db.transaction() as tx:
            for n in range(start, stop):
                req = request(f"h{n}", [n])
                r.accepted(tx, req, float(n), 30.0, n)
                rare = {1000: HandoffState.ABORTED, 1001: HandoffState.FAILED}
                state = rare.get(n, HandoffState.COMPLETED)
                r.finished(tx, view(req, state, float(n)))

    def steps(state: HandoffState | None) -> int:
        count = [0]

        def step() -> int:
            count[0] += 1
            return 0

        db.conn.set_progress_handler(step, 1)
        try:
            assert len(r.listed(r.seq_of(500), state, 2)) == (2 if state is None else 1)
        finally:
            db.conn.set_progress_handler(None, 0)
        return count[0]

    fill(1, 2001)
    kinds = (None, HandoffState.ABORTED, HandoffState.FAILED)
    small = {state: steps(state) for state in kinds}
    fill(2001, 40001)
    large = {state: steps(state) for state in kinds}
    for state, n in small.items():
        assert large[state] < 2 * n, (state, small, large)


V1_SCHEMA = """
CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
INSERT INTO meta VALUES ('instance', 'abc'), ('schema_version', '1');
CREATE TABLE handoffs (
    id TEXT PRIMARY KEY, request BLOB NOT NULL, dst_pages BLOB NOT NULL,
    created_at REAL NOT NULL, deadline_at REAL NOT NULL, state TEXT NOT NULL, view BLOB,
    finished_at REAL, released INTEGER NOT NULL DEFAULT 0
);
CREATE INDEX handoffs_by_finish ON handoffs (finished_at);
"""


def test_a_file_of_schema_1_is_migrated_keeping_its_records_in_creation_order(
    tmp_path: Path,
) -> None:
    path = tmp_path / FILE_NAME
    old = sqlite3.connect(path)
    old.executescript(V1_SCHEMA)
    for hid, created_at in (("late", 20.0), ("early", 10.0), ("mid", 15.0)):
        req = request(hid, [1])
        done = view(req, HandoffState.COMPLETED, created_at + 1)
        old.execute(
            "INSERT INTO handoffs VALUES (?, ?, ?, ?, ?, ?, ?, ?, 1)",
            (
                hid,
                msgspec.json.encode(req),
                b"[1]",
                created_at,
                30.0,
                "completed",
                msgspec.json.encode(done),
                created_at + 1,
            ),
        )
    live = request("live", [7])  # in flight when that release's process died
    old.execute(
        "INSERT INTO handoffs VALUES (?, ?, ?, ?, ?, ?, NULL, NULL, 0)",
        (live.id, msgspec.json.encode(live), b"[7]", 5.0, 30.0, "accepted"),
    )
    old.commit()
    old.close()
    db = Database(path)
    try:
        assert db.instance == "abc" and db.life == 1
        # Its arena was not recorded then: fenced as a direct handoff is, the cautious reading.
        landed = HandoffRecords(db, grace_s=GRACE_S, arena=(1 << 20, 4096))
        assert [(f.handoff_id, f.arena) for f in landed.fenced(now=10.0)] == [("live", None)]
        version = db.conn.execute("SELECT value FROM meta WHERE key = 'schema_version'")
        assert int(version.fetchone()[0]) == SCHEMA_VERSION
        r = HandoffRecords(db, grace_s=GRACE_S)
        found = r.find("mid")
        assert found is not None and found.view.state == HandoffState.COMPLETED
        finish(db, r, "new", HandoffState.COMPLETED, 1)
        assert [hid for _, hid in r.listed(0, None, 10)] == ["early", "mid", "late", "new"]
    finally:
        db.close()
    again = Database(path)  # migrated once: opens as it is
    try:
        assert again.life == 2
        r = HandoffRecords(again, grace_s=GRACE_S)
        assert [hid for _, hid in r.listed(0, None, 10)] == ["early", "mid", "late", "new"]
    finally:
        again.close()


def test_a_file_of_a_later_schema_is_refused(tmp_path: Path) -> None:
    path = tmp_path / FILE_NAME
    Database(path).close()
    newer = sqlite3.connect(path)
    newer.execute("UPDATE meta SET value = ? WHERE key = 'schema_version'", (SCHEMA_VERSION + 1,))
    newer.commit()
    newer.close()
    with pytest.raises(RuntimeError, match="schema version"):
        Database(path)
