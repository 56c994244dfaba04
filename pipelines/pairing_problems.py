"""Pairing problems: every reason a source stage layout cannot be paired with a destination.

`find_problems` is the one check, called once per layout pair by `kvhandoff.pipelines.pairing.pair`
(which raises on any problem) and by `kvhandoff.pipelines.pairing_report` (which lists them all). KV
entries match by `(layer_id, group)`, state entries by `(layer_id, kind)` (and must agree on their
component), aux entries by position; positionally for legacy layouts that publish no layer ids
on either side with PP = 1. Each problem names where it is (layer, group, kind, aux entry).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Any

from msgspec import Struct

from kvhandoff.pipelines.errors import LayoutError
from kvhandoff.pipelines.layout import AuxEntry, KVEntry, StageLayout, StateEntry, group_layer_ids

#: Index pairs (source entry, destination entry) of one kind of entry.
Pairs = list[tuple[int, int]]


class Problem(Struct, frozen=True, omit_defaults=True):
    """One reason two layouts cannot be paired, naming where it is."""

    code: str  # e.g. "missing_destination", "item_len_mismatch", "slot_size_mismatch"
    message: str
    pp_rank: int | None = None
    layer_id: int | None = None
    group: int | None = None
    kind: str | None = None
    aux: int | None = None  # the aux entry's position


def _layout_problems(layout: StageLayout, side: str) -> list[Problem]:
    """Contract checks on one layout: ids repeat once per group, groups in group-major order."""
    problems: list[Problem] = []
    rank = layout.pp_rank if side == "source" else None
    if layout.kv and layout.layer_ids_published:
        try:
            layers, groups = group_layer_ids(layout.kv_layer_ids, len(layout.kv))
        except LayoutError as exc:
            problems.append(Problem("layout_error", f"{side} layout: {exc.message}", pp_rank=rank))
        else:
            for i, e in enumerate(layout.kv):
                if e.group != i // len(layers):
                    problems.append(
                        Problem(
                            "layout_error",
                            f"{side} KV entry {i} (layer {e.layer_id}) has group {e.group}, but "
                            f"group-major order over {groups} group(s) puts group "
                            f"{i // len(layers)} there",
                            pp_rank=rank,
                            layer_id=e.layer_id,
                            group=e.group,
                        )
                    )
                    break
    seen: set[tuple[int, str]] = set()
    for s in layout.state:
        if (s.layer_id, s.kind) in seen:
            problems.append(
                Problem(
                    "layout_error",
                    f"{side} layout lists state of layer {s.layer_id} kind {s.kind!r} twice",
                    pp_rank=rank,
                    layer_id=s.layer_id,
                    kind=s.kind,
                )
            )
        seen.add((s.layer_id, s.kind))
    return problems


def _match(
    src_keys: Sequence[Hashable], dst_keys: Sequence[Hashable]
) -> tuple[Pairs, list[tuple[int, int]], list[int]]:
    """Return (pairs, duplicates as (src index, count), src indices with no match)."""
    where: dict[Hashable, list[int]] = defaultdict(list)
    for j, key in enumerate(dst_keys):
        where[key].append(j)
    pairs, dups, missing = [], [], []
    for i, key in enumerate(src_keys):
        hits = where.get(key, [])
        if not hits:
            missing.append(i)
        elif len(hits) > 1:
            dups.append((i, len(hits)))
        else:
            pairs.append((i, hits[0]))
    return pairs, dups, missing


def _where(entry: KVEntry | StateEntry, index: int = 0) -> tuple[str, dict[str, Any]]:
    """How a problem names an entry: text and the structured fields an HTTP error carries
    (an aux entry by its position `index`)."""
    if isinstance(entry, AuxEntry):
        return f"aux entry {index}", {"aux": index}
    if isinstance(entry, KVEntry):
        return f"layer {entry.layer_id} group {entry.group}", {
            "layer_id": entry.layer_id,
            "group": entry.group,
        }
    return f"layer {entry.layer_id} kind {entry.kind!r}", {
        "layer_id": entry.layer_id,
        "kind": entry.kind,
    }


@dataclass(frozen=True, slots=True)
class _EntryKind:
    """How problems name one kind of entry matched by key (KV or state)."""

    noun: str
    size_code: str
    size_text: str
    unit: str


_KV = _EntryKind("KV", "item_len_mismatch", "KV item length", "bytes per page")
_STATE = _EntryKind("state", "slot_size_mismatch", "state slot size", "bytes")


def _entry_problems(
    problems: list[Problem],
    rank: int,
    entries: tuple[
        Sequence[KVEntry] | Sequence[StateEntry], Sequence[KVEntry] | Sequence[StateEntry]
    ],
    keys: tuple[Sequence[Hashable], Sequence[Hashable]],
    kind: _EntryKind,
) -> Pairs:
    """Match one kind of entry (KV or state), appending every problem; returns the pairs."""
    src_entries, dst_entries = entries
    pairs, dups, missing = _match(*keys)
    for i in missing:
        text, fields = _where(src_entries[i])
        problems.append(
            Problem(
                "missing_destination",
                f"destination has no {kind.noun} entry for {text}",
                pp_rank=rank,
                **fields,
            )
        )
    for i, count in dups:
        text, fields = _where(src_entries[i])
        problems.append(
            Problem(
                "duplicate_destination",
                f"destination has {count} {kind.noun} entries for {text}",
                pp_rank=rank,
                **fields,
            )
        )
    for i, j in pairs:
        a, b = src_entries[i], dst_entries[j]
        if isinstance(a, StateEntry) and isinstance(b, StateEntry) and a.component != b.component:
            text, fields = _where(a)
            problems.append(
                Problem(
                    "component_mismatch",
                    f"state of {text} is of component {a.component!r} on the source and "
                    f"{b.component!r} on the destination: their slots would not agree",
                    pp_rank=rank,
                    **fields,
                )
            )
        if a.item_len != b.item_len:
            text, fields = _where(a)
            problems.append(
                Problem(
                    kind.size_code,
                    f"{kind.size_text} differs for {text}: source {a.item_len} {kind.unit}, "
                    f"destination {b.item_len}",
                    pp_rank=rank,
                    **fields,
                )
            )
    return pairs


def _aux_problems(problems: list[Problem], src: StageLayout, dst: StageLayout) -> list[int]:
    """Pair aux entries by position: the last stage's must match the decode's one for one, of
    equal row size; other stages have none (the layout refuses them). Returns the positions."""
    rank = src.pp_rank
    if src.pp_rank != src.pp_size - 1 and not src.aux:
        return []
    for i in range(len(src.aux), len(dst.aux)):
        problems.append(
            Problem(
                "missing_source",
                f"the last stage has no aux entry {i} for the destination's aux entry {i} "
                f"({len(src.aux)} aux entries, destination {len(dst.aux)})",
                pp_rank=rank,
                aux=i,
            )
        )
    for i in range(len(dst.aux), len(src.aux)):
        problems.append(
            Problem(
                "missing_destination",
                f"destination has no aux entry {i} ({len(dst.aux)} aux entries, source "
                f"{len(src.aux)})",
                pp_rank=rank,
                aux=i,
            )
        )
    pairs = list(range(min(len(src.aux), len(dst.aux))))
    for i in pairs:
        a, b = src.aux[i], dst.aux[i]
        if a.item_len != b.item_len:
            problems.append(
                Problem(
                    "aux_size_mismatch",
                    f"aux row size differs for aux entry {i}: source {a.item_len} bytes, "
                    f"destination {b.item_len}",
                    pp_rank=rank,
                    aux=i,
                )
            )
    return pairs


def find_problems(
    src: StageLayout, dst: StageLayout
) -> tuple[list[Problem], Pairs, Pairs, list[int]]:
    """All problems of pairing `src` with `dst`, plus the KV and state index pairs and the aux
    positions found."""
    problems = [
        *_layout_problems(src, "source"),
        *_layout_problems(dst, "destination"),
        *_format_problems(src, dst),
    ]
    keys = _match_keys(problems, src, dst)
    if keys is None:
        return problems, [], [], []
    kv_keys, state_keys = keys
    rank = src.pp_rank
    kv_pairs = _entry_problems(problems, rank, (src.kv, dst.kv), kv_keys, _KV)
    st_pairs = _entry_problems(problems, rank, (src.state, dst.state), state_keys, _STATE)
    aux_pairs = _aux_problems(problems, src, dst)
    return problems, kv_pairs, st_pairs, aux_pairs


def _format_problems(src: StageLayout, dst: StageLayout) -> list[Problem]:
    """Page size and dtype: what every entry's bytes mean must agree on both sides."""
    problems = []
    if src.page_size != dst.page_size:
        problems.append(
            Problem(
                "page_size_mismatch",
                f"page size differs: source {src.page_size} tokens, destination {dst.page_size}",
                pp_rank=src.pp_rank,
            )
        )
    if src.dtype != dst.dtype:
        problems.append(
            Problem(
                "dtype_mismatch",
                f"dtype differs: source {src.dtype}, destination {dst.dtype}",
                pp_rank=src.pp_rank,
            )
        )
    return problems


