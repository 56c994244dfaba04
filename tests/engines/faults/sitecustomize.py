"""The SGLang engine tests' decode faults (`tests/commit_faults.py`): for a request whose
bootstrap room is in `CORRUPT_ROOMS`, the KV of every committed segment is corrupted after its
commit verified it (the negative control); for a room in `SLOW_ROOMS`, every landed segment is
held `SLOW_COMMIT_S` before its commit (the failure cases). On the decode servers' PYTHONPATH
only (`tests/engines/conftest.py`): Python imports `sitecustomize` at start-up in every process
of the server. Other rooms are untouched.
"""

from __future__ import annotations

import re

from tests.commit_faults import install
from tests.engines.client import CORRUPT_ROOMS, SLOW_COMMIT_S, SLOW_ROOMS

_ROOM = re.compile(r"^sglang-(\d+)-")


def _room(handoff_id: str) -> int:
    match = _ROOM.match(handoff_id)
    return -1 if match is None else int(match.group(1))


# The test model's KV is float32.
install(
    corrupt=lambda hid: _room(hid) in CORRUPT_ROOMS,
    slow=lambda hid: _room(hid) in SLOW_ROOMS,
    slow_s=SLOW_COMMIT_S,
    value_bytes=4,
)
