"""The vLLM engine tests' negative control: a test-only fault in the decode's commits.

On the decode server's PYTHONPATH only (`tests/vllm/test_kvhandoff_pair.py`), never installed
and never a product flag: Python imports `sitecustomize` at start-up in every process of the
server, and this one wraps kvhandoff's decode commit (`pipelines.decode.landing.Landing`) so
that, for a handoff whose id holds `CORRUPT_MARK` (the proxy's request id names it), the first
segment committed flips the sign bit of every value of one of its KV pages (the same page in
every layer) after the commit verified its digest. Such a request's tokens must then differ
from the single engine's: the test that shows it proves the comparison can fail. Other
handoffs are untouched.
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np

from pipelines.decode import landing
from pipelines.packing import destination_side, piece_views

CORRUPT_MARK = "corrupt-kv"
_done: set[str] = set()
_lock = threading.Lock()
_commit = landing.Landing._copy_check_commit


def _corrupting_commit(self: Any, pairing: Any, pieces: Any, h: Any, *args: Any) -> bool:
    ok: bool = _commit(self, pairing, pieces, h, *args)
    if not ok or CORRUPT_MARK not in h.id:
        return ok
    with _lock:
        if h.id in _done:
            return ok
        _done.add(h.id)
    side = destination_side(pairing, self._memory, h.dst_pages, h.request.slots)
    placeholder = np.zeros(int(args[1]), dtype=np.uint8)  # the views slice it; never read
    rows = pieces.rows.tolist()
    for row, (pages, idx, _) in zip(rows, piece_views(pairing, side, pieces, placeholder)):
        if row < pairing.num_kv_pairs:
            # bfloat16 values are little-endian: every second byte holds the sign bit.
            pages[int(idx[0]), 1::2] ^= 0x80
    return ok


landing.Landing._copy_check_commit = _corrupting_commit  # type: ignore[method-assign]