_Keys = tuple[Sequence[Hashable], Sequence[Hashable]]


def _match_keys(
    problems: list[Problem], src: StageLayout, dst: StageLayout
) -> tuple[_Keys, _Keys] | None:
    """The keys KV and state entries match by on each side: (layer id, group or kind), or the
    position where neither side publishes ids and PP = 1. None (with the problem appended)
    where entries cannot be matched at all."""
    rank = src.pp_rank
    if src.layer_ids_published != dst.layer_ids_published:
        side = "source" if not src.layer_ids_published else "destination"
        problems.append(
            Problem(
                "layer_ids_missing",
                f"the {side} layout publishes no layer ids, so its entries cannot be paired by id",
                pp_rank=rank,
            )
        )
        return None
    if src.layer_ids_published:
        return (
            ([(e.layer_id, e.group) for e in src.kv], [(e.layer_id, e.group) for e in dst.kv]),
            ([(s.layer_id, s.kind) for s in src.state], [(s.layer_id, s.kind) for s in dst.state]),
        )
    if src.pp_size != 1 or dst.pp_size != 1:
        problems.append(
            Problem(
                "positional_not_allowed",
                "neither layout publishes layer ids; positional pairing is only safe with "
                f"PP = 1 on both sides (source pp_size {src.pp_size}, destination "
                f"pp_size {dst.pp_size})",
                pp_rank=rank,
            )
        )
        return None
    return (
        (list(range(len(src.kv))), list(range(len(dst.kv)))),
        (list(range(len(src.state))), list(range(len(dst.state)))),
    )
