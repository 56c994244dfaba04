"""The dry-run pairing report: every prefill stage paired with the decode layout, every problem
listed (not only the first), and coverage checked across stages.

Called by the service's `validate` endpoint and by the decode when it first meets a prefill's
layouts (`kvhandoff.pipelines.decode.prefill_peers`); no bytes move.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field

from msgspec import Struct
from msgspec.structs import replace

from kvhandoff.pipelines.layout import StageLayout
from kvhandoff.pipelines.pairing_problems import Pairs, Problem, find_problems


class StageReport(Struct, frozen=True):
    pp_rank: int
    ok: bool
    kv_pairs: int
    state_pairs: int
    kv_bytes_per_page: int  # bytes one page of this stage moves, over all its KV pairs
    state_bytes_per_slot: int  # bytes one request slot of this stage moves, over its state pairs
    layers: list[int]  # global layer ids this stage sends
    aux_pairs: int = 0  # aux entries this stage sends (the last stage only)
    aux_bytes_per_row: int = 0  # bytes of one request's aux rows


class PairingReport(Struct, frozen=True):
    ok: bool
    problems: list[Problem]
    stages: list[StageReport]
    destination_fingerprint: str


@dataclass(slots=True)
class _Writers:
    """Which PP ranks write each destination entry, by its index (KV, state, aux)."""

    kv: dict[int, list[int]] = field(default_factory=lambda: defaultdict(list))
    state: dict[int, list[int]] = field(default_factory=lambda: defaultdict(list))
    aux: dict[int, list[int]] = field(default_factory=lambda: defaultdict(list))

    def add(self, rank: int, kv: Pairs, state: Pairs, aux: list[int]) -> None:
        for _, j in kv:
            self.kv[j].append(rank)
        for _, j in state:
            self.state[j].append(rank)
        for j in aux:
            self.aux[j].append(rank)


def pairing_report(sources: Sequence[StageLayout], dst: StageLayout) -> PairingReport:
    """Pair every prefill stage with the decode layout and list *all* problems found.

    Beyond per-stage pairing this checks coverage: each destination entry must be written by
    exactly one stage, or the decode side would read a layer nobody sent (or two stages race).
    """
    problems: list[Problem] = []
    stages: list[StageReport] = []
    ranks = [s.pp_rank for s in sources]
    if len(set(ranks)) != len(ranks):
        problems.append(Problem("duplicate_stage", f"PP ranks {ranks} list a stage twice"))
    writers = _Writers()
    for src in sources:
        found, kv_pairs, st_pairs, aux_pairs = find_problems(src, dst)
        problems.extend(found)
        writers.add(src.pp_rank, kv_pairs, st_pairs, aux_pairs)
        stages.append(_stage_report(src, not found, kv_pairs, st_pairs, aux_pairs))
    pp_sizes = {s.pp_size for s in sources}
    if len(pp_sizes) > 1:
        problems.append(
            Problem("pp_size_mismatch", f"stages disagree on pp_size: {sorted(pp_sizes)}")
        )
    # An unwritten entry is a problem only once every stage of the instance is listed.
    complete = len(pp_sizes) == 1 and len(sources) == next(iter(pp_sizes))
    problems += _coverage_problems(dst, writers, complete)
    return PairingReport(
        ok=not problems,
        problems=problems,
        stages=stages,
        destination_fingerprint=dst.fingerprint,
    )


def _stage_report(
    src: StageLayout, ok: bool, kv_pairs: Pairs, st_pairs: Pairs, aux_pairs: list[int]
) -> StageReport:
    return StageReport(
        pp_rank=src.pp_rank,
        ok=ok,
        kv_pairs=len(kv_pairs),
        state_pairs=len(st_pairs),
        kv_bytes_per_page=sum(src.kv[i].item_len for i, _ in kv_pairs),
        state_bytes_per_slot=sum(src.state[i].item_len for i, _ in st_pairs),
        layers=sorted(
            {src.kv[i].layer_id for i, _ in kv_pairs} | {src.state[i].layer_id for i, _ in st_pairs}
        ),
        aux_pairs=len(aux_pairs),
        aux_bytes_per_row=sum(src.aux[i].item_len for i in aux_pairs),
    )


def _coverage_problems(dst: StageLayout, writers: _Writers, complete: bool) -> list[Problem]:
    """Each destination entry written by two stages (KV and state), or, when `complete`, by
    none (aux too: only the last stage has aux entries, and a rank listed twice is already a
    `duplicate_stage`)."""
    # (writers of the kind, entry index, how the entry is named, where: the problem's fields)
    entries: list[tuple[dict[int, list[int]], int, str, Problem]] = [
        (
            writers.kv,
            j,
            f"layer {e.layer_id} group {e.group}",
            _at(layer_id=e.layer_id, group=e.group),
        )
        for j, e in enumerate(dst.kv)
    ]
    entries += [
        (
            writers.state,
            j,
            f"state of layer {s.layer_id} kind {s.kind!r}",
            _at(layer_id=s.layer_id, kind=s.kind),
        )
        for j, s in enumerate(dst.state)
    ]
    entries += [(writers.aux, j, f"aux entry {j}", _at(aux=j)) for j in range(len(dst.aux))]
    problems = []
    for table, j, what, where in entries:
        ranks = table.get(j, [])
        if len(ranks) > 1 and table is not writers.aux:
            problems.append(
                replace(where, code="duplicate_writer", message=f"stages {ranks} all write {what}")
            )
        elif not ranks and complete:
            problems.append(
                replace(
                    where, code="unfilled_destination", message=f"no prefill stage sends {what}"
                )
            )
    return problems


def _at(
    *,
    layer_id: int | None = None,
    group: int | None = None,
    kind: str | None = None,
    aux: int | None = None,
) -> Problem:
    """A problem's location, its code and message filled in by `replace`."""
    return Problem("", "", layer_id=layer_id, group=group, kind=kind, aux=aux)
