"""A stage over CUDA memory as SGLang hands it to kvhandoff: raw pointers of KV buffers on the GPU
and of aux rows in host memory, wrapped by `transport.pointers.tensor_at`.

Run as `python -m tests.device.cuda_stage <state_dir> <secret>`: a prefill process holding one
such stage (seeded KV pages and aux rows), which prints its URL, signals handoff "gpu-1" ready
with pages PAGES and aux row AUX_ROW, and serves until its stdin closes.
"""

from __future__ import annotations

import sys
from typing import Any

import torch

from pipelines.layout import layout_from_flat_lists
from service.config import Config, load_config
from service.embedded import EmbeddedService
from service.runtime.stages import EngineStage
from transport.pointers import tensor_at

ITEM = 64 << 10  # bytes of one page of one KV buffer: segments large enough to commit off the loop
LAYERS = [0, 1, 2]
AUX_ITEMS = [64, 8]  # SGLang's aux rows: e.g. output ids, then bootstrap_room
AUX_ROWS = 16
PAGES = [3, 17, 4, 30]
AUX_ROW = 5


def stage_memory(num_pages: int, seed: int | None) -> tuple[list[Any], list[Any]]:
    """(KV tensors on cuda:0, K then V of every layer; aux tensors on the host), owned here as
    SGLang owns its pools."""
    gen = torch.Generator().manual_seed(seed) if seed is not None else None

    def filled(n: int) -> Any:
        if gen is None:
            return torch.zeros(n, dtype=torch.uint8)
        return torch.randint(1, 255, (n,), dtype=torch.uint8, generator=gen)

    kv = [filled(num_pages * ITEM).to("cuda:0") for _ in range(2 * len(LAYERS))]
    aux = [filled(AUX_ROWS * n) for n in AUX_ITEMS]
    return kv, aux


def engine_stage(kv: list[Any], aux: list[Any]) -> EngineStage:
    """The stage as the SGLang backend builds it: a layout from pointer lists, then each buffer
    wrapped from its address on its own device."""
    layout = layout_from_flat_lists(
        pp_rank=0,
        pp_size=1,
        page_size=16,
        dtype="bfloat16",
        kv_data_ptrs=[t.data_ptr() for t in kv],
        kv_data_lens=[t.numel() for t in kv],
        kv_item_lens=[ITEM] * len(kv),
        kv_layer_ids=LAYERS * 2,
        aux_data_ptrs=[t.data_ptr() for t in aux],
        aux_data_lens=[t.numel() for t in aux],
        aux_item_lens=AUX_ITEMS,
    )
    buffers = [tensor_at(t.data_ptr(), t.numel(), "cuda:0") for t in kv]
    buffers += [tensor_at(t.data_ptr(), t.numel(), "cpu") for t in aux]
    return EngineStage(layout, buffers)


def config(role: str, state_dir: str, secret: str, num_pages: int, **more: Any) -> Config:
    overrides = {
        "role": role,
        "stages": [{"num_pages": num_pages}],
        "server.port": 0,
        "server.state_dir": state_dir,
        "auth.peer": secret,
        "transport.backend": "mooncake",
        "transfer.landing_bytes": 4 << 20,
        "transfer.staging_bytes": 4 << 20,
        "transfer.window_bytes": 1 << 20,
        **more,
    }
    return load_config(None, {}, overrides)


def main(state_dir: str, secret: str) -> None:
    kv, aux = stage_memory(64, seed=11)
    with EmbeddedService(
        config("prefill", state_dir, secret, 64), buffers={0: engine_stage(kv, aux)}
    ) as prefill:
        print(f"url {prefill.url}", flush=True)
        prefill.stage_ready("gpu-1", 0, PAGES, src_aux=AUX_ROW)
        sys.stdin.read()  # until the test is done


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
