"""The Mooncake transport's configuration: one frozen Struct, tagged `backend = "mooncake"` in
the service's transport union (`kvhandoff.service.config.TransportConfig`), parsed once and passed
down.

Nothing in `transport` reads `os.environ`. The one documented exception runs the other way: the
Transfer Engine only takes some tuning from environment variables, read when the engine is
constructed, so `MooncakeTransport.start` *sets* `engine_env()` into the environment just before
it constructs the engine.
"""

from __future__ import annotations

import math
from typing import Annotated, Literal

import msgspec
from msgspec import Meta

from kvhandoff.transport.blocks import DEFAULT_MAX_BLOCKS_PER_BATCH

Protocol = Literal["tcp", "rdma", "ascend"]

#: Registered memory must be 2 MiB-aligned for the `ascend` protocol (HCCL registration).
ASCEND_ALIGN_BYTES = 2 << 20
#: Otherwise regions start on a page boundary, so a peer can mmap any of them.
DEFAULT_ALIGN_BYTES = 4 << 10

#: The engine reads `MC_TRANSFER_TIMEOUT` (whole seconds) and clamps it to at least 5.
ENGINE_MIN_TIMEOUT_S = 5
#: The engine allows a batch 1 ns per byte on top of `MC_TRANSFER_TIMEOUT` before giving up on
#: it: the slowest throughput a running call is granted. A constant, not a setting: a larger
#: value would declare a bound the engine does not keep.
ENGINE_MIN_BYTES_PER_S = 1e9
#: Between the worker's last `start_by` check and the engine starting the call there is only a
#: Python call in the same thread (no lock, no I/O), but that thread runs at lowered priority
#: and may be preempted right after the check; `max_call_s` allows this much for it.
CALL_START_ALLOWANCE_S = 0.5
#: Default byte cap per engine call: 1 GiB keeps the per-byte part of `max_call_s` where the
#: engine timeout plus one second has always put it (+1.07 s), and a 2,048-block batch stays
#: whole for blocks up to 512 KiB. Smaller caps cost calls: `kvhandoff bench transport --cases
#: bulk --repeat 7` (256 MiB in 1 MiB blocks, loopback, busy 2-core host) gave ours/raw 0.71
#: with a 64 MiB cap (4 calls) against 0.91-2.0 with one call.
DEFAULT_MAX_BYTES_PER_BATCH = 1 << 30
#: Default in-flight bound per peer: enough batches for 64 concurrent one-page writes to share
#: one engine call, and enough bytes for four landing windows (16 MiB each).
DEFAULT_MAX_INFLIGHT_BATCHES = 64
DEFAULT_MAX_INFLIGHT_BYTES = 64 << 20
#: How long a peer's lane (queue, bound, counters) outlives its last batch.
DEFAULT_PEER_IDLE_S = 60.0


#: The batch caps every backend cuts a write at (`kvhandoff.pipelines.planning` plans under them).
BlocksPerBatch = Annotated[int, Meta(ge=1, le=DEFAULT_MAX_BLOCKS_PER_BATCH)]
BytesPerBatch = Annotated[int, Meta(ge=4096, le=1 << 40)]


def alignment_for(protocol: str) -> int:
    """The byte alignment pools use for each region under `protocol`."""
    return ASCEND_ALIGN_BYTES if protocol == "ascend" else DEFAULT_ALIGN_BYTES


