"""Pools from the configuration: shm files are attached (never created) and published."""

import os

import numpy as np
import pytest

from kvhandoff.service.config import ConfigError
from kvhandoff.service.runtime.stages import open_stages, unplaced_layout
from kvhandoff.transport.blocks import Blocks
from kvhandoff.transport.errors import TransportError
from kvhandoff.transport.local import LocalTransport
from kvhandoff.transport.pool_shm import ShmPool
from kvhandoff.transport.regions import Region
from tests.unit.service.conftest import make_config


def test_a_missing_shm_file_is_a_config_error_naming_the_stage() -> None:
    name = f"kvh-test-missing-{os.getpid()}"
    config = make_config(stages=[{"num_pages": 16, "pool": f"shm:{name}"}])
    t = LocalTransport()
    with pytest.raises(ConfigError) as err:
        open_stages(config, t)
    assert err.value.context["field"] == "stages[0].pool"
    assert "does not exist" in err.value.message
    assert not os.path.exists(f"/dev/shm/{name}")  # nothing created behind the engine's back
    t.close()


def test_an_engine_created_shm_file_is_attached_and_its_offsets_published() -> None:
    name = f"kvh-test-attach-{os.getpid()}"
    config = make_config(stages=[{"num_pages": 16, "pool": f"shm:{name}"}])
    layout = unplaced_layout(config, config.model_spec(), config.stages[0])
    engine_side = ShmPool(name, layout.region_sizes, align_bytes=config.transport.align_bytes)
    t = LocalTransport()
    try:
        (hosted,) = open_stages(config, t)
        info = hosted.info(addresses=False)
        assert info.shm is not None and info.shm.name == name
        assert info.shm.offsets == engine_side.offsets
        engine_side.view(0)[:4] = [1, 2, 3, 4]  # the same memory, seen from both sides
        assert hosted.memory.region(0)[:4].tolist() == [1, 2, 3, 4]
        hosted.pool.close()
        assert os.path.exists(f"/dev/shm/{name}")  # the attacher never unlinks
    finally:
        engine_side.close()
        t.close()


@pytest.mark.parametrize("mode", ["landed", "direct"])
async def test_stage_memory_is_registered_and_published_in_direct_mode_only(mode: str) -> None:
    """What is registered is reachable: a landed service's KV, state and aux pools are not, so
    a transport write into them is refused, and their addresses are not published."""
    config = make_config(transfer__mode=mode)
    t, writer = LocalTransport(), LocalTransport()
    src = np.ones(64, dtype=np.uint8)
    writer.register([Region(src.ctypes.data, 64)])  # the writer's own source bytes
    (hosted,) = open_stages(config, t)
    try:
        base = hosted.pool.bases[0]
        u64 = np.uint64
        blocks = Blocks(
            np.array([src.ctypes.data], u64), np.array([base], u64), np.array([64], u64)
        )
        if mode == "landed":
            with pytest.raises(TransportError):
                await writer.write(t.local_target, blocks)
            assert hosted.memory.region(0)[:64].tolist() == [0] * 64
            assert {e.base for e in hosted.info(addresses=False).layout.kv} == {0}
        else:
            await writer.write(t.local_target, blocks)
            assert hosted.memory.region(0)[:64].tolist() == [1] * 64
            assert hosted.info(addresses=True).layout.kv[0].base == base
    finally:
        hosted.pool.close()
        t.close()
        writer.close()
