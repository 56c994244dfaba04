"""A deliberately plain planner: a Python loop over entries and runs building per-block tuples.

It exists as the oracle for property tests and as the baseline of `python -m bench.plan`; the
service never calls it. It assumes the request was validated by `planning.validate_request`.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvhandoff.pipelines.pairing import Pairing
from kvhandoff.pipelines.slots import SlotsLike, as_slots


def reference_runs(src: Sequence[int], dst: Sequence[int]) -> list[tuple[int, int, int]]:
    runs: list[tuple[int, int, int]] = []
    for s, d in zip(src, dst):
        if runs:
            s0, d0, n = runs[-1]
            if s == s0 + n and d == d0 + n:
                runs[-1] = (s0, d0, n + 1)
                continue
        runs.append((s, d, 1))
    return runs


def reference_plan(
    pairing: Pairing,
    src_pages: Sequence[int],
    dst_pages: Sequence[int],
    src_slot: SlotsLike = None,
    dst_slot: SlotsLike = None,
) -> list[tuple[int, int, int]]:
    """(src_addr, dst_addr, length) per block, pair-major, then one block per state pair (at
    its component's slot), then one per aux pair (at the aux row)."""
    src, dst = pairing.src, pairing.dst
    src_at, dst_at = as_slots(src_slot), as_slots(dst_slot)
    blocks: list[tuple[int, int, int]] = []
    runs = reference_runs([int(p) for p in src_pages], [int(p) for p in dst_pages])
    for i, j in zip(pairing.kv_src_index.tolist(), pairing.kv_dst_index.tolist()):
        a, b = src.kv[i], dst.kv[j]
        for s0, d0, n in runs:
            blocks.append((a.base + s0 * a.item_len, b.base + d0 * b.item_len, n * a.item_len))
    for i, j in zip(pairing.state_src_index.tolist(), pairing.state_dst_index.tolist()):
        sa, sb = src.state[i], dst.state[j]
        s, d = src_at.of(sa.component), dst_at.of(sb.component)
        assert s is not None and d is not None
        blocks.append((sa.base + s * sa.item_len, sb.base + d * sb.item_len, sa.item_len))
    for i in pairing.aux_src_index.tolist():
        xa, xb = src.aux[i], dst.aux[i]
        assert src_at.aux is not None and dst_at.aux is not None
        blocks.append(
            (xa.base + src_at.aux * xa.item_len, xb.base + dst_at.aux * xb.item_len, xa.item_len)
        )
    return blocks
