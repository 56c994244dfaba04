"""A Mooncake write of a few large blocks that waits by sleeping instead of spinning.

Called by `MooncakeTransport` (its worker thread runs the call this builds) in place of
`batch_transfer_sync_write` for TCP batches of at most `MAX_BLOCKS` blocks of at least
`MIN_BLOCK_BYTES` on average: a landed stage's staged 1 MiB blocks (its segment's tail block
among them).

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
  1 ns per byte from its start, as the sync call does (`MooncakeConfig.max_call_s` holds for
  the call's return);
- no submitted batch is abandoned: a submission that raises (the binding's MemoryError, say)
  still waits for the batches already submitted, and the batches still running when the call
  gives up (or a status check raises) are handed to the caller's `orphaned` with their ids.
  Unlike the sync call, whose writes the engine keeps running unseen after it returns (on TCP a
  stopped receiver outlasts it: the body write has no deadline), those ids let the caller keep
  checking until the writes really ended (`MooncakeTransport` holds the peer stuck until then).

A batch id is checked only until it reports an end, completed or failed (the engine frees it
then; checking a freed id is undefined). "Timed out" (-2) does not free the id and the write
may still run: it counts as running.
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
#: ... of a size, on average, where a block outlasts a poll interval (per-page blocks stay on
#: the sync call).
MIN_BLOCK_BYTES = 256 << 10
#: What the engine returns for a submission that failed: 0 (current builds), or -1 as an
#: unsigned 64-bit id (older ones; pybind returns the id unsigned, so never a negative -1).
_FAILED_IDS = (0, (1 << 64) - 1)
# transfer_check_status: 0 running, 1 completed, -1 failed (both free the id), -2 timed out
# (id kept, write may still run).
_COMPLETED, _FAILED = 1, -1


def polled_call(
    engine: Any,
    config: MooncakeConfig,
    peer: str,
    blocks: Blocks,
    orphaned: Callable[[list[int]], None],
) -> Callable[[], int] | None:
    """The engine call for `blocks`, ready to run (0 on success, -1 otherwise; batches still
    running when it gives up go to `orphaned`), or None where this path does not apply (another
    protocol, an engine without the async calls, many or small blocks)."""
    if config.protocol != "tcp" or not 0 < len(blocks) <= MAX_BLOCKS:
        return None
    if blocks.total_bytes < MIN_BLOCK_BYTES * len(blocks):
        # Small blocks on average (per-page runs): each would end before a poll, so the sync
        # call's spin costs little. One small block among large ones (a staged segment's tail,
        # about a fifth of a landed stage's calls) keeps the call here: it rides on the others.
        return None
    submit = getattr(engine, "batch_transfer_async_write", None)
    check = getattr(engine, "transfer_check_status", None)
    if submit is None or check is None:
        return None
    engine_s = max(ENGINE_MIN_TIMEOUT_S, math.ceil(config.transfer_timeout_s))
    budget_ns = int(engine_s * 1e9) + blocks.total_bytes
    rows = np.stack([blocks.src_addr, blocks.dst_addr, blocks.length], axis=1).tolist()
    return lambda: write_polled(submit, check, peer, rows, budget_ns, orphaned)


def write_polled(
    submit: Callable[[str, list[int], list[int], list[int]], int],
    check: Callable[[int], int],
    peer: str,
    rows: list[list[int]],
    budget_ns: int,
    orphaned: Callable[[list[int]], None],
    poll_s: float = POLL_S,
) -> int:
    """Submit each (src, dst, length) row as a one-entry batch and wait, sleeping `poll_s`
    between rounds, until every submitted batch ended or `budget_ns` passed: 0 when every row
    completed, else -1. Ids still running when it returns or raises go to `orphaned`."""
    deadline_ns = time.monotonic_ns() + budget_ns
    running: set[int] = set()
    try:
        try:
            rc = _submit(submit, peer, rows, running)
        finally:  # also when a submission raised: what was submitted is waited for
            waited = _wait(check, running, deadline_ns, poll_s)
        return min(rc, waited)
    finally:
        if running:
            orphaned(sorted(running))


def _submit(
    submit: Callable[[str, list[int], list[int], list[int]], int],
    peer: str,
    rows: list[list[int]],
    running: set[int],
) -> int:
    """Submit rows in order, adding each id to `running`; -1 at the first failed submission
    (the rest never go), else 0."""
    for src, dst, length in rows:
        batch = submit(peer, [src], [dst], [length])
        if batch in _FAILED_IDS:
            return -1
        running.add(batch)
    return 0


def _wait(check: Callable[[int], int], running: set[int], deadline_ns: int, poll_s: float) -> int:
    """Check `running` until empty or past `deadline_ns` (those left still run): 0 if every id
    completed, else -1."""
    rc = 0
    while running:
        if check_ended(check, running):
            rc = -1
        if running:
            if time.monotonic_ns() > deadline_ns:
                return -1  # as the sync call: the engine's allowance is spent
            time.sleep(poll_s)
    return rc


def check_ended(check: Callable[[int], int], running: set[int]) -> bool:
    """Check each id of `running` once and drop those that ended (freed by the engine), each
    right after its check, so an id is never checked after it ended even if a later check
    raises; whether one of them failed."""
    failed = False
    for batch in sorted(running):
        status = check(batch)
        if status in (_COMPLETED, _FAILED):
            running.discard(batch)
            failed = failed or status != _COMPLETED
    return failed
