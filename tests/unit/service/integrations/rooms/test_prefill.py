"""A prefill rank's room records: chunk -> page-range signalling, the fan-out replay, the
room's Success, and what stopping and excusing leave behind."""

from __future__ import annotations

import pytest

from kvhandoff.service.integrations.rooms.prefill import PrefillRoom, PrefillRooms, Range
from kvhandoff.service.integrations.rooms.states import IllegalRoomTransition, PrefillState


def opened(room: int = 1) -> tuple[PrefillRooms, PrefillRoom]:
    rooms = PrefillRooms(early_kept=2)
    assert rooms.open(room, "own") is None
    rec = rooms.get(room)
    assert rec is not None
    return rooms, rec


def test_chunks_become_ranges_at_the_engine_s_positions_and_the_last_brings_the_slots() -> None:
    rooms, rec = opened()
    assert rooms.chunk(rec, 3, is_last=False, waiting=[]).at == 0
    assert rec.state == PrefillState.SENDING
    # The engine's last chunk before its state slot came: the pages end, the range does not.
    c = rooms.chunk(rec, 2, is_last=True, waiting=["mamba"])
    assert (c.at, c.last, rec.state) == (3, False, PrefillState.PAGES_ENDED)
    c = rooms.chunk(rec, 0, is_last=True, waiting=[])  # its closing send, with the slot
    assert (c.at, c.last, rec.state) == (5, True, PrefillState.SIGNALLED)
    assert rooms.chunk(rec, 0, is_last=True, waiting=[]).skip  # an empty repeat: nothing
    assert rooms.chunk(rec, 1, is_last=True, waiting=[]).refused == (
        "1 pages sent after the last chunk"
    )


def test_a_second_send_after_the_pages_ended_without_the_slot_is_refused() -> None:
    rooms, rec = opened()
    rooms.chunk(rec, 2, is_last=True, waiting=["mamba"])
    assert rooms.chunk(rec, 0, is_last=False, waiting=["mamba"]).refused == (
        "no state slot of ['mamba'] came"
    )


def test_a_fan_out_learned_late_replays_only_what_the_own_handoff_was_given() -> None:
    rooms, rec = opened()
    for at in (0, 2):
        assert rooms.keep(rec, Range([at], at, at == 2, None, None))
    rec.own_signalled = 1  # the second range's forward has not run yet
    assert rooms.learn_fan_out(rec, 3, ["c1", "c2"]) is True
    assert rooms.room_of("c2") == 1
    assert [(c, [r.at for r in rs]) for c, rs in rooms.replay(rec)] == [("c1", [0]), ("c2", [0])]
    rec.own_signalled = 2
    assert [(c, [r.at for r in rs]) for c, rs in rooms.replay(rec)] == [("c1", [2]), ("c2", [2])]
    assert rooms.learn_fan_out(rec, 3, ["c1", "c2"]) is False  # a repeat: nothing changes
    assert rooms.learn_fan_out(rec, 2, ["c1"]) is None  # two decodes disagree: fail it


def test_a_fan_out_of_one_keeps_no_range_and_an_early_one_waits_for_its_room() -> None:
    rooms, rec = opened()
    assert rooms.keep(rec, Range([0], 0, False, None, None))
    assert rooms.learn_fan_out(rec, 1, []) is False and not rec.ranges
    assert not rooms.keep(rec, Range([1], 1, True, None, None))
    rooms.learn_early("a", 2)
    rooms.learn_early("b", 2)
    rooms.learn_early("c", 3)  # the oldest goes beyond `early_kept`
    assert rooms.open(7, "a") is None and rooms.open(8, "c") == 3


def test_the_room_succeeds_once_every_handoff_of_it_has_all_its_bytes() -> None:
    rooms, rec = opened()
    rooms.learn_fan_out(rec, 2, ["c1"])
    assert not rooms.transferred(rec, "own", 10, final=False, now=1.0)
    assert not rooms.transferred(rec, "own", 5, final=True, now=2.0)
    assert rec.moved == (15, None)
    assert rooms.transferred(rec, "c1", 15, final=True, now=3.0)
    assert rec.moved == (30, 3.0)


def test_a_stopped_room_stays_stopped_and_closing_forgets_every_id() -> None:
    rooms, rec = opened()
    rooms.learn_fan_out(rec, 2, ["c1"])
    assert rooms.stop(rec) and not rooms.stop(rec)  # once: the first reason stands
    with pytest.raises(IllegalRoomTransition):
        rooms.chunk(rec, 1, is_last=True, waiting=[])
    rooms.close(1)
    assert len(rooms) == 0 and rooms.room_of("own") is None and rooms.room_of("c1") is None


def test_an_excused_room_says_what_to_withdraw_and_routes_no_event() -> None:
    rooms, rec = opened()
    rooms.chunk(rec, 1, is_last=True, waiting=[])
    assert rooms.excuse(rec) == (True, True)
    assert rec.state == PrefillState.EXCUSED and rooms.room_of("own") is None
    assert not rooms.stop(rec)  # it moves nothing: nothing of it fails


def test_only_a_kept_range_counts_as_signalled_to_the_own_handoff() -> None:
    rooms, rec = opened()
    rooms.own_signalled_one(rec)  # nothing kept: nothing for a copy to be given
    assert rec.own_signalled == 0
    rooms.keep(rec, Range([0], 0, True, None, None))
    rooms.own_signalled_one(rec)
    assert rec.own_signalled == 1
    rooms.learn_fan_out(rec, 1, [])  # no copy will come: the ranges go
    rooms.own_signalled_one(rec)
    assert rec.own_signalled == 1


def test_a_room_says_whether_it_is_excused_or_stopped() -> None:
    rooms, rec = opened()
    assert not rec.excused and not rec.stopped
    assert rooms.stop(rec) and rec.stopped
    assert rooms.open(2, "two") is None
    other = rooms.get(2)
    assert other is not None and other is not rec
    rooms.excuse(other)
    assert other.excused and not other.stopped


def test_opening_a_live_room_again_keeps_its_record_and_an_excused_one_routes_nothing() -> None:
    rooms, rec = opened()
    rooms.chunk(rec, 2, is_last=False, waiting=[])
    rooms.learn_fan_out(rec, 2, ["c1"])
    assert rooms.open(1, "own") is None
    assert rooms.get(1) is rec and rec.sent == 2 and rooms.room_of("c1") == 1
    rooms.excuse(rec)
    rooms.open(1, "own")
    assert rec.excused and rooms.room_of("own") is None


def test_a_room_has_moved_once_any_segment_was_committed_even_an_empty_one() -> None:
    rooms, rec = opened()
    assert rec.moved is None
    assert not rooms.transferred(rec, "own", 0, final=False, now=1.0)
    assert rec.moved == (0, None)
