"""A landed handoff between two processes whose KV pages are CUDA memory known by pointer (the
SGLang backend on `--device cuda`), aux rows in host memory, over Mooncake TCP on 127.0.0.1.

Needs a GPU and Mooncake's CUDA build (`mooncake-transfer-engine`); skipped elsewhere, CI
included. The device check runs it (see the README's "Device memory").
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvhandoff.transport.mooncake_engine import installed_builds
from tests.device.stage import check_landed_handoff

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
    check_landed_handoff(tmp_path, SECRET, "cuda:0", "cuda:0")
