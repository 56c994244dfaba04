import msgspec
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvhandoff.pipelines.errors import PlanError
from kvhandoff.pipelines.layout import StageLayout
from kvhandoff.pipelines.models import (
    AttentionKind,
    KVGroup,
    ModelSpec,
    StateKind,
    decode_layout,
    every_nth,
    hybrid_npu_mla,
    partition_layers,
    stage_layout,
)
from kvhandoff.pipelines.pairing import Pairing, pair
from kvhandoff.pipelines.planning import find_runs, plan, validate_pages_for_layout
from kvhandoff.pipelines.planning_reference import reference_plan, reference_runs
from kvhandoff.pipelines.slots import RequestSlots
from tests.unit.pipelines.helpers import place_packed

MODEL = hybrid_npu_mla(num_layers=16, scale=64, page_size=16)
PART = partition_layers(16, 4)


def pairing(rank: int = 1, num_pages: int = 32, num_slots: int = 4) -> Pairing:
    src = place_packed(
        stage_layout(MODEL, PART, rank, num_pages=num_pages, num_slots=num_slots), 1 << 32
    )
    dst = place_packed(decode_layout(MODEL, num_pages=num_pages, num_slots=num_slots), 1 << 40)
    return pair(src, dst)


def triples(p: Pairing, *args: object, **kwargs: object) -> list[tuple[int, int, int]]:
    b = plan(p, *args, **kwargs).blocks  # type: ignore[arg-type]
    return list(zip(b.src_addr.tolist(), b.dst_addr.tolist(), b.length.tolist()))


def test_runs_step_by_one_on_both_sides() -> None:
    src = np.array([4, 5, 6, 10, 11, 3])
    dst = np.array([0, 1, 9, 10, 11, 12])
    s0, d0, n = find_runs(src, dst)
    assert list(zip(s0.tolist(), d0.tolist(), n.tolist())) == [
        (4, 0, 2),
        (6, 9, 1),
        (10, 10, 2),
        (3, 12, 1),
    ]
    assert reference_runs(src.tolist(), dst.tolist()) == [
        (4, 0, 2),
        (6, 9, 1),
        (10, 10, 2),
        (3, 12, 1),
    ]


@pytest.mark.parametrize(
    ("src", "dst", "src_slot", "dst_slot", "field", "text"),
    [
        ([0, 1], [0], 0, 0, "dst_pages", "src_pages has 2 pages but dst_pages has 1"),
        ([0, 32], [0, 1], 0, 0, "src_pages[1]", "src_pages[1] = 32 is outside the source pool"),
        ([0, 1], [5, -1], 0, 0, "dst_pages[1]", "dst_pages[1] = -1 is outside the destination"),
        ([0, 1, 2], [7, 3, 7], 0, 0, "dst_pages[2]", "dst_pages[2] = 7 repeats dst_pages[0]"),
        ([0], [0], None, 0, "src_slot", "src_slot is required"),
        ([0], [0], 0, 4, "dst_slot", "dst_slot = 4 is outside the state pool of layer 4"),
        ([[0]], [[0]], 0, 0, "src_pages", "flat list"),
        ([0.5], [1.0], 0, 0, "src_pages", "must hold integers"),
    ],
)
def test_bad_requests_name_the_offending_field(
    src: list[int],
    dst: list[int],
    src_slot: int | None,
    dst_slot: int | None,
    field: str,
    text: str,
) -> None:
    with pytest.raises(PlanError) as err:
        plan(pairing(), src, dst, src_slot, dst_slot)
    assert err.value.context["field"] == field
    assert text in str(err.value)


@pytest.mark.parametrize("n", [3, 20])  # checked on Python ints, and with numpy
@pytest.mark.parametrize(
    ("side", "at", "value", "field", "text"),
    [
        ("src", 1, 32, "src_pages[1]", "src_pages[1] = 32 is outside the source pool"),
        ("dst", 2, -1, "dst_pages[2]", "dst_pages[2] = -1 is outside the destination"),
        ("dst", 2, 0, "dst_pages[2]", "dst_pages[2] = 0 repeats dst_pages[0]"),
    ],
)
def test_short_and_long_requests_are_refused_alike(
    n: int, side: str, at: int, value: int, field: str, text: str
) -> None:
    pages = {"src": list(range(n)), "dst": list(range(n))}
    pages[side][at] = value
    with pytest.raises(PlanError) as err:
        plan(pairing(), pages["src"], pages["dst"], 0, 0)
    assert err.value.context["field"] == field
    assert text in str(err.value)


