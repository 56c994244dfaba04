"""Placing unplaced layouts at synthetic addresses, for tests that never touch memory."""

from __future__ import annotations

from kvhandoff.pipelines.layout import StageLayout


def place(layout: StageLayout, base: int, stride: int = 0x100000) -> StageLayout:
    """Entry k (KV first, then state, then aux) at `base + k * stride`; stride must exceed
    every entry."""
    sizes = layout.region_sizes
    assert all(s <= stride for s in sizes), "stride too small for an entry"
    return layout.place([base + k * stride for k in range(len(sizes))])


def place_packed(layout: StageLayout, base: int) -> StageLayout:
    """Entries back to back from `base`, as a pool would allocate them."""
    bases, at = [], base
    for size in layout.region_sizes:
        bases.append(at)
        at += size
    return layout.place(bases)
