"""The vLLM engine tests' decode faults: a corrupted page (the negative control), held commits
(the failure cases), and the worker's service URL in the server's log.

On the decode server's PYTHONPATH only (`tests/vllm/test_kvhandoff_pair.py`), never installed
and never a product flag: Python imports `sitecustomize` at start-up in every process of the
server, and this one wraps kvhandoff's decode commit (`pipelines.decode.landing.Landing`) so
that, for a handoff whose id holds `CORRUPT_MARK` (the proxy's request id names it), the first
segment committed flips the sign bit of every value of one of its KV pages (the same page in
every layer) after the commit verified its digest. Such a request's tokens must then differ
from the single engine's: the test that shows it proves the comparison can fail. For a
handoff whose id holds `SLOW_MARK` it holds every landed segment `SLOW_COMMIT_S` before
committing it (an await: the service's loop runs on), so the failure cases can act while
that request's transfer is under way. Other handoffs are untouched. It also sends the
connector's INFO log (each worker's service URL) to the server's output, where the tests
read the decode's kvhandoff API address.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from typing import Any

import numpy as np

from pipelines.decode import landing
from pipelines.packing import destination_side, piece_views

CORRUPT_MARK = "corrupt-kv"
SLOW_MARK = "slow-kv"
#: Below the prefill's peer request timeout (5 s), which the held segment notice must not reach.
SLOW_COMMIT_S = 3.0
_done: set[str] = set()
_lock = threading.Lock()
_commit = landing.Landing._copy_check_commit
_commit_segment = landing.Landing.commit


async def _held_commit(self: Any, h: Any, rank: int, msg: Any) -> Any:
    if SLOW_MARK in h.id:
        await asyncio.sleep(SLOW_COMMIT_S)
    return await _commit_segment(self, h, rank, msg)


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
landing.Landing.commit = _held_commit  # type: ignore[method-assign]
_log = logging.getLogger("kvhandoff.vllm")
_log.setLevel(logging.INFO)
_log.addHandler(logging.StreamHandler())