def test_out_of_range_names_layer_and_group_of_the_smallest_pool() -> None:
    with pytest.raises(PlanError) as err:
        plan(pairing(), [0, 40], [0, 1], 0, 0)
    assert err.value.context == {"field": "src_pages[1]", "layer_id": 7, "group": 0}


def test_layers_filter_and_state_toggle() -> None:
    p = pairing()
    only_kv7 = plan(p, [0, 1, 5], [3, 4, 9], 0, 1, layers=[7], include_state=False)
    assert only_kv7.kv_blocks == 2 * 2 and only_kv7.slot_blocks == 0
    only_state = plan(p, [0, 1, 5], [3, 4, 9], 0, 1, layers=[4, 5])
    assert only_state.kv_blocks == 0 and only_state.slot_blocks == 4
    assert only_state.pair_of_block.tolist() == [2, 3, 5, 6]  # conv 4, conv 5, temporal 4, 5


def test_empty_page_list_moves_only_state() -> None:
    out = plan(pairing(), [], [], 2, 3)
    assert out.kv_blocks == 0 and out.slot_blocks == 6


def test_batches_respect_the_cap() -> None:
    p = pairing(num_pages=4096)
    pages = np.arange(0, 4096, 2)  # every run is one page: 2048 runs x 2 pairs + 6 state
    out = plan(p, pages, pages, 0, 0)
    assert len(out) == 2 * 2048 + 6
    sizes = [len(b) for b in out.batches(1000)]
    assert max(sizes) <= 1000 and sum(sizes) == len(out)
    assert [len(b) for b in out.batches()] == [2048, 2048, 6]


# ---------------------------------------------------------------------------------------------
# Property tests: the vectorised planner equals the per-entry reference and stays in bounds.


@st.composite
def layouts_and_request(
    draw: st.DrawFn,
) -> tuple[StageLayout, StageLayout, list[int], list[int], RequestSlots, RequestSlots]:
    num_layers = draw(st.integers(4, 24))
    interval = draw(st.integers(1, 4))
    groups = tuple(
        KVGroup(f"g{g}", draw(st.integers(1, 64))) for g in range(draw(st.integers(1, 3)))
    )
    kinds = tuple(
        StateKind(f"k{k}", draw(st.integers(1, 512)), draw(st.sampled_from(["a", "b"])))
        for k in range(draw(st.integers(0, 2)))
    )
    model = ModelSpec(
        name="random",
        num_layers=num_layers,
        full_attention_layers=every_nth(num_layers, interval),
        attention=AttentionKind.MHA,
        kv_groups=groups,
        state_kinds=kinds if interval > 1 else (),
        page_size=draw(st.sampled_from([1, 4, 16])),
        aux_row_bytes=tuple(draw(st.lists(st.integers(1, 64), max_size=2))),
    )
    pp = draw(st.integers(1, min(4, num_layers)))
    rank = draw(st.integers(0, pp - 1))
    src_pages_total = draw(st.integers(1, 96))
    dst_pages_total = draw(st.integers(1, 96))
    slots = draw(st.integers(1, 4))
    src = place_packed(
        stage_layout(
            model,
            partition_layers(num_layers, pp),
            rank,
            num_pages=src_pages_total,
            num_slots=slots,
        ),
        draw(st.integers(0, 1 << 40)),
    )
    dst = place_packed(
        decode_layout(model, num_pages=dst_pages_total, num_slots=slots),
        draw(st.integers(0, 1 << 40)),
    )
    n = draw(st.integers(0, min(src_pages_total, dst_pages_total)))
    # Fragmented lists: random order of distinct pages, with ascending stretches kept often.
    dst_pages = draw(st.permutations(range(dst_pages_total)))[:n]
    if draw(st.booleans()):
        dst_pages = sorted(dst_pages)
    src_pages = [draw(st.integers(0, src_pages_total - 1)) for _ in range(n)]
    if draw(st.booleans()) and n <= src_pages_total:
        start = draw(st.integers(0, src_pages_total - n))
        src_pages = list(range(start, start + n))

    def slots_of() -> RequestSlots:
        index = st.integers(0, slots - 1)
        named = draw(st.lists(st.sampled_from(["a", "b"]), unique=True))
        return RequestSlots(draw(index), {c: draw(index) for c in named}, draw(index))

    return src, dst, src_pages, dst_pages, slots_of(), slots_of()


