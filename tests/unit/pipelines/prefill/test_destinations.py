"""What a destination says of its decode (`kvhandoff.pipelines.prefill.destinations`): checked on
receipt naming the field, and each decode life held to what its first accepted destination named;
its layout decoded once per decode life, later destinations compared by their bytes."""

from __future__ import annotations

import json
from typing import Any

import msgspec
import pytest

from kvhandoff.pipelines.errors import ConflictError, InvalidInput, KVHandoffError
from kvhandoff.pipelines.layout import StageLayout
from kvhandoff.pipelines.messages import ArenaSpan, DestinationMsg, Grant, layout_json
from kvhandoff.pipelines.models import decode_layout, hybrid_mha
from kvhandoff.pipelines.prefill import destinations
from kvhandoff.pipelines.prefill.destinations import (
    DecodeLives,
    check_decode_side,
    check_destination,
)
from tests.unit.pipelines.helpers import place

LAYOUT = decode_layout(hybrid_mha(num_layers=4), num_pages=8, num_slots=2)
ARENA = ArenaSpan(addr=0x1000, length=0x10000)


def destination(**fields: Any) -> DestinationMsg:
    """A well-formed landed destination; a StageLayout given as `decode_layout` travels encoded,
    as the decode sends it."""
    if isinstance(fields.get("decode_layout"), StageLayout):
        fields["decode_layout"] = layout_json(fields["decode_layout"])
    base: dict[str, Any] = dict(
        handoff_id="h",
        decode_url="http://decode:1",
        decode_incarnation="d1",
        prefill_incarnation="p1",
        decode_target="decode:2",
        decode_layout=layout_json(LAYOUT.unplaced()),
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


def check(dest: DestinationMsg, lives: DecodeLives | None = None) -> StageLayout:
    """`dest` checked as `PrefillPipeline.deliver` checks it; its layout, which that pins."""
    layout = (lives or DecodeLives()).layout(dest)
    check_destination(dest, layout)
    return layout


class CountingDecoder:
    """The module's layout decoder, counting its decodes."""

    def __init__(self) -> None:
        self.decodes = 0
        self._decoder = msgspec.json.Decoder(StageLayout)

    def decode(self, raw: msgspec.Raw) -> StageLayout:
        self.decodes += 1
        return self._decoder.decode(raw)


@pytest.fixture
def decoder(monkeypatch: pytest.MonkeyPatch) -> CountingDecoder:
    counting = CountingDecoder()
    monkeypatch.setattr(destinations, "_layout_decoder", counting)
    return counting


def test_a_life_decodes_its_layout_once_and_later_equal_bytes_use_the_pinned_one(
    decoder: CountingDecoder,
) -> None:
    lives = DecodeLives()
    first = destination()
    layout = check(first, lives)
    assert decoder.decodes == 1 and layout == LAYOUT.unplaced()
    lives.pin(first, layout)
    later = destination(handoff_id="h2")  # the same bytes, another buffer
    assert later.decode_layout is not first.decode_layout
    assert check(later, lives) is layout  # its bounds are cached already
    assert lives.side(later).layout is layout
    check_decode_side(later, lives.side(later), lives.layout(later))
    assert decoder.decodes == 1
    # A restarted decode (another life) decodes its layout again, though the bytes are equal.
    restarted = destination(handoff_id="h3", decode_incarnation="d2")
    lives.pin(restarted, check(restarted, lives))
    assert decoder.decodes == 2
    assert lives.side(restarted).layout is not layout


def test_equal_content_in_other_bytes_is_decoded_and_accepted_by_content(
    decoder: CountingDecoder,
) -> None:
    lives = DecodeLives()
    first = destination()
    lives.pin(first, check(first, lives))
    # Another encoder's bytes (spaces, another key order): not the pinned bytes, so decoded.
    shuffled = dict(reversed(list(msgspec.to_builtins(LAYOUT.unplaced()).items())))
    other = destination(handoff_id="h2", decode_layout=msgspec.Raw(json.dumps(shuffled).encode()))
    assert other.decode_layout != first.decode_layout
    layout = check(other, lives)
    assert decoder.decodes == 2 and layout == lives.side(first).layout
    check_decode_side(other, lives.side(other), layout)


@pytest.mark.parametrize(
    ("text", "field"),
    [
        (b'{"pp_rank": 0}', "decode_layout.pp_size"),  # a required key missing
        (
            b'{"pp_rank": 0, "pp_size": 1, "page_size": 1, "dtype": "x", "kv": 3}',
            "decode_layout.kv",
        ),
        (b'{"pp_rank": 2, "pp_size": 1, "page_size": 1, "dtype": "x"}', "decode_layout.pp_rank"),
        (b"[]", "decode_layout"),
    ],
)
def test_an_invalid_layout_is_refused_naming_the_field_within_it(text: bytes, field: str) -> None:
    lives = DecodeLives()
    lives.pin(destination(), LAYOUT.unplaced())
    with pytest.raises(InvalidInput) as refused:
        check(destination(handoff_id="h2", decode_layout=msgspec.Raw(text)), lives)
    assert refused.value.context["field"] == field, refused.value


def test_a_known_life_checks_against_its_pinned_layout_only_when_the_bytes_are_equal() -> None:
    lives = DecodeLives()
    first = destination()
    lives.pin(first, check(first, lives))
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
    lives.pin(first, check(first, lives))
    check_decode_side(first, lives.side(first), lives.layout(first))
    later = destination(handoff_id="h2", **fields)
    lives.pin(later, lives.layout(later))  # does not move the pin
    with pytest.raises(ConflictError) as refused:
        check_decode_side(later, lives.side(later), lives.layout(later))
    assert refused.value.context["field"] == field


def test_another_life_of_the_decode_names_its_own_side() -> None:
    lives = DecodeLives()
    first = destination()
    lives.pin(first, check(first, lives))
    restarted = destination(decode_incarnation="d2", decode_target="decode:3")
    lives.pin(restarted, check(restarted, lives))
    assert lives.side(restarted).target == "decode:3"
    check_decode_side(restarted, lives.side(restarted), lives.layout(restarted))
