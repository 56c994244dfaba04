"""Stage layouts: what one PP stage (or the whole decode instance) registers, tagged by layer id.

Called by the model builders in `kvhandoff.pipelines.models`, by engines that publish flat pointer
lists, and by the service when it exchanges layouts with peers. The layer-id contract (see
DESIGN.md): every entry carries its *global* model layer id; KV entries are ordered group-major (all
layers of group 0, then group 1, ...), and the published `kv_layer_ids` list repeats the stage's
full-attention layer ids once per group. Entries are later paired by id, never by position.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from functools import cached_property
from typing import Annotated, NamedTuple, NewType

import msgspec
from msgspec import Meta, Struct

from kvhandoff.pipelines.errors import LayoutError

LayerId = NewType("LayerId", int)
#: The largest integer numpy's int64 and SQLite's INTEGER hold. Every integer a peer or a router
#: sends is bounded by it in its type, so a larger one is refused by name (422 naming the field)
#: instead of overflowing where it is used (an int64 array, a record).
MAX_WIRE_INT = 2**63 - 1
NonNeg = Annotated[int, Meta(ge=0, le=MAX_WIRE_INT)]
Positive = Annotated[int, Meta(gt=0, le=MAX_WIRE_INT)]


class KVEntry(Struct, frozen=True, forbid_unknown_fields=True):
    """One contiguous KV buffer of one full-attention layer and one buffer group."""

    layer_id: NonNeg
    group: NonNeg  # MHA: 0 = K, 1 = V; NPU MLA: 0 = c_kv, 1 = k_rope, 2 = indexer keys
    item_len: Positive  # bytes of one page in this buffer
    num_items: Positive  # pages in the pool
    base: NonNeg  # address of page 0

    @property
    def nbytes(self) -> int:
        return self.item_len * self.num_items


#: The component of state entries that name none: one slot per request for all of them.
DEFAULT_COMPONENT = "state"


class StateEntry(Struct, frozen=True, forbid_unknown_fields=True):
    """One linear-attention state tensor of one layer: one slot per request.

    `component` names the index space its slot is drawn from: entries of one component share
    a request's slot (a Mamba layer's conv and temporal state); another component (an engine's
    second state pool) has a slot of its own (`kvhandoff.pipelines.slots.RequestSlots`)."""

    layer_id: NonNeg
    kind: str  # "conv", "temporal", ...
    item_len: Positive  # bytes of one request slot
    num_slots: Positive
    base: NonNeg
    component: Annotated[str, Meta(min_length=1, max_length=64)] = DEFAULT_COMPONENT

    @property
    def nbytes(self) -> int:
        return self.item_len * self.num_slots


class AuxEntry(Struct, frozen=True, forbid_unknown_fields=True):
    """One per-request metadata buffer (an engine's output ids, logprobs, hidden states...):
    one row per request, indexed by the request's aux row. Written by the last PP stage only;
    aux entries pair by position (entry i with entry i), not by layer."""

    item_len: Positive  # bytes of one request row
    num_rows: Positive
    base: NonNeg

    @property
    def nbytes(self) -> int:
        return self.item_len * self.num_rows


class SlotBound(NamedTuple):
    """A state component's slot bound in a layout: its entry with the smallest pool."""

    component: str
    num_entries: int
    smallest: StateEntry


class StageLayout(Struct, frozen=True, forbid_unknown_fields=True, dict=True):
    """Everything one stage registers. `fingerprint` hashes all of it except addresses."""

    pp_rank: NonNeg
    pp_size: Positive
    page_size: Positive  # tokens per page
    dtype: str
    kv: tuple[KVEntry, ...] = ()
    state: tuple[StateEntry, ...] = ()
    aux: tuple[AuxEntry, ...] = ()
    # False for legacy layouts built from pointer lists without layer ids: their entries carry
    # positional ids and may only be paired positionally (PP = 1 on both sides).
    layer_ids_published: bool = True

    def __post_init__(self) -> None:
        if self.pp_rank >= self.pp_size:
            raise LayoutError(
                f"pp_rank {self.pp_rank} is not below pp_size {self.pp_size}", field="pp_rank"
            )
        if self.aux and self.pp_rank != self.pp_size - 1:
            # An engine computes a request's metadata on its last stage: aux rows from another
            # stage would be a second writer of the same decode row.
            raise LayoutError(
                f"stage {self.pp_rank} of {self.pp_size} registers {len(self.aux)} aux "
                f"entries; only the last PP stage ({self.pp_size - 1}) sends aux rows",
                field="aux",
                pp_rank=self.pp_rank,
            )

    # Cached: a frozen layout's hashes never change, and a pairing-cache lookup needs both.
    @cached_property
    def fingerprint(self) -> str:
        """Hash of the layout without addresses: equal fingerprints pair identically."""
        shape = (
            self.pp_rank,
            self.pp_size,
            self.page_size,
            self.dtype,
            self.layer_ids_published,
            [(e.layer_id, e.group, e.item_len, e.num_items) for e in self.kv],
            [(s.layer_id, s.kind, s.item_len, s.num_slots, s.component) for s in self.state],
            [(a.item_len, a.num_rows) for a in self.aux],
        )
        return hashlib.blake2b(msgspec.json.encode(shape), digest_size=12).hexdigest()

    @cached_property
    def address_key(self) -> str:
        """Hash of the addresses alone; with `fingerprint` it identifies a registered layout."""
        bases = (
            [e.base for e in self.kv],
            [s.base for s in self.state],
            [a.base for a in self.aux],
        )
        return hashlib.blake2b(msgspec.json.encode(bases), digest_size=12).hexdigest()

    @cached_property
    def has_addresses(self) -> bool:
        """Whether any entry names an address (a landed decode publishes none: every base 0)."""
        bases = [*(e.base for e in self.kv), *(s.base for s in self.state)]
        return any(bases) or any(a.base for a in self.aux)

    @property
    def kv_layer_ids(self) -> list[int]:
        """The flat id list engines publish: one id per KV buffer, in entry (group-major) order."""
        return [e.layer_id for e in self.kv]

    @property
    def full_attention_layers(self) -> list[int]:
        """Distinct KV layer ids in first-seen order."""
        return list(dict.fromkeys(e.layer_id for e in self.kv))

    @property
    def components(self) -> list[str]:
        """The state components, in first-seen order: one slot per request each."""
        return [bound.component for bound in self.slot_bounds]

    # The bounds below are cached like the hashes: a frozen layout's pools never change size,
    # and validating a request against a layout would otherwise rescan its entries every time.
    @cached_property
    def page_bound(self) -> KVEntry | None:
        """The KV entry with the smallest pool (the first of them): every page must lie in it."""
        return min(self.kv, key=lambda e: e.num_items) if self.kv else None

    @cached_property
    def slot_bounds(self) -> tuple[SlotBound, ...]:
        """Per state component (first-seen order): its entry with the smallest pool."""
        by_component: dict[str, list[StateEntry]] = {}
        for s in self.state:
            by_component.setdefault(s.component, []).append(s)
        return tuple(
            SlotBound(c, len(es), min(es, key=lambda e: e.num_slots))
            for c, es in by_component.items()
        )

    @cached_property
    def aux_bound(self) -> int | None:
        """The index of the aux entry with the fewest rows (None without aux entries)."""
        if not self.aux:
            return None
        return min(range(len(self.aux)), key=lambda i: self.aux[i].num_rows)

    @property
    def num_groups(self) -> int:
        layers = len(self.full_attention_layers)
        return len(self.kv) // layers if layers else 0

    def with_bases(
        self, kv_bases: Sequence[int], state_bases: Sequence[int], aux_bases: Sequence[int] = ()
    ) -> StageLayout:
        """The same layout placed at new addresses (e.g. once a pool has allocated it)."""
        if (
            len(kv_bases) != len(self.kv)
            or len(state_bases) != len(self.state)
            or len(aux_bases) != len(self.aux)
        ):
            raise LayoutError(
                f"expected {len(self.kv)} KV, {len(self.state)} state and {len(self.aux)} aux "
                f"bases, got {len(kv_bases)}, {len(state_bases)} and {len(aux_bases)}",
                field="bases",
            )
        return msgspec.structs.replace(
            self,
            kv=tuple(msgspec.structs.replace(e, base=int(b)) for e, b in zip(self.kv, kv_bases)),
            state=tuple(
                msgspec.structs.replace(s, base=int(b)) for s, b in zip(self.state, state_bases)
            ),
            aux=tuple(msgspec.structs.replace(a, base=int(b)) for a, b in zip(self.aux, aux_bases)),
        )

    def place(self, bases: Sequence[int]) -> StageLayout:
        """`with_bases` from one flat list in region order (KV, state, aux), as pools give it."""
        k, s = len(self.kv), len(self.kv) + len(self.state)
        return self.with_bases(bases[:k], bases[k:s], bases[s:])

    def unplaced(self) -> StageLayout:
        """This layout with every base 0: what a peer may learn of memory it must not reach
        (a landed decode's KV, state and aux pools; a prefill's stages)."""
        return self.place([0] * len(self.region_sizes))

    @property
    def region_sizes(self) -> list[int]:
        """Bytes of every entry, KV first, then state, then aux: what a pool must allocate for
        this layout (region i is entry i in that order)."""
        return (
            [e.nbytes for e in self.kv]
            + [s.nbytes for s in self.state]
            + [a.nbytes for a in self.aux]
        )


def group_layer_ids(kv_layer_ids: Sequence[int], num_buffers: int) -> tuple[list[int], int]:
    """Split a published id list into (distinct layer ids, number of groups).

    Accepts either the published form (one id per buffer: the distinct ids repeated once per group)
    or the distinct ids alone. A buffer count that is not a whole multiple of the layer count is a
    layout error naming both numbers, never a truncation.
    """
    ids = [int(i) for i in kv_layer_ids]
    if not ids:
        raise LayoutError("kv_layer_ids is empty", field="kv_layer_ids")
    if any(i < 0 for i in ids):
        raise LayoutError("kv_layer_ids holds a negative id", field="kv_layer_ids")
    distinct = list(dict.fromkeys(ids))
    if len(ids) == num_buffers and len(distinct) != len(ids):
        # Published, repeated form: must be exactly `distinct` repeated once per group.
        groups, rest = divmod(len(ids), len(distinct))
        if rest or ids != distinct * groups:
            raise LayoutError(
                f"kv_layer_ids of length {len(ids)} is not {len(distinct)} distinct layer ids "
                "repeated once per buffer group (group-major order)",
                field="kv_layer_ids",
            )
        return distinct, groups
    if len(distinct) != len(ids):
        raise LayoutError(
            f"kv_layer_ids lists {len(ids)} ids for {num_buffers} buffers but repeats some; "
            "give one id per buffer or each layer id once",
            field="kv_layer_ids",
        )
    groups, rest = divmod(num_buffers, len(ids))
    if rest or groups == 0:
        raise LayoutError(
            f"{num_buffers} KV buffers cannot be split evenly over {len(ids)} layer ids "
            f"({num_buffers} % {len(ids)} = {num_buffers % len(ids)})",
            field="kv_data_ptrs",
            num_buffers=num_buffers,
            num_layers=len(ids),
        )
    return ids, groups


def publish_kv_layer_ids(layer_ids: Sequence[int], num_groups: int) -> list[int]:
    """The flat id list for `num_groups` buffer groups: ids repeated once per group."""
    if num_groups <= 0:
        raise LayoutError("num_groups must be positive", field="num_groups")
    return [int(i) for i in layer_ids] * num_groups


def layout_from_flat_lists(
    *,
    pp_rank: int,
    pp_size: int,
    page_size: int,
    dtype: str,
    kv_data_ptrs: Sequence[int],
    kv_data_lens: Sequence[int],
    kv_item_lens: Sequence[int],
    kv_layer_ids: Sequence[int] | None = None,
    state_data_ptrs: Sequence[int] = (),
    state_data_lens: Sequence[int] = (),
    state_item_lens: Sequence[int] = (),
    state_layer_ids: Sequence[int] = (),
    state_kinds: Sequence[str] = (),
    state_components: Sequence[str] = (),
    aux_data_ptrs: Sequence[int] = (),
    aux_data_lens: Sequence[int] = (),
    aux_item_lens: Sequence[int] = (),
) -> StageLayout:
    """Build a layout from the flat lists engines publish today.

    `kv_*` lists have one element per KV buffer (group-major). Without `kv_layer_ids` the layout
    is legacy: entries get positional ids and `layer_ids_published` is False. `state_*` lists
    have one element per state buffer (`state_components` empty: all of the default
    component); `aux_*` one per aux buffer, whose rows are `aux_item_lens[i]` bytes.
    """
    return StageLayout(
        pp_rank=pp_rank,
        pp_size=pp_size,
        page_size=page_size,
        dtype=dtype,
        kv=_kv_entries(kv_data_ptrs, kv_data_lens, kv_item_lens, kv_layer_ids),
        state=_state_entries(
            state_data_ptrs,
            state_data_lens,
            state_item_lens,
            state_layer_ids,
            state_kinds,
            list(state_components) or [DEFAULT_COMPONENT] * len(state_data_ptrs),
        ),
        aux=_aux_entries(aux_data_ptrs, aux_data_lens, aux_item_lens),
        layer_ids_published=kv_layer_ids is not None,
    )


def _check_lengths(anchor: str, count: int, lists: dict[str, Sequence[object]]) -> None:
    """Every list of `lists` has one element per element of the list named `anchor`."""
    for name, values in lists.items():
        if len(values) != count:
            raise LayoutError(f"{name} has {len(values)} elements for {count} {anchor}", field=name)


def _kv_entries(
    ptrs: Sequence[int],
    data_lens: Sequence[int],
    item_lens: Sequence[int],
    layer_ids: Sequence[int] | None,
) -> tuple[KVEntry, ...]:
    """Group-major KV entries; without `layer_ids` (legacy) positional ids, all of group 0."""
    n = len(ptrs)
    _check_lengths("kv_data_ptrs", n, {"kv_data_lens": data_lens, "kv_item_lens": item_lens})
    if layer_ids is not None and n:
        layers, _ = group_layer_ids(layer_ids, n)
        ids = [layers[i % len(layers)] for i in range(n)]
        group_of = [i // len(layers) for i in range(n)]
    elif layer_ids is not None:
        ids, group_of = [], []
    else:
        ids, group_of = list(range(n)), [0] * n
    return tuple(
        _kv_entry(i, ids[i], group_of[i], ptrs[i], data_lens[i], item_lens[i]) for i in range(n)
    )


def _state_entries(
    ptrs: Sequence[int],
    data_lens: Sequence[int],
    item_lens: Sequence[int],
    layer_ids: Sequence[int],
    kinds: Sequence[str],
    components: Sequence[str],
) -> tuple[StateEntry, ...]:
    m = len(ptrs)
    lists: dict[str, Sequence[object]] = {
        "state_data_lens": data_lens,
        "state_item_lens": item_lens,
        "state_layer_ids": layer_ids,
        "state_kinds": kinds,
        "state_components": components,
    }
    _check_lengths("state_data_ptrs", m, lists)
    return tuple(
        _state_entry(j, layer_ids[j], kinds[j], ptrs[j], data_lens[j], item_lens[j], components[j])
        for j in range(m)
    )


def _aux_entries(
    ptrs: Sequence[int], data_lens: Sequence[int], item_lens: Sequence[int]
) -> tuple[AuxEntry, ...]:
    a = len(ptrs)
    _check_lengths("aux_data_ptrs", a, {"aux_data_lens": data_lens, "aux_item_lens": item_lens})
    return tuple(_aux_entry(i, ptrs[i], data_lens[i], item_lens[i]) for i in range(a))


def _kv_entry(i: int, layer: int, group: int, ptr: int, data_len: int, item_len: int) -> KVEntry:
    if item_len <= 0 or data_len % item_len:
        raise LayoutError(
            f"KV buffer {i} (layer {layer}, group {group}): data length {data_len} is not a "
            f"positive multiple of item length {item_len}",
            field=f"kv_item_lens[{i}]",
            layer_id=layer,
            group=group,
        )
    return KVEntry(layer, group, item_len, data_len // item_len, ptr)


def _aux_entry(i: int, ptr: int, data_len: int, item_len: int) -> AuxEntry:
    if item_len <= 0 or data_len % item_len:
        raise LayoutError(
            f"aux entry {i}: data length {data_len} is not a positive multiple of its row "
            f"size {item_len}",
            field=f"aux_item_lens[{i}]",
            aux=i,
        )
    return AuxEntry(int(item_len), data_len // item_len, int(ptr))


def _state_entry(
    j: int, layer: int, kind: str, ptr: int, data_len: int, item_len: int, component: str
) -> StateEntry:
    if item_len <= 0 or data_len % item_len:
        raise LayoutError(
            f"state buffer {j} (layer {layer}, kind {kind}): data length {data_len} is not a "
            f"positive multiple of slot size {item_len}",
            field=f"state_item_lens[{j}]",
            layer_id=layer,
            kind=kind,
        )
    return StateEntry(layer, kind, item_len, data_len // item_len, ptr, component)