@settings(max_examples=200, deadline=None)
@given(layouts_and_request())
def test_vectorised_planner_equals_reference_and_stays_inside_regions(
    case: tuple[StageLayout, StageLayout, list[int], list[int], RequestSlots, RequestSlots],
) -> None:
    src, dst, src_pages, dst_pages, src_slot, dst_slot = case
    p = pair(src, dst)
    got = plan(p, src_pages, dst_pages, src_slot, dst_slot)
    b = got.blocks
    as_tuples = list(zip(b.src_addr.tolist(), b.dst_addr.tolist(), b.length.tolist()))
    assert as_tuples == reference_plan(p, src_pages, dst_pages, src_slot, dst_slot)
    assert b.total_bytes == len(src_pages) * p.kv_bytes_per_page + p.slot_bytes
    assert p.num_aux_pairs == (len(src.aux) if src.pp_rank == src.pp_size - 1 else 0)

    def regions(layout: StageLayout) -> list[tuple[int, int]]:
        entries = [*layout.kv, *layout.state, *layout.aux]
        return [(e.base, e.base + e.nbytes) for e in entries]

    for addrs, regs in ((b.src_addr, regions(src)), (b.dst_addr, regions(dst))):
        for a, n in zip(addrs.tolist(), b.length.tolist()):
            assert any(lo <= a and a + n <= hi for lo, hi in regs)
    # Destination ranges never overlap: no byte is written twice.
    order = np.argsort(b.dst_addr)
    ends = b.dst_addr[order] + b.length[order]
    assert np.all(ends[:-1] <= b.dst_addr[order][1:])


# ---------------------------------------------------------------------------------------------
# Slots per state component, and the aux row

CONV, TEMPORAL, TAIL = 768, 1024, 96
COMPONENTS = msgspec.structs.replace(
    MODEL,
    state_kinds=(
        StateKind("conv", CONV, "mamba"),
        StateKind("temporal", TEMPORAL, "mamba"),
        StateKind("tail", TAIL, "ring"),
    ),
    aux_row_bytes=(16, 24),
)


def component_pairing(rank: int = 3) -> Pairing:
    src = place_packed(stage_layout(COMPONENTS, PART, rank, num_pages=8, num_slots=6), 1 << 32)
    dst = place_packed(decode_layout(COMPONENTS, num_pages=8, num_slots=6), 1 << 40)
    return pair(src, dst)


def test_each_component_moves_its_own_slot_and_the_aux_rows_their_row() -> None:
    p = component_pairing()
    src = RequestSlots(by_component={"mamba": 1, "ring": 3}, aux=2)
    dst = RequestSlots(slot=0, by_component={"ring": 5}, aux=4)  # mamba: the single slot 0
    out = plan(p, [], [], src, dst)
    s, d = p.src, p.dst
    expected = []
    for e in s.state:  # state blocks in pairing order, each at its own component's slot
        j = next(k for k, x in enumerate(d.state) if (x.layer_id, x.kind) == (e.layer_id, e.kind))
        si, di = (1, 0) if e.component == "mamba" else (3, 5)
        expected.append((e.base + si * e.item_len, d.state[j].base + di * e.item_len, e.item_len))
    for a, b in zip(s.aux, d.aux):  # then one block per aux entry, at the aux row
        expected.append((a.base + 2 * a.item_len, b.base + 4 * b.item_len, a.item_len))
    got = list(
        zip(out.blocks.src_addr.tolist(), out.blocks.dst_addr.tolist(), out.blocks.length.tolist())
    )
    assert got == expected
    assert out.slot_blocks == len(s.state) + 2


def test_aux_rows_follow_the_whole_stage_not_a_layer() -> None:
    p = component_pairing()
    src, dst = RequestSlots(1, aux=2), RequestSlots(0, aux=4)
    layer = p.src.state[0].layer_id
    by_layer = plan(p, [], [], src, dst, layers=[layer])
    assert by_layer.slot_rows.tolist() == [
        j for j, x in enumerate(p.slot_layer.tolist()) if x == layer
    ]
    alone = plan(p, [], [], src, dst, layers=(), include_aux=True)
    assert alone.slot_rows.tolist() == [p.num_state_pairs, p.num_state_pairs + 1]
    assert plan(p, [1], [2], src, dst, include_state=False).slot_blocks == 0


