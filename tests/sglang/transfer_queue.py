"""SGLang's own decode transfer queue around a decode rank's kvhandoff receivers, in the decode
process of `engine_proc.py`: what the release-boundary tests (`test_release.py`) drive.

SGLang's `DecodeTransferQueue.pop_transferred` decides what happens to a request that reports
Failed (free its pages now, or hold them for its deferred release), and
`resolve_deferred_releases` when a held request's pages go back, asking the manager's
`is_abort_release_safe`; both run here as SGLang's scheduler runs them (`process_decode_queue`:
resolve, then pop, every pass). The pages come from SGLang's own `PagedTokenToKVPoolAllocator`.
One step is replaced: `_release_request` hands the request's pages straight back to that
allocator instead of through SGLang's `release_kv_cache`, which needs a real request, radix
tree and token pool; when it runs is SGLang's decision, which is what the tests judge.
"""

from __future__ import annotations

import logging
import os
import signal
import time
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch

#: The marker the next request's KV holds in the pages it was given (the test's "forward").
MARK = 0x5A


def _one_rank_group() -> Any:
    """SGLang's attention-TP gloo group of a one-rank decode (its all-reduces pass through)."""
    import torch.distributed as dist
    from sglang.srt.runtime_context import get_parallel

    if not dist.is_initialized():
        store = dist.HashStore()
        dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    group = dist.group.WORLD
    get_parallel().override_permanently(attn_tp_group=SimpleNamespace(cpu_group=group))
    return group


