"""What a destination says of its decode (`kvhandoff.pipelines.prefill.destinations`): checked on
receipt naming the field, and each decode life held to what its first accepted destination named."""

from __future__ import annotations

from typing import Any

import pytest

from kvhandoff.pipelines.errors import ConflictError, KVHandoffError
from kvhandoff.pipelines.messages import ArenaSpan, DestinationMsg, Grant
from kvhandoff.pipelines.models import decode_layout, hybrid_mha
from kvhandoff.pipelines.prefill.destinations import (
    DecodeLives,
    check_decode_side,
    check_destination,
)
from tests.unit.pipelines.helpers import place

LAYOUT = decode_layout(hybrid_mha(num_layers=4), num_pages=8, num_slots=2)
ARENA = ArenaSpan(addr=0x1000, length=0x10000)


def destination(**fields: Any) -> DestinationMsg:
    base: dict[str, Any] = dict(
        handoff_id="h",
        decode_url="http://decode:1",
        decode_incarnation="d1",
        prefill_incarnation="p1",
        decode_target="decode:2",
        decode_layout=LAYOUT.unplaced(),
        pp_ranks=[0],
        dst_pages=[1, 2],
        dst_slot=0,
        deadline_in_s=5.0,
        mode="landed",
        arena=ARENA,
    )
    return DestinationMsg(**{**base, **fields})


@pytest.mark.parametrize(
    ("fields", "field"),
    [
        ({"arena": None}, "arena"),  # a landed decode without an arena
        ({"decode_layout": place(LAYOUT, 1 << 30, 1 << 28)}, "decode_layout"),  # landed, addresses
        ({"mode": "direct"}, "arena"),  # direct, yet an arena
        ({"dst_pages": [1, 8]}, "dst_pages[1]"),  # outside the layout it carries
        ({"dst_pages": [2, 2]}, "dst_pages[1]"),  # listed twice
        ({"dst_slot": 2}, "dst_slot"),  # outside the state pools
    ],
)
def test_a_destination_contradicting_itself_is_refused_naming_the_field(
    fields: dict[str, Any], field: str
) -> None:
    with pytest.raises(KVHandoffError) as refused:
        check(destination(**fields))
    assert refused.value.context["field"].startswith(field), refused.value


def test_well_formed_destinations_of_both_modes_pass() -> None:
    check(destination())
    check(destination(mode="direct", arena=None, decode_layout=place(LAYOUT, 1 << 30, 1 << 28)))


def check(dest: DestinationMsg, lives: DecodeLives | None = None) -> None:
    """`dest` checked as `PrefillPipeline.deliver` checks it."""
    check_destination(dest, (lives or DecodeLives()).layout(dest))


def test_a_known_life_checks_against_its_pinned_layout_only_when_the_content_is_equal() -> None:
    lives = DecodeLives()
    first = destination()
    check(first, lives)
    lives.pin(first)
    later = destination(handoff_id="h2")
    assert later.decode_layout is not first.decode_layout
    assert lives.layout(later) is first.decode_layout  # its bounds are cached already
    check(later, lives)
    # Another layout is checked as itself, not as the pinned one it differs from: pages inside
    # the pinned pools but outside its own, or addresses the pinned one does not name.
    smaller = decode_layout(hybrid_mha(num_layers=4), num_pages=4, num_slots=2).unplaced()
    with pytest.raises(KVHandoffError) as refused:
        check(destination(handoff_id="h3", decode_layout=smaller, dst_pages=[5]), lives)
    assert refused.value.context["field"] == "dst_pages[0]"
    placed = place(LAYOUT, 1 << 30, 1 << 28)
    with pytest.raises(KVHandoffError) as refused:
        check(destination(handoff_id="h4", decode_layout=placed), lives)
    assert refused.value.context["field"] == "decode_layout"


@pytest.mark.parametrize(
    ("fields", "field"),
    [
        ({"decode_target": "elsewhere:2"}, "decode_target"),
        ({"arena": ArenaSpan(addr=0, length=1 << 40)}, "arena"),
        (
            {"decode_layout": decode_layout(hybrid_mha(num_layers=4), num_pages=9, num_slots=2)},
            "decode_layout",
        ),
        ({"grants": [Grant(grant_id=1, pp_rank=0, addr=0x20000, length=64)]}, "grants"),
        ({"grants": [Grant(grant_id=1, pp_rank=1, addr=0x1000, length=64)]}, "grants"),
    ],
)
def test_a_later_destination_of_a_life_naming_another_side_is_refused(
    fields: dict[str, Any], field: str
) -> None:
    lives = DecodeLives()
    first = destination()
    lives.pin(first)
    check_decode_side(first, lives.side(first))
    later = destination(handoff_id="h2", **fields)
    lives.pin(later)  # does not move the pin
    with pytest.raises(ConflictError) as refused:
        check_decode_side(later, lives.side(later))
    assert refused.value.context["field"] == field


def test_another_life_of_the_decode_names_its_own_side() -> None:
    lives = DecodeLives()
    lives.pin(destination())
    restarted = destination(decode_incarnation="d2", decode_target="decode:3")
    lives.pin(restarted)
    assert lives.side(restarted).target == "decode:3"
    check_decode_side(restarted, lives.side(restarted))
