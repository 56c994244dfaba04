"""The Mooncake Transfer Engine itself: the calls `kvhandoff.transport.mooncake` makes on it,
starting one as a `MooncakeConfig` says, and which memory the installed build can move.

Called by `MooncakeTransport.start` and `register`, and by the raw-engine baselines of the
benchmarks and the test harness (`kvhandoff.service.testing.raw_engines`), which drive an engine
without the transport around it.
"""

from __future__ import annotations

import functools
import importlib.metadata
import logging
import os
import re
from collections.abc import Callable
from typing import Protocol

from kvhandoff.transport import ascend
from kvhandoff.transport.base import HOST
from kvhandoff.transport.blocks import U64
from kvhandoff.transport.config import MooncakeConfig
from kvhandoff.transport.errors import TransportError
from kvhandoff.transport.npu import use_npu

log = logging.getLogger(__name__)

#: What the engine prints (through glog, to stderr) on every healthy start, and why: operators
#: read an `E` line as a failure, so the service says once, next to it, that these are not.
EXPECTED_START_LINES = {
    "tcp": (
        'Mooncake\'s start-up lines "Using default malloc/free" (W), "No RDMA devices '
        'found" (W) and "Local segment descriptor not found" (E) are expected: protocol tcp '
        "needs no special allocator and no RDMA device, and the engine looks up its own segment "
        "while initialising, before any memory is registered"
    ),
}


class Engine(Protocol):
    """The subset of `mooncake.engine.TransferEngine` this module calls."""

    def get_rpc_port(self) -> int: ...
    def batch_register_memory(self, addrs: list[int], lengths: list[int]) -> int: ...
    def batch_unregister_memory(self, addrs: list[int]) -> int: ...
    def batch_transfer_sync_write(
        self, target: str, src: list[int], dst: list[int], lengths: list[int]
    ) -> int: ...


#: `TransferEngine.batch_transfer_sync_write_arrays(target_hostname, buffers,
#: peer_buffer_addresses, lengths, transport_hint="", nic_hint="") -> int` (Mooncake 0.3.14):
#: like `batch_transfer_sync_write`, over three one-dimensional, contiguous buffers of 8-byte
#: integers of equal length (else TypeError / ValueError before anything is sent).
WriteArrays = Callable[[str, U64, U64, U64], int]

#: The name the array call has on engines that have it.
WRITE_ARRAYS = "batch_transfer_sync_write_arrays"


#: The distributions Mooncake is published as all install the same `mooncake` package, so only
#: the distribution's name says which memory the build moves: `-non-cuda` builds (plain or
#: `-efa-`) host memory only, `-npu` Ascend NPU memory too, `-musa` Moore Threads GPUs', and
#: every other build (`mooncake-transfer-engine`, `-cuda13`, `-efa`, `-rocm`: torch names
#: ROCm devices `cuda` too) CUDA memory. A wheel built from source under the plain name is taken
#: for the CUDA build.
BUILD_PREFIX = "mooncake-transfer-engine"


def build_memory(name: str) -> frozenset[str]:
    """The torch device types a Mooncake distribution of this (normalised) name moves."""
    if "non-cuda" in name:
        return HOST
    for device in ("npu", "musa"):
        if device in name.split("-"):
            return HOST | {device}
    return HOST | {"cuda"}


@functools.cache
def installed_builds() -> frozenset[str]:
    """The Mooncake distributions installed (normalised names; empty: a build from source)."""
    names = importlib.metadata.packages_distributions().get("mooncake", ())
    # Normalised as package indexes do (PEP 503): metadata may spell it with `_` or capitals.
    normal = {re.sub(r"[-_.]+", "-", n).lower() for n in names}
    return frozenset(n for n in normal if n.startswith(BUILD_PREFIX))


def refuse_memory(devices: frozenset[str], builds: frozenset[str]) -> None:
    """Device memory a build would read as host addresses: refused, naming the build to install.
    With several builds installed, whichever one's files won is unknown: only memory all of them
    move passes. A build from source (none installed by name) is trusted with what it is given."""
    if not builds:
        return
    moves = frozenset.intersection(*(build_memory(b) for b in builds))
    foreign = devices - moves
    if foreign:
        wanted = {
            "cuda": "mooncake-transfer-engine (kvhandoff[cuda])",
            "npu": "mooncake-transfer-engine-npu (kvhandoff[ascend])",
        }
        need = "; ".join(
            f"{d} memory needs {wanted.get(d, 'a build for it')}" for d in sorted(foreign)
        )
        raise TransportError(
            f"the installed Mooncake ({', '.join(sorted(builds))}) moves "
            f"{', '.join(sorted(moves))} memory only: {need}"
        )


def start_engine(config: MooncakeConfig) -> Engine:
    """Construct and initialise a Transfer Engine as `config` says (imports mooncake lazily)."""
    if config.protocol == "ascend" or ":npu_" in config.hostname:
        # The service names the setting first (`kvhandoff.service.runtime.transport`); checked here
        # too for callers without it, before the engine (or its import) fails less clearly.
        problems = [f"{key}: {why}" for key, why in ascend.settings_problems(config)]
        host = ascend.host_problem() if config.protocol == "ascend" else None
        if problems or host:
            raise TransportError("; ".join([*problems, *([host] if host else [])]))
    if config.protocol == "ascend" and config.npu is not None:
        use_npu(config.npu)  # this thread constructs and initialises the engine
    try:
        from mooncake.engine import TransferEngine
    except ImportError as exc:
        raise TransportError(
            "the mooncake transport needs a mooncake-transfer-engine package "
            "(extras: kvhandoff[cpu], [cuda] or [ascend])"
        ) from exc
    # The documented exception to "nothing reads os.environ": the engine takes this tuning only
    # from the environment, at construction, so it is set here, just before.
    os.environ.update(config.engine_env())
    engine = TransferEngine()
    rc = engine.initialize(config.hostname, config.metadata, config.protocol, config.device_name)
    if rc != 0:
        raise TransportError(
            f"Transfer Engine initialisation failed ({config.protocol}, {config.metadata})", rc=rc
        )
    expected = EXPECTED_START_LINES.get(config.protocol)
    if expected is not None:
        log.info("%s", expected)
    return engine  # type: ignore[no-any-return]
