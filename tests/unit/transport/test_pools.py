"""Pools: placement rule, the three kinds, sharing through /dev/shm, registration lifecycle."""

from __future__ import annotations

import os
import uuid

import numpy as np
import pytest
import torch

from kvhandoff.transport.config import ASCEND_ALIGN_BYTES, DEFAULT_ALIGN_BYTES, alignment_for
from kvhandoff.transport.errors import PoolError
from kvhandoff.transport.local import LocalTransport
from kvhandoff.transport.pool_base import EmbeddedPool, pack_offsets
from kvhandoff.transport.pool_shm import ShmPool
from kvhandoff.transport.pool_torch import TorchPool
from kvhandoff.transport.pools import open_pool
from kvhandoff.transport.regions import Region

SIZES = [5000, 4096, 1, 70000]


def shm_name() -> str:
    return f"kvhandoff-test-{uuid.uuid4().hex[:12]}"


def test_pack_offsets_aligns_each_region_in_order() -> None:
    offsets, total = pack_offsets(SIZES, 4096)
    assert offsets == [0, 8192, 12288, 16384]
    assert total == 16384 + 73728
    offsets, total = pack_offsets([1, 1], ASCEND_ALIGN_BYTES)
    assert offsets == [0, ASCEND_ALIGN_BYTES] and total == 2 * ASCEND_ALIGN_BYTES
    with pytest.raises(PoolError):
        pack_offsets([0], 4096)
    with pytest.raises(PoolError):
        pack_offsets([1], 3000)
    assert alignment_for("ascend") == ASCEND_ALIGN_BYTES
    assert alignment_for("tcp") == DEFAULT_ALIGN_BYTES


@pytest.mark.parametrize("align", [DEFAULT_ALIGN_BYTES, ASCEND_ALIGN_BYTES])
def test_torch_cpu_pool_places_regions_aligned_and_views_them(align: int) -> None:
    with open_pool("torch:cpu", SIZES, align_bytes=align) as pool:
        assert isinstance(pool, TorchPool)
        assert [r.length for r in pool.regions] == SIZES
        assert all(b % align == 0 for b in pool.bases)
        (span,) = pool.registrations
        assert span.addr % align == 0 and span.length % align == 0
        assert span.addr <= pool.bases[0] and pool.regions[-1].end <= span.end
        pool.write(1, np.full(10, 3, dtype=np.uint8), offset=5)
        assert pool.read(1)[5:15].tolist() == [3] * 10
        assert pool.view(1)[4] == 0
        assert pool.tensor(3).numel() == SIZES[3]


def test_shm_pool_is_shared_with_an_attacher_and_only_the_creator_unlinks() -> None:
    name = shm_name()
    creator = open_pool(f"shm:{name}", SIZES)
    assert isinstance(creator, ShmPool) and os.path.exists(f"/dev/shm/{name}")
    attacher = open_pool(f"shm:{name}", SIZES, create=False)
    assert isinstance(attacher, ShmPool) and attacher.offsets == creator.offsets
    creator.view(3)[:4] = [1, 2, 3, 4]
    assert attacher.view(3)[:4].tolist() == [1, 2, 3, 4]
    # Any other process can find region i at offsets[i] of the file.
    mm = np.memmap(f"/dev/shm/{name}", dtype=np.uint8, mode="r")
    assert mm[creator.offsets[3] : creator.offsets[3] + 4].tolist() == [1, 2, 3, 4]
    del mm
    attacher.close()
    assert os.path.exists(f"/dev/shm/{name}")
    creator.close()
    creator.close()
    assert not os.path.exists(f"/dev/shm/{name}")


def test_shm_pool_errors() -> None:
    with pytest.raises(PoolError):
        open_pool(f"shm:{shm_name()}", SIZES, create=False)  # nothing to attach to
    name = shm_name()
    with open_pool(f"shm:{name}", [4096]):
        with pytest.raises(PoolError):
            open_pool(f"shm:{name}", [4096])  # already exists
        with pytest.raises(PoolError):
            open_pool(f"shm:{name}", [1 << 20], create=False)  # file too small
    with pytest.raises(PoolError):
        open_pool("shm:../etc", [1])
    with pytest.raises(PoolError):
        open_pool("nvme:0", [1])


def test_shm_pool_close_with_a_live_view_still_unlinks() -> None:
    name = shm_name()
    pool = open_pool(f"shm:{name}", [4096])
    view = pool.view(0)
    pool.close()
    view[0] = 1  # memory stays mapped while the view lives
    assert not os.path.exists(f"/dev/shm/{name}")


def test_embedded_pool_from_tuples_and_tensors() -> None:
    a = np.zeros(100, dtype=np.uint8)
    t = torch.zeros(10, dtype=torch.float32)
    pool = EmbeddedPool([(a.ctypes.data, a.nbytes), t])
    assert pool.regions == (Region(a.ctypes.data, 100), Region(t.data_ptr(), 40))
    pool.view(1)[:4] = 255
    assert torch.isnan(t[0]) or t[0] != 0
    with pytest.raises(PoolError):
        EmbeddedPool([torch.zeros(4, 4).t()])


def test_registration_follows_the_pool_lifecycle() -> None:
    transport = LocalTransport()
    pool = open_pool("torch:cpu", SIZES)
    pool.register(transport)
    with pytest.raises(PoolError):
        pool.register(transport)
    pool.close()
    pool.close()
    with pytest.raises(PoolError):
        pool.register(transport)
    with pytest.raises(PoolError):
        pool.view(0)
    again = open_pool("torch:cpu", SIZES)
    again.register(transport)  # nothing left registered that could overlap
    again.close()
    transport.close()


def test_bad_torch_device_is_a_pool_error() -> None:
    with pytest.raises(PoolError):
        open_pool("torch:nonsense", [1])
