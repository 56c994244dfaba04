"""A stage over device memory as SGLang hands it to kvhandoff: raw pointers of KV buffers on the
device (a GPU, `cuda:0`, or an NPU, `npu:N`) and of aux rows in host memory, wrapped by
`kvhandoff.transport.pointers.tensor_at`.

Run as `python -m tests.device.stage <state_dir> <secret> <device> [<key>=<value> ...]`: a
prefill process holding one such stage (seeded KV pages and aux rows) on `device`, with the
config overrides given, which prints its URL, signals handoff HANDOFF ready with pages PAGES and
aux row AUX_ROW, and serves until its stdin closes.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kvhandoff.pipelines.decode.views import HandoffRequest
from kvhandoff.pipelines.layout import layout_from_flat_lists
from kvhandoff.pipelines.states import HandoffState
from kvhandoff.service.config import Config, load_config
from kvhandoff.service.embedded import EmbeddedService
from kvhandoff.service.runtime.stages import EngineStage
from kvhandoff.transport.pointers import tensor_at

ITEM = 64 << 10  # bytes of one page of one KV buffer: segments large enough to commit off the loop
LAYERS = [0, 1, 2]
AUX_ITEMS = [64, 8]  # SGLang's aux rows: e.g. output ids, then bootstrap_room
AUX_ROWS = 16
PAGES = [3, 17, 4, 30]
AUX_ROW = 5
HANDOFF = "device-1"


def stage_memory(num_pages: int, seed: int | None, device: str) -> tuple[list[Any], list[Any]]:
    """(KV tensors on `device`, K then V of every layer; aux tensors on the host), owned here
    as SGLang owns its pools."""
    gen = torch.Generator().manual_seed(seed) if seed is not None else None

    def filled(n: int) -> Any:
        if gen is None:
            return torch.zeros(n, dtype=torch.uint8)
        return torch.randint(1, 255, (n,), dtype=torch.uint8, generator=gen)

    kv = [filled(num_pages * ITEM).to(device) for _ in range(2 * len(LAYERS))]
    aux = [filled(AUX_ROWS * n) for n in AUX_ITEMS]
    return kv, aux


def engine_stage(kv: list[Any], aux: list[Any], device: str) -> EngineStage:
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
    buffers = [tensor_at(t.data_ptr(), t.numel(), device) for t in kv]
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


def use_device(device: str) -> None:
    """Make `device` this process's own before an engine starts: the Ascend transports take the
    current NPU (and torch_npu must be imported before an `npu` device is named)."""
    if device.startswith("npu"):
        import torch_npu  # noqa: F401

        torch.npu.set_device(device)


def check_landed_handoff(
    tmp_path: Path,
    secret: str,
    prefill_device: str,
    decode_device: str,
    *,
    prefill_settings: dict[str, str] | None = None,
    decode_settings: dict[str, str] | None = None,
) -> None:
    """One landed handoff from a prefill process (this module, on `prefill_device`) into a
    decode here (on `decode_device`), each with its config `*_settings`; asserts that exactly
    the sent pages and aux row changed, byte for byte."""
    root = Path(__file__).resolve().parents[2]
    settings = [f"{k}={v}" for k, v in (prefill_settings or {}).items()]
    prefill = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tests.device.stage",
            str(tmp_path / "prefill"),
            secret,
            prefill_device,
            *settings,
        ],
        cwd=root,
        # The packages a device machine's kit brings (run.sh, npu_run.sh) are on PYTHONPATH too.
        env={
            **os.environ,
            "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")]),
        },
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert prefill.stdout is not None
        line = prefill.stdout.readline()
        assert line.startswith("url "), line
        url = line.split()[1]
        use_device(decode_device)
        kv, aux = stage_memory(40, seed=None, device=decode_device)
        dst_pages, dst_aux = [9, 0, 38, 21], 2
        more = {"peers.prefill": [url], **(decode_settings or {})}
        cfg = config("decode", str(tmp_path / "decode"), secret, 40, **more)
        with EmbeddedService(cfg, buffers={0: engine_stage(kv, aux, decode_device)}) as decode:
            decode.expect_handoff(HandoffRequest(id=HANDOFF, dst_pages=dst_pages, dst_aux=dst_aux))
            view = decode.wait(HANDOFF, 30.0)
            assert view.state == HandoffState.COMPLETED, view.error
            assert decode.released(HANDOFF, 10.0)
            committed = [t.cpu().numpy().reshape(-1, ITEM) for t in kv]
            rows = [t.numpy().reshape(-1, n) for t, n in zip(aux, AUX_ITEMS)]
    finally:
        assert prefill.stdin is not None
        prefill.stdin.close()
        prefill.wait(30)
    sent_kv, sent_aux = stage_memory(64, seed=11, device="cpu")  # the prefill's, made again
    for src, dst in zip(sent_kv, committed):
        expected = src.numpy().reshape(-1, ITEM)
        assert np.array_equal(dst[dst_pages], expected[PAGES])
        assert not np.delete(dst, dst_pages, axis=0).any()  # no other page changed
    for src, dst, n in zip(sent_aux, rows, AUX_ITEMS):
        assert np.array_equal(dst[dst_aux], src.numpy().reshape(-1, n)[AUX_ROW])
        assert not np.delete(dst, dst_aux, axis=0).any()


def main(state_dir: str, secret: str, device: str, *settings: str) -> None:
    use_device(device)
    more = dict(s.split("=", 1) for s in settings)
    kv, aux = stage_memory(64, seed=11, device=device)
    with EmbeddedService(
        config("prefill", state_dir, secret, 64, **more),
        buffers={0: engine_stage(kv, aux, device)},
    ) as prefill:
        print(f"url {prefill.url}", flush=True)
        prefill.stage_ready(HANDOFF, 0, PAGES, src_aux=AUX_ROW)
        sys.stdin.read()  # until the test is done


if __name__ == "__main__":
    main(*sys.argv[1:])
