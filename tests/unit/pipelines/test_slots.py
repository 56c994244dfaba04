"""A request's indices: the single slot for every component not named, the aux row apart."""

from kvhandoff.pipelines.slots import AUX, NO_SLOTS, RequestSlots, as_slots


def test_the_single_slot_stands_for_every_component_not_named() -> None:
    slots = RequestSlots(3, {"ring": 5}, aux=7)
    assert (slots.of("mamba"), slots.of("ring"), slots.of(AUX)) == (3, 5, 7)
    assert slots.field_of("mamba", "dst") == "dst_slot"
    assert slots.field_of("ring", "dst") == "dst_slots.ring"
    assert slots.field_of(AUX, "src") == "src_aux"
    assert RequestSlots(aux=0).of("state") is None and not RequestSlots(aux=0).empty


def test_the_single_slot_form_of_earlier_callers() -> None:
    assert as_slots(4) == RequestSlots(slot=4)
    assert as_slots(None) is NO_SLOTS and NO_SLOTS.empty
    given = RequestSlots(1, aux=2)
    assert as_slots(given) is given
