"""The outbox in a real SQLite file: which endpoints get an event, ids, durability, purge."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvhandoff.pipelines.errors import ConflictError, NotFoundError
from kvhandoff.pipelines.events import EventBus, HandoffCompleted, HandoffCreated, StageArrived
from kvhandoff.service.storage import FILE_NAME, Database, StateLocked
from kvhandoff.service.webhooks.outbox import Outbox, webhook_body
from kvhandoff.service.webhooks.signatures import new_secret, secret_key

CALLBACK_SECRET = new_secret()


@pytest.fixture
def db(tmp_path: Path) -> Iterator[Database]:
    database = Database(tmp_path / FILE_NAME)
    yield database
    database.close()


def test_events_go_to_the_endpoints_whose_prefixes_match(db: Database) -> None:
    outbox = Outbox(db, None, [])
    every = outbox.create_endpoint("http://a/x", [], None, "", 0.0)
    terminal = outbox.create_endpoint("http://b/x", ["handoff.completed"], None, "", 0.0)
    bus = EventBus()
    created = bus.publish(HandoffCreated(handoff_id="h", role="decode", num_pages=1, pp_size=1))
    arrived = bus.publish(
        StageArrived(handoff_id="h", role="decode", pp_rank=0, bytes=1, arrived=1, expected=1)
    )
    done = bus.publish(
        HandoffCompleted(handoff_id="h", role="decode", bytes=1, seconds=0.1, verified=False)
    )
    out = []
    for event in (created, arrived, done):
        with db.transaction() as tx:
            out.append([d.endpoint_id for d in outbox.enqueue(tx, event, None)])
    assert out == [[every.id], [every.id], [every.id, terminal.id]]
    pending = outbox.pending()
    assert [d.endpoint_id for d in pending] == [every.id, every.id, every.id, terminal.id]
    assert pending[2].msg_id == pending[3].msg_id  # one message, one webhook-id per event
    assert len({d.msg_id for d in pending}) == 3
    body = json.loads(pending[3].body)
    assert body["type"] == "handoff.completed" and body["data"]["seq"] == done.seq
    assert pending[3].body == webhook_body(done)


def test_an_event_nobody_wants_is_not_stored(db: Database) -> None:
    outbox = Outbox(db, None, [])
    outbox.create_endpoint("http://a/x", ["handoff.failed"], None, "", 0.0)
    event = EventBus().publish(
        HandoffCreated(handoff_id="h", role="decode", num_pages=1, pp_size=1)
    )
    assert not outbox.wanted(event, None)
    with db.transaction() as tx:
        assert outbox.enqueue(tx, event, None) == []
    assert db.conn.execute("SELECT COUNT(*) FROM events").fetchone() == (0,)


def test_a_callback_url_gets_only_its_handoffs_events(db: Database) -> None:
    outbox = Outbox(db, CALLBACK_SECRET, ["handoff."])
    bus = EventBus()
    mine = bus.publish(HandoffCreated(handoff_id="h", role="decode", num_pages=1, pp_size=1))
    other = bus.publish(HandoffCreated(handoff_id="g", role="decode", num_pages=1, pp_size=1))
    assert outbox.wanted(mine, "http://cb/x")
    with db.transaction() as tx:
        assert len(outbox.enqueue(tx, mine, "http://cb/x")) == 1
        assert outbox.enqueue(tx, other, None) == []
    (callback,) = [e for e in outbox.endpoints.values() if e.handoff_id == "h"]
    assert callback.url == "http://cb/x" and callback.id.startswith("cb_")
    assert outbox.list_endpoints() == []  # callbacks are not registered endpoints


def test_endpoints_and_secrets_survive_reopening(db: Database, tmp_path: Path) -> None:
    created = Outbox(db, None, []).create_endpoint("http://a/x", ["stage."], None, "d", 1.0)
    db.close()  # one process at a time holds the file
    again = Database(tmp_path / FILE_NAME)
    try:
        reopened = Outbox(again, None, [])
        assert reopened.endpoint(created.id).types == ["stage."]
        assert reopened.endpoints[created.id].key == secret_key(created.secret)
        assert again.instance == db.instance  # webhook-ids stay unique across restarts
    finally:
        again.close()


def test_unknown_endpoints_and_deliveries_are_404_and_pending_retries_409(db: Database) -> None:
    outbox = Outbox(db, None, [])
    with pytest.raises(NotFoundError):
        outbox.endpoint("ep_nope")
    with pytest.raises(NotFoundError):
        outbox.deliveries("ep_nope", None, 10, 0)
    ep = outbox.create_endpoint("http://a/x", [], None, "", 0.0)
    with pytest.raises(NotFoundError):
        outbox.retry(ep.id, 1, 0.0)
    event = EventBus().publish(
        HandoffCreated(handoff_id="h", role="decode", num_pages=1, pp_size=1)
    )
    with db.transaction() as tx:
        (d,) = outbox.enqueue(tx, event, None)
    with pytest.raises(ConflictError):
        outbox.retry(ep.id, d.id, 0.0)


async def test_a_lane_loads_one_endpoints_pending_deliveries_after_its_cursor(db: Database) -> None:
    outbox = Outbox(db, None, [])
    a = outbox.create_endpoint("http://a/x", [], None, "", 0.0)
    b = outbox.create_endpoint("http://b/x", ["handoff.completed"], None, "", 0.0)
    bus = EventBus()
    for i in range(4):
        event = bus.publish(
            HandoffCompleted(
                handoff_id=f"h{i}", role="decode", bytes=1, seconds=0.1, verified=False
            )
        )
        with db.transaction() as tx:
            outbox.enqueue(tx, event, None)
    ids = {ep: [d.id for d in outbox.pending() if d.endpoint_id == ep] for ep in (a.id, b.id)}
    first = outbox.pending(a.id, 0, 1)[0]
    outbox.record_attempt(first, 1.0, 0.1, 200, None, "delivered", 1.0)  # written by pending()
    assert [d.id for d in outbox.pending(a.id, 0, 2)] == ids[a.id][1:3]
    assert [d.id for d in outbox.pending(a.id, ids[a.id][2])] == ids[a.id][3:]
    assert [d.handoff_id for d in outbox.pending(b.id, ids[b.id][0], 10)] == ["h1", "h2", "h3"]
    assert outbox.pending_by_endpoint() == {a.id: (ids[a.id][1], 3), b.id: (ids[b.id][0], 4)}


def test_a_second_process_on_the_same_state_dir_is_refused_naming_the_holder(
    db: Database, tmp_path: Path
) -> None:
    """Issue 18 B: two decode services on one state_dir corrupted each other silently (the
    second reported the first's live handoffs `failed / service_restarted`)."""
    with pytest.raises(StateLocked, match=f"in use by pid {os.getpid()} on "):
        Database(tmp_path / FILE_NAME)
    assert db.conn.execute("SELECT COUNT(*) FROM handoffs").fetchone() == (0,)  # untouched
    db.close()
    Database(tmp_path / FILE_NAME).close()  # once the holder is gone, the next one opens it