class Boundary:
    """One decode rank's transfer queue, its page allocator, and when each handoff of the rank
    was released (`handoff.released`, by id, on the monotonic clock)."""

    def __init__(self, manager: Any, pages: int, page_size: int) -> None:
        from sglang.srt.disaggregation.decode import DecodeTransferQueue
        from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator

        from kvhandoff.pipelines.events import HandoffReleased

        _one_rank_group()
        self.page_size = page_size
        # Pages 1 .. pages - 1 (SGLang keeps page 0 for padding).
        self.allocator = PagedTokenToKVPoolAllocator(
            (pages - 1) * page_size, page_size, torch.int64, "cpu", None, False
        )
        self.freed_at: dict[int, float] = {}  # room -> when SGLang gave its pages back
        self.released_at: dict[str, float] = {}
        allocator, freed_at = self.allocator, self.freed_at

        class Queue(DecodeTransferQueue):  # type: ignore[misc]
            def _release_request(self, decode_req: Any) -> None:
                allocator.free(decode_req.kv_indices)
                freed_at[decode_req.req.bootstrap_room] = time.monotonic()

        scheduler = SimpleNamespace(
            enable_decode_hicache=False,
            enable_hisparse=False,
            spec_algorithm=None,
            output_streamer=SimpleNamespace(stream_output=lambda *a, **k: None),
            metrics_reporter=SimpleNamespace(enable_metrics=False),
        )
        metadata = SimpleNamespace(clear_slot=lambda idx: None)
        indices = SimpleNamespace(free=lambda idx: None)
        tree = SimpleNamespace(unlock=lambda lock: None)  # a request that locked no prefix
        self.queue = Queue(indices, metadata, scheduler, tree)

        def on_event(event: Any) -> None:
            if isinstance(event, HandoffReleased):
                self.released_at[event.handoff_id] = time.monotonic()

        manager.service.add_listener(on_event)

    def pages_of(self, indices: torch.Tensor) -> list[int]:
        return [int(i) // self.page_size for i in indices[:: self.page_size].tolist()]

    def run(
        self, receiver: Any, cmd: dict[str, Any], kv: list[torch.Tensor], item: int
    ) -> dict[str, Any]:
        """Request A (`receiver`, its metadata sent into pages allocated here) fails as `cmd`
        says while its prefill's bytes are on their way; the rest of the pool is taken, so
        the next request's pages are A's, once SGLang gives them back. The next request's KV
        is written into them at once, and read again once kvhandoff released A (and a while
        after): intact only if no write of A landed after SGLang reused its pages.

        `cmd["pause"]` (`{"pids": [...], "s": ...}`) stops those (prefill) processes from A's
        failure for that long: kvhandoff cannot confirm A stopped, nor release it, until they
        run again, while SGLang sees A Failed at once. Without it a quick abort ack may release
        A before SGLang's first pass, and a queue that freed the pages at Failed would pass."""
        from sglang.srt.disaggregation.base.conn import KVPoll
        from sglang.srt.disaggregation.decode import DecodeRequest

        room, n = int(cmd["room"]), len(cmd["pages"])
        a = self.allocator.alloc(n * self.page_size)
        filler = self.allocator.alloc(self.allocator.available_size())  # other requests
        pages = self.pages_of(a)
        receiver.send_metadata(np.array(pages, dtype=np.int32), cmd["aux"], cmd["state"])
        req = SimpleNamespace(
            rid=f"req-{room}",
            bootstrap_room=room,
            bootstrap_host="127.0.0.1",
            return_logprob=False,
            finished_reason=None,
        )
        entry = DecodeRequest(req=req, kv_receiver=receiver, metadata_buffer_index=cmd["aux"])
        entry.kv_indices = a
        self.queue.queue.append(entry)
        end = time.monotonic() + 10.0
        if cmd["fail"] == "transferring":  # the handoff exists: its bytes are on their way
            while receiver.poll() != KVPoll.Transferring and time.monotonic() < end:
                time.sleep(0.001)
        pause = cmd.get("pause") or {}
        pids = [int(pid) for pid in pause.get("pids", ())]
        for pid in pids:
            os.kill(pid, signal.SIGSTOP)
        failed_at = time.monotonic()
        resume_at = failed_at + float(pause.get("s", 0.0))
        receiver.abort()  # the scheduler's abort of a transfer-queue request (AbortReq)
        hid = receiver._hid
        b: torch.Tensor | None = None
        reused_at = 0.0
        seen_failed_at: float | None = None  # SGLang's first pass that saw A Failed
        settle_s = float(cmd.get("settle_s", 1.0))
        try:
            while time.monotonic() < end:
                if pids and time.monotonic() >= resume_at:
                    for pid in pids:
                        os.kill(pid, signal.SIGCONT)
                    pids = []
                if seen_failed_at is None and receiver.poll() == KVPoll.Failed:
                    seen_failed_at = time.monotonic()
                self.queue.resolve_deferred_releases()  # process_decode_queue's order
                self.queue.pop_transferred()
                if b is None:
                    b = self.allocator.alloc(n * self.page_size)
                    reused_at = time.monotonic()
                    if b is not None:  # the next request's KV, in the pages it was given
                        for p in self.pages_of(b):
                            for t in kv:
                                t[p * item : (p + 1) * item] = MARK
                # Read again a while after the later of the reuse and kvhandoff's release (not
                # before it: until then a write of the failed handoff may still land, and one
                # that lands in the next request's pages is what `intact` catches).
                released = self.released_at.get(hid)
                if (
                    b is not None
                    and released is not None
                    and time.monotonic() > max(released, reused_at) + settle_s
                ):
                    break
                time.sleep(0.005)
        finally:
            for pid in pids:  # never leave a prefill stopped
                os.kill(pid, signal.SIGCONT)
        reused = self.pages_of(b) if b is not None else []
        intact = all(bool((t[p * item : (p + 1) * item] == MARK).all()) for p in reused for t in kv)
        self.allocator.free(filler)
        if b is not None:
            self.allocator.free(b)
        result = {
            "room": room,
            "pages": pages,
            "reused": reused,
            "intact": intact,
            "failed_seen_s": _since(seen_failed_at, failed_at),
            "freed_s": _since(self.freed_at.get(room), failed_at),
            "released_s": _since(self.released_at.get(hid), failed_at),
            "held": self.queue.num_pending_deferred_releases(),
        }
        logging.getLogger("engine_proc").warning("boundary %s: %s", cmd["fail"], result)
        return result


def _since(t: float | None, start: float) -> float | None:
    return None if t is None else t - start