class MooncakeConfig(
    msgspec.Struct, frozen=True, forbid_unknown_fields=True, tag_field="backend", tag="mooncake"
):
    """How to start and drive one Transfer Engine.

    `hostname` is the engine's local name (`ip`, or `ip:port:npu_<id>` for ascend); peers reach
    us at `local_target` = `<ip>:<rpc port>`. `metadata` is `P2PHANDSHAKE` or a metadata-server
    URL (`etcd://...`, `http://...`). `device_name` names the RDMA NIC(s) for `rdma`.
    """

    hostname: str = "127.0.0.1"
    metadata: str = "P2PHANDSHAKE"
    protocol: Protocol = "tcp"
    device_name: str = ""
    #: Protocol `ascend` only: the NPU (this process's index, as torch numbers it) made current
    #: in the thread that starts the engine, which Mooncake's Ascend Direct transport requires.
    #: Unset: the service takes its stage pools' NPU; the SGLang backend sets the rank's.
    npu: Annotated[int, Meta(ge=0)] | None = None
    #: Blocks per engine call. Mooncake TCP (default settings) rejects more than ~2,100 queued
    #: requests to one peer and then often cannot reach that peer again.
    max_blocks_per_batch: BlocksPerBatch = DEFAULT_MAX_BLOCKS_PER_BATCH
    #: Bytes per engine call. Bounds how long one call may still write after it started
    #: (`max_call_s`): batches are cut at whichever cap comes first, and a block larger than
    #: this is cut into pieces of at most this many bytes.
    max_bytes_per_batch: BytesPerBatch = DEFAULT_MAX_BYTES_PER_BATCH
    #: Batches per peer submitted (one call running in the engine, the rest queued behind the
    #: peer's worker thread, which merges the queued ones that fit into its next call). Queued
    #: batches keep the worker busy back to back: with 2, whole-handoff throughput measured
    #: 0.6-0.8x raw Mooncake (the worker idled between batches while the event loop refilled
    #: the queue); with 8, about 1x (`kvhandoff bench handoff`). But 64 concurrent one-page
    #: handoffs then waited for a slot 8 at a time, each slot cycle a thread hop and a loop
    #: turn: 64 lets them share one call (write p50 30-106 ms -> 8-15 ms, CPU per handoff -11%
    #: at PP=1, -27% at PP=4); `max_inflight_bytes_per_peer` bounds what that lets bulk queue.
    max_inflight_batches_per_peer: Annotated[int, Meta(ge=1, le=DEFAULT_MAX_BLOCKS_PER_BATCH)] = (
        DEFAULT_MAX_INFLIGHT_BATCHES
    )
    #: Bytes per peer submitted and not yet landed (the running call's included); a batch
    #: larger than this is submitted alone. A small write arriving behind bulk waits for these
    #: bytes, and the one batch each other write to the peer has waiting, to land first: four
    #: 16 MiB landing windows by default.
    max_inflight_bytes_per_peer: BytesPerBatch = DEFAULT_MAX_INFLIGHT_BYTES
    #: Upper bound for one batch, from the moment the engine starts it to the last byte landing.
    transfer_timeout_s: Annotated[float, Meta(gt=0, le=600)] = 10.0
    #: Worker threads that make engine calls, shared by all peers (one call per peer at a time,
    #: so this is also how many peers can be written to at once). Threads start on demand and
    #: exit after `peer_idle_s` without work: 200 peers do not mean 200 threads.
    max_worker_threads: Annotated[int, Meta(ge=1, le=256)] = 16
    #: A peer's lane (queue, in-flight bound) and an idle worker thread are reclaimed after this
    #: long without a batch; a new write recreates them.
    peer_idle_s: Annotated[float, Meta(gt=0, le=86400)] = DEFAULT_PEER_IDLE_S
    #: Protocol `ascend` only: the Ascend transports' own link set-up and transfer timeouts,
    #: which the engine reads from ASCEND_CONNECT_TIMEOUT / ASCEND_TRANSFER_TIMEOUT (whole ms;
    #: `engine_env` sets them). Mooncake's defaults, 3 s each. Both count in `max_call_s`.
    ascend_connect_timeout_s: Annotated[float, Meta(ge=0.001, le=600)] = 3.0
    ascend_transfer_timeout_s: Annotated[float, Meta(ge=0.001, le=600)] = 3.0
    #: Extra engine tuning, e.g. {"MC_TCP_SLICE_SIZE": "262144"}; only `MC_TCP_*` keys allowed.
    tcp_env: dict[str, str] = msgspec.field(default_factory=dict)

    def __post_init__(self) -> None:
        bad = [k for k in self.tcp_env if not k.startswith("MC_TCP_")]
        if bad:
            raise ValueError(f"tcp_env accepts only MC_TCP_* keys, got {bad}")

    @property
    def align_bytes(self) -> int:
        return alignment_for(self.protocol)

    @property
    def max_call_s(self) -> float:
        """How long one engine call can still write after it started (after the worker's last
        `start_by` check passed), at most.

        The engine gives up on a batch after `MC_TRANSFER_TIMEOUT` (whole seconds, floor 5; see
        `engine_env`) plus 1 ns per byte, and a batch holds at most `max_bytes_per_batch` bytes:
        `CALL_START_ALLOWANCE_S + max(5, ceil(transfer_timeout_s)) + max_bytes_per_batch /
        ENGINE_MIN_BYTES_PER_S` (11.57 s with the defaults). Under `ascend` the transport below
        the engine's wait may still run until its own link set-up and transfer timeouts have
        both passed (documented by Mooncake, not measured here): the longer bound is taken.
        """
        engine_s: float = max(ENGINE_MIN_TIMEOUT_S, math.ceil(self.transfer_timeout_s))
        if self.protocol == "ascend":
            ascend_s = self.ascend_connect_timeout_s + self.ascend_transfer_timeout_s
            engine_s = max(engine_s, ascend_s)
        return CALL_START_ALLOWANCE_S + engine_s + self.max_bytes_per_batch / ENGINE_MIN_BYTES_PER_S

    @property
    def engine_timeout_s(self) -> float:
        """The same bound as `max_call_s`, for callers that size a grace period from config."""
        return self.max_call_s

    def engine_env(self) -> dict[str, str]:
        """Environment the engine must see at construction.

        `MC_TRANSFER_TIMEOUT` follows `transfer_timeout_s` (rounded up; the engine's floor is 5 s)
        so the engine gives up on a hung peer about when the asyncio side does, and the worker
        thread blocked in it is freed (default would be 30 s).

        `MC_TCP_ADMISSION_TIMEOUT_MS` (unless `tcp_env` sets it) is that same timeout: a batch's
        requests beyond the peer's TCP lane queue (1,024 by default) wait for room at most that
        long, 1 s by default. On a starved CPU the lanes drain slower than that: the requests
        failed (rc -1), and the peer often stayed failed (2,048-block batches on a loaded 2-core
        host: in one run 39 of 40 writes failed). Admitted no later than the call's own timeout,
        a request enters the queue while its call still waits for it, as if the queue had held
        it from the start: `max_call_s` is unchanged.

        Under `ascend`, `ASCEND_CONNECT_TIMEOUT` and `ASCEND_TRANSFER_TIMEOUT` follow
        `ascend_connect_timeout_s` and `ascend_transfer_timeout_s` (whole milliseconds, rounded
        up so a configured bound is never shortened), whatever the environment held.
        """
        timeout = max(ENGINE_MIN_TIMEOUT_S, math.ceil(self.transfer_timeout_s))
        admission = {"MC_TCP_ADMISSION_TIMEOUT_MS": str(timeout * 1000)}
        env = {**admission, **self.tcp_env, "MC_TRANSFER_TIMEOUT": str(timeout)}
        if self.protocol == "ascend":
            env["ASCEND_CONNECT_TIMEOUT"] = str(math.ceil(self.ascend_connect_timeout_s * 1000))
            env["ASCEND_TRANSFER_TIMEOUT"] = str(math.ceil(self.ascend_transfer_timeout_s * 1000))
        return env
