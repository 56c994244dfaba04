"""Fixtures for transport unit tests: host buffers, and one transport of each kind."""

from __future__ import annotations

import itertools
from collections.abc import AsyncIterator, Callable, Iterator

import numpy as np
import pytest

from kvhandoff.transport.base import Transport
from kvhandoff.transport.config import MooncakeConfig
from kvhandoff.transport.local import LocalTransport
from kvhandoff.transport.mooncake import MooncakeTransport
from kvhandoff.transport.pool_base import EmbeddedPool, Pool
from tests.fakes import FakeArrayEngineBinding, FakeEngine


@pytest.fixture
def make_buffer() -> Iterator[Callable[[int], np.ndarray]]:
    """Host uint8 arrays, kept alive for the whole test."""
    keep: list[np.ndarray] = []

    def make(size: int) -> np.ndarray:
        arr = np.zeros(size, dtype=np.uint8)
        keep.append(arr)
        return arr

    yield make


def pool_of(arr: np.ndarray) -> Pool:
    return EmbeddedPool([(arr.ctypes.data, arr.nbytes)])


@pytest.fixture(params=["local", "mooncake"])
async def transport(request: pytest.FixtureRequest) -> AsyncIterator[Transport]:
    """Each transport, writing to itself: local memmove, and the real engine over TCP loopback."""
    t: Transport
    if request.param == "local":
        t = LocalTransport(max_blocks_per_batch=64)
    else:
        pytest.importorskip("mooncake.engine")
        t = MooncakeTransport.start(MooncakeConfig(max_blocks_per_batch=64))
    yield t
    t.close()


_fake_ports = itertools.count(1)


@pytest.fixture(params=["lists", "arrays"])
def fake_engine(request: pytest.FixtureRequest) -> FakeEngine:
    """An engine binding double of each kind: 0.3.13 (list call only) and 0.3.14 (with the
    array call), so every rule of `MooncakeTransport` is checked on both of its call paths."""
    if request.param == "arrays":
        return FakeArrayEngineBinding(max_blocks=64)
    return FakeEngine(max_blocks=64)


def fake_transport(engine: FakeEngine, **config: object) -> MooncakeTransport:
    cfg = MooncakeConfig(**{"max_blocks_per_batch": 64, **config})  # type: ignore[arg-type]
    return MooncakeTransport(engine, cfg, f"fake:{next(_fake_ports)}")
