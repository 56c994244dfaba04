"""A Mooncake write of a few large blocks that waits by sleeping instead of spinning.

Called by `MooncakeTransport` (its worker thread runs the call this builds) in place of
`batch_transfer_sync_write` for TCP batches of at most `MAX_BLOCKS` blocks of at least
`MIN_BLOCK_BYTES` each: a landed stage's staged 1 MiB blocks.

Why. The engine's synchronous call busy-waits on the batch's status until it ends (no yield,
no sleep); on a host with fewer cores than busy threads that spin takes the core the engine's
own sender and the receiver need. `kvhandoff bench handoff --cases bulk` charges that spin
(thread kind `mooncake-call`, and the raw baseline's `main`) 27% of the landed prefills' CPU and
59% of the raw writers' (perf: `getTransferStatus` and its callees). Measured beside it, 4
writer processes into one receiver process, 1 MiB blocks in calls of 16 and of 256, loopback,
the shared 2-core host, interleaved 3 times: the sync call cost the writers 0.76-1.31 CPU s per
GB and moved 0.6-2.1 GB/s; each block as a one-entry async batch polled every `POLL_S`,
0.36-0.41 CPU s per GB and 1.8-3.1 GB/s (every byte checked on the receiver).

How, and the same outcome rules as the sync call (`mooncake.py`, rules 1 and 5):

- every block is submitted as a batch of one entry (`transfer_check_status` reads task 0 only,
  so a larger batch would read as done when its first block is);
- the call returns 0 only once every block's batch reported completed; a submission that failed
  or a batch that failed makes it return -1, but only after every batch already submitted has
  ended, so a failed call leaves no write of its own running that the sync call would not;
- it gives up (-1) after the engine's own allowance, `max(5, ceil(transfer_timeout_s))` s plus
  1 ns per byte from its start, as the sync call does (`MooncakeConfig.max_call_s` holds).

A batch id is checked only until it reports an end (the engine frees it then; checking a freed
id is undefined).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from kvhandoff.transport.blocks import Blocks
from kvhandoff.transport.config import ENGINE_MIN_TIMEOUT_S, MooncakeConfig

#: Between two rounds of status checks: a 1 MiB block takes ~0.4 ms on loopback here, so a
#: finished call waits at most this much more; a round of checks costs a few microseconds.
POLL_S = 200e-6
#: Calls this path takes: few blocks (one submission and one check each per round) ...
MAX_BLOCKS = 64
#: ... of a size where a block outlasts a poll interval (per-page blocks stay on the sync call).
MIN_BLOCK_BYTES = 256 << 10
#: What the engine returns for a submission that failed (0, or -1 as an unsigned 64-bit id).
_FAILED_IDS = (0, (1 << 64) - 1, -1)
# transfer_check_status: 0 running, 1 completed (freed), -1 failed (freed), -2 timed out.
_RUNNING, _COMPLETED = 0, 1


def polled_call(
    engine: Any, config: MooncakeConfig, peer: str, blocks: Blocks
) -> Callable[[], int] | None:
    """The engine call for `blocks`, ready to run (0 on success, -1 otherwise), or None where
    this path does not apply (another protocol, an engine without the async calls, many or
    small blocks)."""
    if config.protocol != "tcp" or not 0 < len(blocks) <= MAX_BLOCKS:
        return None
    if int(blocks.length.min()) < MIN_BLOCK_BYTES:
        return None
    submit = getattr(engine, "batch_transfer_async_write", None)
    check = getattr(engine, "transfer_check_status", None)
    if submit is None or check is None:
        return None
    engine_s = max(ENGINE_MIN_TIMEOUT_S, math.ceil(config.transfer_timeout_s))
    budget_ns = int(engine_s * 1e9) + blocks.total_bytes
    rows = np.stack([blocks.src_addr, blocks.dst_addr, blocks.length], axis=1).tolist()
    return lambda: write_polled(submit, check, peer, rows, budget_ns)


def write_polled(
    submit: Callable[[str, list[int], list[int], list[int]], int],
    check: Callable[[int], int],
    peer: str,
    rows: list[list[int]],
    budget_ns: int,
    poll_s: float = POLL_S,
) -> int:
    """Submit each (src, dst, length) row as a one-entry batch and wait, sleeping `poll_s`
    between rounds, until every submitted batch ended or `budget_ns` passed: 0 when every row
    completed, else -1."""
    start = time.monotonic_ns()
    rc = 0
    running: list[int] = []
    for src, dst, length in rows:
        batch = submit(peer, [src], [dst], [length])
        if batch in _FAILED_IDS:
            rc = -1
            break  # the batches already submitted are still waited for
        running.append(batch)
    while running:
        left = []
        for batch in running:
            status = check(batch)
            if status == _RUNNING:
                left.append(batch)
            elif status != _COMPLETED:
                rc = -1
        running = left
        if running:
            if time.monotonic_ns() - start > budget_ns:
                return -1  # as the sync call: the engine's allowance is spent
            time.sleep(poll_s)
    return rc
