"""The NPU path on an Ascend machine: what the CPU tests can only stand in for (`tests/unit/
transport/test_npu.py`). Skipped without torch_npu and an NPU, CI included; run by
`tests/device/npu_run.sh` there (`make npu-device-kit` builds what it brings). Not yet run: no
Ascend machine was available while writing it.

- NPU memory known by address is wrapped without a copy, and aliases its owner;
- a `torch:npu` pool allocates 2 MiB-aligned regions under protocol `ascend`;
- gathers and scatters run on the NPU and return once its stream ran them (the `npu:0` case
  of `tests/unit/pipelines/test_packing.py`, which npu_run.sh runs too);
- the device digest (`mix64`, int64 arithmetic that wraps) is the same on the NPU as on the host;
- a landed handoff between two processes on two NPUs over Mooncake's `ascend` protocol (needs
  two NPUs, the NPU build of Mooncake, /etc/hccn.conf and `KVHANDOFF_NPU_HOST` naming this
  host's IP; skipped without them).
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import torch

torch_npu = pytest.importorskip("torch_npu", reason="needs torch_npu (an Ascend machine)")

from kvhandoff.pipelines.digest import digest  # noqa: E402
from kvhandoff.transport.ascend import HCCN_CONF, physical_npu  # noqa: E402
from kvhandoff.transport.config import ASCEND_ALIGN_BYTES  # noqa: E402
from kvhandoff.transport.pointers import tensor_at  # noqa: E402
from kvhandoff.transport.pool_base import EmbeddedPool  # noqa: E402
from kvhandoff.transport.pools import open_pool  # noqa: E402

pytestmark = pytest.mark.skipif(
    not torch.npu.is_available(), reason="needs an NPU that torch_npu can use"
)
SECRET = "npu-check-peer-secret-0123456789"


def test_npu_memory_is_aliased_on_its_own_device() -> None:
    owner = torch.zeros(4 << 20, dtype=torch.uint8, device="npu:0")
    t = tensor_at(int(owner.data_ptr()) + 4096, 1024, "npu:0")
    assert t.device == torch.device("npu:0") and t.data_ptr() == owner.data_ptr() + 4096
    t.fill_(3)
    torch.npu.synchronize()
    assert int(owner[4096:5120].sum()) == 3 * 1024 and int(owner[:4096].sum()) == 0
    pool = EmbeddedPool([t])
    assert not pool.on_host and pool.devices == frozenset({"npu"})
    del owner  # the wrapper never frees: torch's owner does, once


def test_an_npu_pool_is_2_mib_aligned_and_round_trips() -> None:
    with open_pool("torch:npu:0", [5000, 70000], align_bytes=ASCEND_ALIGN_BYTES) as pool:
        assert all(b % ASCEND_ALIGN_BYTES == 0 for b in pool.bases)
        (span,) = pool.registrations
        assert span.addr % ASCEND_ALIGN_BYTES == 0 and span.length % ASCEND_ALIGN_BYTES == 0
        data = np.arange(70000, dtype=np.uint8)
        pool.write(1, data)
        assert np.array_equal(pool.read(1), data)


@pytest.mark.parametrize("n", [8, 4096 + 5, (1 << 22) * 8 + 24])
def test_the_device_digest_is_the_host_digest(n: int) -> None:
    rng = np.random.default_rng(n)
    host = rng.integers(0, 256, n, dtype=np.uint8)
    host[: min(n, 64)] = 0xFF  # words near 2**64: the sums wrap
    on_npu = torch.from_numpy(host).to("npu:0")
    for seed in (0, 7, (1 << 64) - 1):
        assert digest(on_npu, "mix64", seed=seed) == digest(host, "mix64", seed=seed)
        assert digest(on_npu, "xxh3_128", seed=seed) == digest(host, "xxh3_128", seed=seed)


@pytest.mark.skipif(torch.npu.device_count() < 2, reason="needs two NPUs")
@pytest.mark.skipif(not HCCN_CONF.exists(), reason=f"needs {HCCN_CONF}")
@pytest.mark.skipif(not os.environ.get("KVHANDOFF_NPU_HOST"), reason="set KVHANDOFF_NPU_HOST")
def test_npu_pages_land_byte_exact_over_the_ascend_protocol(tmp_path: Path) -> None:
    pytest.importorskip("mooncake.engine", reason="needs Mooncake's NPU build")
    from kvhandoff.transport.mooncake_engine import installed_builds
    from tests.device.stage import check_landed_handoff

    if not any("npu" in b.split("-") for b in installed_builds()):
        pytest.skip(f"needs mooncake-transfer-engine-npu, not {sorted(installed_builds())}")
    host = os.environ["KVHANDOFF_NPU_HOST"]
    visible = os.environ.get("ASCEND_RT_VISIBLE_DEVICES")
    # One engine per NPU: the prefill process on npu:0, the decode here on npu:1.
    prefill = {
        "transport.protocol": "ascend",
        "transport.hostname": f"{host}:15000:npu_{physical_npu(0, visible)}",
        "transport.npu": "0",  # current where the engine starts
    }
    decode = {"transport.hostname": f"{host}:15001:npu_{physical_npu(1, visible)}"}
    check_landed_handoff(
        tmp_path,
        SECRET,
        "npu:0",
        "npu:1",
        prefill_settings=prefill,
        decode_settings={**prefill, **decode, "transport.npu": "1"},
    )
