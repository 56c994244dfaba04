"""A landed handoff between two processes whose KV pages are CUDA memory known by pointer (the
SGLang backend on `--device cuda`), aux rows in host memory, over Mooncake TCP on 127.0.0.1.

Needs a GPU and Mooncake's CUDA build (`mooncake-transfer-engine`); skipped elsewhere, CI
included. The device check runs it (see the README's "Device memory").
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from pipelines.decode.views import HandoffRequest
from pipelines.states import HandoffState
from service.embedded import EmbeddedService
from tests.device.cuda_stage import (
    AUX_ITEMS,
    AUX_ROW,
    ITEM,
    PAGES,
    config,
    engine_stage,
    stage_memory,
)
from transport.mooncake import installed_builds

pytest.importorskip("mooncake.engine", reason="needs a Mooncake build")
pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.skipif(
        any("non-cuda" in b for b in installed_builds()),
        reason=f"needs Mooncake's CUDA build, not {sorted(installed_builds())}",
    ),
]
SECRET = "device-check-peer-secret-0123456789"


def test_gpu_pages_and_host_aux_rows_land_byte_exact(tmp_path: Path) -> None:
    root = Path(__file__).resolve().parents[2]
    prefill = subprocess.Popen(
        [sys.executable, "-m", "tests.device.cuda_stage", str(tmp_path / "prefill"), SECRET],
        cwd=root,
        # The packages a GPU machine's kit brings (tests/device/run.sh) are on PYTHONPATH too.
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
        kv, aux = stage_memory(40, seed=None)
        dst_pages, dst_aux = [9, 0, 38, 21], 2
        cfg = config("decode", str(tmp_path / "decode"), SECRET, 40, **{"peers.prefill": [url]})
        with EmbeddedService(cfg, buffers={0: engine_stage(kv, aux)}) as decode:
            decode.expect_handoff(HandoffRequest(id="gpu-1", dst_pages=dst_pages, dst_aux=dst_aux))
            view = decode.wait("gpu-1", 30.0)
            assert view.state == HandoffState.COMPLETED, view.error
            assert decode.released("gpu-1", 10.0)
            committed = [t.cpu().numpy().reshape(-1, ITEM) for t in kv]
            rows = [t.numpy().reshape(-1, n) for t, n in zip(aux, AUX_ITEMS)]
    finally:
        assert prefill.stdin is not None
        prefill.stdin.close()
        prefill.wait(30)
    sent_kv, sent_aux = stage_memory(64, seed=11)  # the prefill's memory, made again
    for src, dst in zip(sent_kv, committed):
        expected = src.cpu().numpy().reshape(-1, ITEM)
        assert np.array_equal(dst[dst_pages], expected[PAGES])
        assert not np.delete(dst, dst_pages, axis=0).any()  # no other page changed
    for src, dst, n in zip(sent_aux, rows, AUX_ITEMS):
        assert np.array_equal(dst[dst_aux], src.numpy().reshape(-1, n)[AUX_ROW])
        assert not np.delete(dst, dst_aux, axis=0).any()