@pytest.mark.parametrize(
    ("src", "dst", "field", "text"),
    [
        (
            RequestSlots(1, aux=2),
            RequestSlots(by_component={"mamba": 0}, aux=1),
            "dst_slot",
            "dst_slot is required: the layouts pair 3 entries of component 'ring'",
        ),
        (
            RequestSlots(1, aux=2),
            RequestSlots(0, {"mamba": 6}, aux=1),
            "dst_slots.mamba",
            "dst_slots.mamba = 6 is outside the state pool of layer",
        ),
        (
            RequestSlots(1),
            RequestSlots(0, aux=1),
            "src_aux",
            "src_aux is required: the layouts pair 2 entries of the aux row",
        ),
        (
            RequestSlots(1, aux=2),
            RequestSlots(0, aux=6),
            "dst_aux",
            "dst_aux = 6 is outside the aux entry 0 on the destination side (rows 0..5)",
        ),
    ],
)
def test_a_missing_or_outside_slot_names_its_component_or_the_aux_row(
    src: RequestSlots, dst: RequestSlots, field: str, text: str
) -> None:
    with pytest.raises(PlanError) as err:
        plan(component_pairing(), [], [], src, dst)
    assert err.value.context["field"] == field
    assert text in err.value.message


def test_a_destination_naming_a_component_its_layout_lacks_is_refused() -> None:
    dst = decode_layout(COMPONENTS, num_pages=8, num_slots=6)
    with pytest.raises(PlanError) as err:
        validate_pages_for_layout(
            dst, [1], RequestSlots(0, {"swa": 1}, aux=0), side="destination", unique=True
        )
    assert err.value.context == {"field": "dst_slots.swa"}
    first = stage_layout(COMPONENTS, PART, 0, num_pages=8, num_slots=6)  # no aux, no "swa"
    validate_pages_for_layout(first, [1], RequestSlots(0, {"swa": 1}), side="source", unique=False)
    with pytest.raises(PlanError) as err:
        validate_pages_for_layout(dst, [1], RequestSlots(0), side="destination", unique=True)
    assert err.value.context == {"field": "dst_aux"}


@pytest.mark.parametrize("short", [True, False])
@pytest.mark.parametrize(
    ("bad", "field", "text"),
    [
        ({3: 32}, "dst_pages[3]", "dst_pages[3] = 32 is outside the destination pool"),
        ({2: -1}, "dst_pages[2]", "dst_pages[2] = -1 is outside"),
        ({4: 0}, "dst_pages[4]", "dst_pages[4] = 0 repeats dst_pages[0]"),
    ],
)
def test_short_and_long_page_lists_are_refused_alike(
    short: bool, bad: dict[int, int], field: str, text: str
) -> None:
    # A short list is checked on Python ints, a long one with numpy: the same answer either way.
    dst = decode_layout(MODEL, num_pages=32, num_slots=4)
    pages = list(range(5 if short else 20))
    for i, page in bad.items():
        pages[i] = page
    with pytest.raises(PlanError) as err:
        validate_pages_for_layout(dst, pages, 0, side="destination", unique=True)
    assert err.value.context["field"] == field
    assert text in err.value.message
    if "repeats" in text:  # a source may list a page twice
        validate_pages_for_layout(dst, pages, 0, side="source", unique=False)


@pytest.mark.parametrize("pages", [[True, False], np.array([1.0]), [[1]]])
def test_page_lists_must_be_flat_integers(pages: object) -> None:
    dst = decode_layout(MODEL, num_pages=32, num_slots=4)
    with pytest.raises(PlanError) as err:
        validate_pages_for_layout(dst, pages, 0, side="destination", unique=True)  # type: ignore[arg-type]
    assert err.value.context["field"] == "dst_pages"
    unsigned = validate_pages_for_layout(
        dst, np.array([1, 2], dtype=np.uint16), 0, side="destination", unique=True
    )
    assert unsigned.dtype == np.int64 and unsigned.tolist() == [1, 2]
