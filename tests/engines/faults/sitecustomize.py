"""The engine tests' negative control: a test-only fault in the decode server's commits.

On the decode servers' PYTHONPATH only (`tests/engines/conftest.py`), never installed and never
a product flag: Python imports `sitecustomize` at start-up in every process of the server, and
this one wraps kvhandoff's decode commit (`pipelines.decode.landing.Landing`) so that, for a
request whose bootstrap room is in `CORRUPT_ROOMS`, the first segment committed flips the sign
bit of every value of one of its KV pages (the same page in every layer's K and V buffer) after
the commit verified its digest. Such a request's tokens must then differ from the single
server's: the test that shows it proves the comparison can fail. For a room in `SLOW_ROOMS`
it holds every landed segment `SLOW_COMMIT_S` before committing it (an await: the service's
loop runs on), so the failure tests can act while that request's transfer is under way. Other
rooms are untouched.
"""

from __future__ import annotations

import asyncio
import re
import threading
from typing import Any

import numpy as np

from pipelines.decode import landing
from pipelines.packing import destination_side, piece_views
from tests.engines.client import CORRUPT_ROOMS, SLOW_COMMIT_S, SLOW_ROOMS

_ROOM = re.compile(r"^sglang-(\d+)-")
_done: set[str] = set()
_lock = threading.Lock()
_commit = landing.Landing._copy_check_commit
_commit_segment = landing.Landing.commit


def _room(handoff_id: str) -> int:
    match = _ROOM.match(handoff_id)
    return -1 if match is None else int(match.group(1))


async def _held_commit(self: Any, h: Any, rank: int, msg: Any) -> Any:
    if _room(h.id) in SLOW_ROOMS:
        await asyncio.sleep(SLOW_COMMIT_S)
    return await _commit_segment(self, h, rank, msg)


def _corrupting_commit(self: Any, pairing: Any, pieces: Any, h: Any, *args: Any) -> bool:
    ok: bool = _commit(self, pairing, pieces, h, *args)
    if not ok or _room(h.id) not in CORRUPT_ROOMS:
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
            # float32 values are little-endian: every fourth byte holds the sign bit.
            pages[int(idx[0]), 3::4] ^= 0x80
    return ok


landing.Landing._copy_check_commit = _corrupting_commit  # type: ignore[method-assign]
landing.Landing.commit = _held_commit  # type: ignore[method-assign]
