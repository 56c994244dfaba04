"""A decode rank's handoff records: when a request's pages are safe to free, on every path."""

from __future__ import annotations

from kvhandoff.service.integrations.rooms.decode import DecodeRooms
from kvhandoff.service.integrations.rooms.states import DecodeState


def opened(room: int = 1, hid: str = "h") -> DecodeRooms:
    rooms = DecodeRooms()
    rooms.open(room, hid)
    return rooms


def test_a_created_handoff_holds_its_pages_until_kvhandoff_released_them() -> None:
    rooms = opened()
    assert rooms.creating("h")
    assert not rooms.release_safe(1)  # the create may lease them any time
    assert not rooms.created("h")  # nobody gave it up: nothing to abort
    assert rooms.cancel("h")  # the engine's abort: stop it now
    assert not rooms.release_safe(1)  # the outcome is no release
    rooms.close("h")  # SGLang clears the receiver before it asks
    assert not rooms.release_safe(1) and len(rooms) == 1
    rooms.released("h")
    assert rooms.release_safe(1) and len(rooms) == 0  # closed and released: forgotten


def test_a_create_given_up_while_queued_or_running_is_aborted_when_it_returns() -> None:
    rooms = opened()
    assert rooms.creating("h")
    assert not rooms.cancel("h")  # nothing to abort yet: the create may be leasing
    assert rooms.state("h") == DecodeState.CANCELLED and not rooms.release_safe(1)
    assert rooms.created("h")  # the caller aborts it now
    assert rooms.state("h") == DecodeState.HELD and not rooms.release_safe(1)


def test_a_refused_create_and_a_request_never_asked_for_are_safe_at_once() -> None:
    rooms = opened()
    assert rooms.creating("h")
    rooms.refused("h")
    assert rooms.release_safe(1)
    other = opened(2, "g")
    assert not other.cancel("g") and other.release_safe(2)  # failed before its create
    assert not other.creating("g")  # and a create after that asks nothing


def test_a_release_before_the_create_returned_stands() -> None:
    rooms = opened()
    assert rooms.creating("h")
    rooms.released("h")  # it failed at once, on the service's thread
    assert not rooms.created("h") and rooms.state("h") == DecodeState.RELEASED


def test_a_room_is_safe_only_when_every_handoff_of_it_is_released() -> None:
    rooms = opened(5, "a")
    rooms.open(5, "b")  # the receiver re-keyed to the handoff it takes
    rooms.close("a")  # never asked for: gone
    assert rooms.creating("b") and not rooms.created("b")
    assert not rooms.release_safe(5) and rooms.release_safe(6)
    rooms.released("b")
    assert rooms.release_safe(5)


def test_events_route_to_an_open_handoff_only_and_a_reopened_one_routes_again() -> None:
    rooms = opened(3, "h")
    assert rooms.room_of("h") == 3 and rooms.room_of("other") is None
    assert rooms.creating("h") and not rooms.created("h")
    rooms.close("h")  # still leased: kept for `release_safe`, but no event routes to it
    assert rooms.room_of("h") is None and not rooms.release_safe(3)
    rooms.open(3, "h")  # the engine follows it again: its record stands, leased
    assert rooms.room_of("h") == 3 and rooms.state("h") == DecodeState.HELD


def test_an_unreachable_prefill_is_noted_on_the_room_until_its_records_go() -> None:
    rooms = opened(4, "h")
    assert not rooms.unreachable(4)
    rooms.note_unreachable(4)
    assert rooms.unreachable(4) and not rooms.unreachable(5)
    rooms.close("h")  # never asked for: released and forgotten, the note with it
    assert not rooms.unreachable(4)
