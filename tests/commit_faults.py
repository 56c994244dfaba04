"""Test-only faults in a decode server's landed commits, shared by the engine suites' hooks
(`tests/engines/faults`, `tests/vllm/faults`: each a `sitecustomize` on one decode server's
PYTHONPATH, never installed and never a product flag).

`install` wraps kvhandoff's decode commit (`kvhandoff.pipelines.decode.landing.Landing`) for the
handoffs its predicates pick: every segment committed to a *corrupted* handoff has the sign bit of
every value of each of its KV pages flipped (in every layer's K and V) after the commit verified its
digest, so its tokens must differ from the single engine's (the negative control). The whole
prompt's KV, not one page: SGLang's CPU pages hold one token each, and one token's KV flipped
did not always change a greedy answer (one full run of tests/engines saw all three of its
corrupted prompts answer the single server's tokens);
a *slow* handoff's landed segments are each held `slow_s` before their commit (an await: the
service's loop runs on), so the failure cases can act while its transfer is under way. Other
handoffs are untouched.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import numpy as np

from kvhandoff.pipelines.decode import landing
from kvhandoff.pipelines.packing import destination_side, piece_bytes, piece_views


def install(
    *,
    corrupt: Callable[[str], bool],
    slow: Callable[[str], bool],
    slow_s: float,
    value_bytes: int,
) -> None:
    """Wrap the decode's commits: `corrupt(handoff_id)` and `slow(handoff_id)` pick the
    handoffs; `value_bytes` is the KV dtype's size (little-endian: a value's last byte holds its
    sign bit)."""
    commit = landing.Landing._scatter_check_commit
    commit_segment = landing.Landing.commit

    async def held_commit(self: Any, h: Any, rank: int, msg: Any) -> Any:
        if slow(h.id):
            await asyncio.sleep(slow_s)
        return await commit_segment(self, h, rank, msg)

    def corrupting_commit(self: Any, pairing: Any, pieces: Any, h: Any, *args: Any) -> bool:
        ok: bool = commit(self, pairing, pieces, h, *args)
        if not ok or not corrupt(h.id):
            return ok
        side = destination_side(pairing, self._memory, h.dst_pages, h.request.slots)
        nbytes = int(piece_bytes(pairing, pieces).sum())
        placeholder = np.zeros(nbytes, dtype=np.uint8)  # the views slice it; never read
        rows = pieces.rows.tolist()
        for row, (pages, idx, _) in zip(rows, piece_views(pairing, side, pieces, placeholder)):
            if row < pairing.num_kv_pairs:
                pages[idx, value_bytes - 1 :: value_bytes] ^= 0x80
        return ok

    landing.Landing._scatter_check_commit = corrupting_commit  # type: ignore[method-assign]
    landing.Landing.commit = held_commit  # type: ignore[method-assign]
