"""SGLang's per-request planning on a prefill, timed in SGLang's own environment.

Run by `bench.planning` (`make bench`'s planning section) with the SGLang environment's interpreter
(`make sglang-env`), never imported by the service: it needs only numpy and the installed `sglang`.
It reads one JSON request on stdin — the entries of a stage (address, item length and layer id on
both sides) and a request's prefill and decode page indices — or `{"requests": [...]}`, several of
them (one interpreter start for a whole grid), and prints one JSON line (a list for a list): the
median wall time of what SGLang's Mooncake backend does per request before its engine call
(`MooncakeKVManager._send_kvcache_generic` with layer ids, the default path):

1. `group_concurrent_contiguous(src, dst)`: runs of pages contiguous on both sides;
2. `build_transfer_entry_pairs(...)` and the `is_elided_entry` filter: entries paired by layer;
3. the block loop (its nested `set_transfer_blocks` / `process_layers`): one (src, dst, length)
   tuple per run and entry;
4. `_transfer_data`'s `zip(*blocks)` into the three lists the engine call takes.

Steps 1, 2 and the elision check are SGLang's installed functions. Steps 3 and 4 are nested in a
method that needs a live engine, so they are restated here line for line (`_blocks`). The
garbage collector stays on, as in a serving process.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from typing import Any


def _blocks(
    layers_params: list[tuple[int, int, int]], src_blocks: list[Any], dst_blocks: list[Any]
) -> list[tuple[int, int, int]]:
    # `process_layers` over `set_transfer_blocks`, for host destinations (no device split).
    transfer_blocks: list[tuple[int, int, int]] = []
    for src_ptr, dst_ptr, item_len in layers_params:
        blocks = []
        for prefill_index, decode_index in zip(src_blocks, dst_blocks):
            src_addr = src_ptr + int(prefill_index[0]) * item_len
            dst_addr = dst_ptr + int(decode_index[0]) * item_len
            length = item_len * len(prefill_index)
            blocks.append((src_addr, dst_addr, length))
        transfer_blocks.extend(blocks)
    return transfer_blocks


def _measure(req: dict[str, Any]) -> dict[str, Any]:
    import numpy as np
    import sglang
    from sglang.srt.disaggregation.common.utils import group_concurrent_contiguous
    from sglang.srt.disaggregation.utils import build_transfer_entry_pairs, is_elided_entry

    src_pages = np.asarray(req["src_pages"], dtype=np.int32)
    dst_pages = np.asarray(req["dst_pages"], dtype=np.int32)
    src_ptrs, dst_ptrs = req["src_ptrs"], req["dst_ptrs"]
    item_lens, dst_item_lens = req["item_lens"], req["dst_item_lens"]
    src_ids, dst_ids = req["src_layer_ids"], req["dst_layer_ids"]

    def one() -> int:
        src_blocks, dst_blocks = group_concurrent_contiguous(src_pages, dst_pages)
        pairs = build_transfer_entry_pairs(
            src_ids, dst_ids, len(src_ptrs), len(dst_ptrs), allow_positional_fallback=False
        )
        layers_params = [
            (src_ptrs[i], dst_ptrs[j], item_lens[i])
            for i, j in pairs
            if not is_elided_entry(item_lens[i], dst_item_lens, j, allow_dst_elision=False)
        ]
        transfer_blocks = _blocks(layers_params, src_blocks, dst_blocks)
        src_addrs, dst_addrs, lengths = zip(*transfer_blocks)
        list(src_addrs), list(dst_addrs), list(lengths)
        return len(transfer_blocks)

    blocks = one()  # warm-up
    times = []
    for _ in range(int(req.get("repeat", 15))):
        t0 = time.perf_counter()
        one()
        times.append(time.perf_counter() - t0)
    return {"ms": statistics.median(times) * 1e3, "blocks": blocks, "sglang": sglang.__version__}


def main() -> int:
    req = json.load(sys.stdin)
    if "requests" in req:
        print(json.dumps([_measure(r) for r in req["requests"]]))
    else:
        print(json.dumps(_measure(req)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
