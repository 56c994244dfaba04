"""Handoff records in a real SQLite file: what a restart finds, what stays fenced, retention."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest

from pipelines.decode_views import HandoffRequest, HandoffView
from pipelines.events import EventBus, HandoffFailed
from pipelines.states import HandoffState
from service.runtime.database import FILE_NAME, Database
from service.runtime.records import HandoffRecords

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
    with db.transaction() as tx:
        r.released(tx, "failed")  # a `handoff.released` event
    assert {f.handoff_id for f in r.fenced(now=10.0)} == {"live"}
    assert r.fenced(now=30.0 + GRACE_S) == []


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
