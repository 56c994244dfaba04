"""Device memory: `tensor_at` aliases memory known only by address, on the device named; a
transport is only given memory it can move.

The CUDA cases run where torch sees a GPU (the device check); on CPU they are skipped.
"""

from __future__ import annotations

import importlib.metadata

import numpy as np
import pytest
import torch

import kvhandoff.transport.mooncake
from kvhandoff.transport.errors import PoolError, TransportError
from kvhandoff.transport.local import LocalTransport
from kvhandoff.transport.mooncake_engine import installed_builds, refuse_memory
from kvhandoff.transport.pointers import tensor_at
from kvhandoff.transport.pool_base import EmbeddedPool
from kvhandoff.transport.regions import Region
from tests.fakes import FakeEngine
from tests.unit.transport.conftest import fake_transport

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def test_a_host_buffer_is_aliased_not_copied() -> None:
    memory = np.zeros(4096, dtype=np.uint8)
    addr = int(memory.ctypes.data)
    t = tensor_at(addr + 64, 128, "cpu")
    assert t.dtype == torch.uint8 and t.numel() == 128 and t.data_ptr() == addr + 64
    t[5] = 7
    memory[64 + 6] = 9
    assert memory[64 + 5] == 7 and int(t[6]) == 9
    pool = EmbeddedPool([t])  # what the SGLang backend hands its embedded service
    assert pool.regions[0].addr == addr + 64 and pool.on_host
    assert pool.view(0)[5] == 7


@pytest.mark.parametrize(
    ("addr", "length", "device", "named"),
    [
        (4096, 0, "cpu", "0x1000 of 0 bytes: address and length must be positive"),
        (0, 16, "cpu", "must be positive"),
        (4096, 16, "meta", "imports host, CUDA and NPU memory only"),
    ],
)
def test_what_cannot_be_wrapped_is_named(addr: int, length: int, device: str, named: str) -> None:
    with pytest.raises(PoolError) as err:
        tensor_at(addr, length, device)
    assert named in err.value.message


@pytest.mark.skipif(torch.version.cuda is not None, reason="a CUDA build of torch")
def test_cuda_memory_on_a_cpu_build_of_torch_is_named() -> None:
    with pytest.raises(PoolError) as err:
        tensor_at(4096, 16, "cuda:0")
    assert "buffers on 'cuda:0' needs a CUDA build of torch" in err.value.message


@needs_cuda
def test_cuda_memory_is_aliased_on_its_own_device() -> None:
    owner = torch.zeros(1 << 20, dtype=torch.uint8, device="cuda:0")
    t = tensor_at(int(owner.data_ptr()) + 4096, 1024, "cuda:0")
    assert t.device == torch.device("cuda:0") and t.data_ptr() == owner.data_ptr() + 4096
    t.fill_(3)
    assert int(owner[4096:5120].sum()) == 3 * 1024 and int(owner[:4096].sum()) == 0
    pool = EmbeddedPool([t])
    assert not pool.on_host and pool.tensor(0).data_ptr() == t.data_ptr()


@needs_cuda
def test_host_memory_named_as_cuda_is_refused() -> None:
    host = torch.zeros(4096, dtype=torch.uint8)
    with pytest.raises(PoolError):
        tensor_at(int(host.data_ptr()), 4096, "cuda:0")


@pytest.mark.parametrize(
    ("builds", "devices", "named"),
    [
        (
            ["mooncake-transfer-engine-non-cuda"],
            {"cuda"},
            "cuda memory needs mooncake-transfer-engine",
        ),
        (["mooncake-transfer-engine-efa-non-cuda"], {"cuda"}, "moves cpu memory only"),
        (
            ["mooncake-transfer-engine-non-cuda"],
            {"npu"},
            "npu memory needs mooncake-transfer-engine-npu",
        ),
        (["mooncake-transfer-engine"], {"npu"}, "moves cpu, cuda memory only"),
        # Two builds: which one's files won is unknown, so only what both move passes.
        (
            ["mooncake-transfer-engine", "mooncake-transfer-engine-non-cuda"],
            {"cuda"},
            "cpu memory only",
        ),
        (["mooncake-transfer-engine"], {"cpu", "cuda"}, None),
        (["mooncake-transfer-engine-cuda13", "mooncake-transfer-engine-efa"], {"cuda"}, None),
        (["mooncake-transfer-engine-npu"], {"cpu", "npu"}, None),
        ([], {"cuda", "npu"}, None),  # a build from source: trusted with what it is given
    ],
)
def test_a_mooncake_build_is_given_only_the_memory_it_moves(
    builds: list[str], devices: set[str], named: str | None
) -> None:
    if named is None:
        refuse_memory(frozenset(devices), frozenset(builds))
        return
    with pytest.raises(TransportError) as err:
        refuse_memory(frozenset(devices), frozenset(builds))
    assert named in str(err.value)


def test_the_installed_build_is_found_by_its_normalised_name(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    found = {"mooncake": ["Mooncake_Transfer_Engine.Non_CUDA"], "numpy": ["numpy"]}
    monkeypatch.setattr(importlib.metadata, "packages_distributions", lambda: found)
    installed_builds.cache_clear()
    try:
        assert installed_builds() == {"mooncake-transfer-engine-non-cuda"}
    finally:
        installed_builds.cache_clear()


def test_device_memory_never_reaches_an_engine_that_reads_it_as_host_memory(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    memory = np.zeros(64, dtype=np.uint8)
    region = [Region(int(memory.ctypes.data), 64)]
    local = LocalTransport()
    try:
        with pytest.raises(TransportError) as err:
            local.register(region, devices=frozenset({"cpu", "cuda"}))
        assert "host memory only" in str(err.value) and "cuda" in str(err.value)
        pool = EmbeddedPool([torch.from_numpy(memory[:32]), (int(memory.ctypes.data) + 32, 8)])
        assert pool.devices == {"cpu"}
        pool.register(local)  # host memory passes
        pool.close()
    finally:
        local.close()
    host_only = frozenset({"mooncake-transfer-engine-non-cuda"})
    monkeypatch.setattr(kvhandoff.transport.mooncake, "installed_builds", lambda: host_only)
    engine = FakeEngine()
    mooncake = fake_transport(engine)
    with pytest.raises(TransportError) as err:
        mooncake.register(region, devices=frozenset({"cpu", "cuda"}))
    assert "cuda memory needs mooncake-transfer-engine" in str(err.value)
    assert engine.registered == {}  # the engine never saw the address
    mooncake.register(region)
    assert engine.registered == {region[0].addr: 64}
