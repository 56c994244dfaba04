"""Test doubles shared by the unit tests. Integration tests never use these: they run the real
Transfer Engine in real processes."""

from __future__ import annotations

import asyncio
import ctypes
import threading
import time
import types
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import msgspec
import numpy as np
from aiohttp import web
from aiohttp.test_utils import TestServer

from kvhandoff.pipelines.messages import HeartbeatAck, HeartbeatMsg
from kvhandoff.service.config import Config, load_config

# -- time -----------------------------------------------------------------------------------


class Clock:
    """A clock only the test moves: calling it returns `now`, which the test sets (for the
    `clock=` of the event bus, metrics, activity, signers, the dispatcher, heartbeats)."""

    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


# -- configuration --------------------------------------------------------------------------


def local_config(
    role: str, stages: list[dict[str, Any]], state_dir: str | Path, **settings: Any
) -> Config:
    """A valid config of `role` hosting `stages`, over the local transport on a free port, its
    records and outbox under `state_dir`; `settings` are dotted keys or whole tables, e.g.
    `**{"handoff.max_concurrent": 2}` or `model={...}`."""
    base = {
        "role": role,
        "stages": stages,
        "server.port": 0,
        "server.state_dir": str(state_dir),
        "transport.backend": "local",
    }
    return load_config(None, {}, {**base, **settings})


# -- transport ------------------------------------------------------------------------------


class FakeEngine:
    """A fault-injecting stand-in for `mooncake.engine.TransferEngine` (the `Engine` protocol of
    `kvhandoff.transport.mooncake`), for unit tests of `MooncakeTransport`.

    Writes are real memmoves within this process, so bytes really land (or do not). Knobs:

    - `rc`: every call returns it (no bytes move when non-zero);
    - `script(*outcomes)`: the next calls, one outcome each, before `rc` applies again: an int
      is that call's rc, an exception instance is raised by that call (no bytes move);
    - `hang`: an Event; calls block until it is set (then run as scripted);
    - `max_blocks`: a call with more blocks fails (rc -1), like the real TCP per-peer queue.

    Synchronisation without sleeps: `wait_entered(n)` blocks until `n` calls have entered,
    `wait_returned(n)` until `n` have returned or raised. Records every call's blocks, bytes and
    target, and the highest number of concurrent calls.
    """

    def __init__(self, *, max_blocks: int = 2048) -> None:
        self.rc = 0
        self.hang: threading.Event | None = None
        self.max_blocks = max_blocks
        self.batch_sizes: list[int] = []
        self.bytes_per_call: list[int] = []
        self.targets: list[str] = []
        #: Per call, in the order calls entered: its destination addresses and lengths.
        self.dst_blocks: list[tuple[list[int], list[int]]] = []
        self.registered: dict[int, int] = {}
        #: Per call, which binding entry point it came through: "lists" or "arrays".
        self.api_calls: list[str] = []
        self.active = 0
        self.max_active = 0
        self.entered = 0
        self.returned = 0
        self._script: deque[int | BaseException] = deque()
        self._cv = threading.Condition()

    def script(self, *outcomes: int | BaseException) -> None:
        with self._cv:
            self._script.extend(outcomes)

    def wait_entered(self, n: int, timeout_s: float = 30.0) -> None:
        self._wait(lambda: self.entered >= n, timeout_s, f"{n} calls entered")

    def wait_returned(self, n: int, timeout_s: float = 30.0) -> None:
        self._wait(lambda: self.returned >= n, timeout_s, f"{n} calls returned")

    def _wait(self, ready: Callable[[], bool], timeout_s: float, what: str) -> None:
        with self._cv:
            if not self._cv.wait_for(ready, timeout_s):
                raise AssertionError(f"timed out waiting for {what} (entered {self.entered})")

    def touched(self, lo: int, hi: int, since_call: int = 0) -> bool:
        """Whether a call (from the `since_call`-th to enter on) wrote into [lo, hi)."""
        return any(
            d < hi and lo < d + n
            for dst, lengths in self.dst_blocks[since_call:]
            for d, n in zip(dst, lengths, strict=True)
        )

    def get_rpc_port(self) -> int:
        return 12345

    def batch_register_memory(self, addrs: list[int], lengths: list[int]) -> int:
        if any(a in self.registered for a in addrs):
            return -7
        self.registered.update(zip(addrs, lengths, strict=True))
        return 0

    def batch_unregister_memory(self, addrs: list[int]) -> int:
        if any(a not in self.registered for a in addrs):
            return -3
        for a in addrs:
            del self.registered[a]
        return 0

    def batch_transfer_sync_write(
        self, target: str, src: list[int], dst: list[int], lengths: list[int]
    ) -> int:
        self.api_calls.append("lists")
        return self._write(target, src, dst, lengths)

    def _write(self, target: str, src: list[int], dst: list[int], lengths: list[int]) -> int:
        with self._cv:
            self.active += 1
            self.entered += 1
            self.max_active = max(self.max_active, self.active)
            self.batch_sizes.append(len(src))
            self.bytes_per_call.append(sum(lengths))
            self.targets.append(target)
            self.dst_blocks.append((dst, lengths))
            self._cv.notify_all()
        try:
            if self.hang is not None:
                self.hang.wait()
            with self._cv:
                outcome = self._script.popleft() if self._script else self.rc
            if isinstance(outcome, BaseException):
                raise outcome
            if len(src) > self.max_blocks:
                return -1
            if outcome != 0:
                return outcome
            for s, d, n in zip(src, dst, lengths, strict=True):
                ctypes.memmove(d, s, n)
            return 0
        finally:
            with self._cv:
                self.active -= 1
                self.returned += 1
                self._cv.notify_all()


class FakeArrayEngineBinding(FakeEngine):
    """`FakeEngine` as a Mooncake 0.3.14 binding: it also has `batch_transfer_sync_write_arrays`
    (`kvhandoff.transport.mooncake_engine.WRITE_ARRAYS`), which checks its arguments as the real
    binding does (one-dimensional, contiguous, 8-byte integers, equal lengths: TypeError /
    ValueError otherwise), records what it was given (`array_args`: the three arrays per call, as
    passed), and writes with the same memmoves as the list call. The list call stays, as on a real
    0.3.14 engine; `api_calls` tells which one the transport used."""

    def __init__(self, *, max_blocks: int = 2048) -> None:
        super().__init__(max_blocks=max_blocks)
        self.array_args: list[tuple[object, object, object]] = []

    def batch_transfer_sync_write_arrays(
        self, target: str, src: object, dst: object, lengths: object
    ) -> int:
        self.api_calls.append("arrays")
        self.array_args.append((src, dst, lengths))
        arrays = [
            _binding_buffer(name, a)
            for name, a in (("buffers", src), ("peer_buffer_addresses", dst), ("lengths", lengths))
        ]
        if len({a.shape[0] for a in arrays}) != 1:
            raise ValueError("buffers, peer_buffer_addresses and lengths must have the same length")
        s, d, n = (a.astype(np.uint64).tolist() for a in arrays)
        return self._write(target, s, d, n)


def _binding_buffer(name: str, value: object) -> np.ndarray:
    """What the 0.3.14 binding accepts for one of its three buffers (its own error texts)."""
    if not isinstance(value, np.ndarray):
        raise TypeError(f"{name}: a buffer is required, got {type(value).__name__}")
    if value.ndim != 1:
        raise TypeError(f"{name} must be a one-dimensional array")
    if not value.flags.c_contiguous:
        raise TypeError(f"{name} must be contiguous")
    if value.dtype.kind not in "iu" or value.dtype.itemsize != 8:
        raise TypeError(f"{name} must hold 8-byte integers (uint64/int64)")
    if value.dtype.kind == "i" and value.size and int(value.min()) < 0:
        raise ValueError(f"{name} must not contain negative values")
    return value


# -- torch_npu (no NPU runs here) -----------------------------------------------------------


class NpuDevice(NamedTuple):
    """A torch device of type `npu`, as torch parses one once torch_npu has registered it."""

    type: str
    index: int | None

    def __str__(self) -> str:
        return self.type if self.index is None else f"{self.type}:{self.index}"


class TorchWithNpu:
    """The slice of `torch` that `kvhandoff.transport.npu` calls, as torch_npu leaves it: `npu`
    devices parse. CPU builds of torch cannot parse them, and the real registration (renaming
    torch's private device type) cannot be undone in a test process."""

    uint8 = "uint8"

    @staticmethod
    def device(spec: str, index: int | None = None) -> NpuDevice:
        kind, _, tail = spec.partition(":")
        if kind != "npu" or (tail and not tail.isdigit()):
            raise RuntimeError(f"Expected one of cpu, cuda, npu device type: {spec}")
        return NpuDevice(kind, int(tail) if tail else index)


class StandInTorchNpu(types.ModuleType):
    """A `torch_npu` module whose import succeeds, for the tests that need one: it reports
    `devices` NPUs and records what its pointer-wrapping constructors were asked for (with
    `constructors=False` it lacks them). The tensors it returns hold no memory; no byte moves.
    `aliases=False`: a wrap that lands elsewhere than the address it was given."""

    __version__ = "2.6.0.stand-in"

    def __init__(self, *, devices: int = 1, constructors: bool = True, aliases: bool = True):
        super().__init__("torch_npu")
        self.calls: list[tuple[str, tuple[object, ...]]] = []
        self.npu = types.SimpleNamespace(
            device_count=lambda: devices,
            set_device=lambda index: self.calls.append(("set_device", (index,))),
        )
        self._C = types.SimpleNamespace()
        if constructors:
            self._C._construct_storage_from_data_pointer = self._storage
            self._C._construct_NPU_Tensor_From_Storage_And_Metadata = self._tensor
        self._aliases = aliases

    def _storage(self, addr: int, device: object, nbytes: int) -> tuple[int, object]:
        self.calls.append(("storage", (addr, device, nbytes)))
        return (addr, device)

    def _tensor(self, metadata: dict[str, object], storage: tuple[int, object]) -> object:
        self.calls.append(("tensor", (metadata, storage)))
        addr, device = storage
        at = addr if self._aliases else addr + 4096
        return types.SimpleNamespace(data_ptr=lambda: at, device=device)


def threads_named(prefix: str) -> int:
    """Live threads whose name starts with `prefix`."""
    return sum(1 for t in threading.enumerate() if t.name.startswith(prefix))


def wait_until(ready: Callable[[], bool], timeout_s: float = 30.0, what: str = "condition") -> None:
    """Poll `ready()` until true (for facts no event announces, such as a thread exiting)."""
    deadline = time.monotonic() + timeout_s
    while not ready():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.005)


async def eventually(
    ready: Callable[[], bool], timeout_s: float = 30.0, what: str = "condition"
) -> None:
    """Poll `ready()` on the running loop until true, for a fact that tasks on that loop reach
    after real sleeps or I/O (however many turns a loaded machine takes). The bound only ends a
    failing test; it never decides a passing one."""
    deadline = time.monotonic() + timeout_s
    while not ready():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.001)


# -- engine adapters ------------------------------------------------------------------------


class RecordingService:
    """An engine adapter's embedded service (`kvhandoff.service.embedded.EmbeddedService`) as the
    adapter sees it: it records the engine-facing calls, raises what a test queues for one (`fail`),
    and hands the adapter the events a test `emit`s, on the test's thread. For the adapter's
    own bookkeeping only: what the service does with the calls is the real service's tests."""

    url = "http://127.0.0.1:1"

    def __init__(self) -> None:
        self.calls: list[tuple[str, tuple[object, ...], dict[str, object]]] = []
        self.failures: dict[str, BaseException] = {}
        self._listeners: list[Callable[[object], None]] = []
        self._lock = threading.Lock()

    def add_listener(self, listener: Callable[[object], None]) -> None:
        self._listeners.append(listener)

    def emit(self, event: object) -> None:
        for listener in self._listeners:
            listener(event)

    def fail(self, call: str, error: BaseException) -> None:
        self.failures[call] = error

    def named(self, call: str) -> list[tuple[tuple[object, ...], dict[str, object]]]:
        with self._lock:
            return [(a, k) for c, a, k in self.calls if c == call]

    def _record(self, call: str, *args: object, **kw: object) -> None:
        with self._lock:
            self.calls.append((call, args, kw))
        if call in self.failures:
            raise self.failures[call]

    def stage_ready(self, *args: object, **kw: object) -> None:
        self._record("stage_ready", *args, **kw)

    def abort_prefill(self, *args: object, **kw: object) -> None:
        self._record("abort_prefill", *args, **kw)

    def expect_handoff(self, request: object) -> object:
        self._record("expect_handoff", request)
        return request

    def abort(self, handoff_id: str) -> None:
        self._record("abort", handoff_id)

    def stop(self) -> None:
        self._record("stop")


# -- peers ----------------------------------------------------------------------------------


class SteppedTime:
    """A clock and a `sleep` that only the test moves on: `sleep(d)` parks its caller;
    `await next_sleep()` returns the next parked delay, `wake()` advances the clock by it and
    resumes that sleeper. Whatever a task does between two sleeps is what happened at one
    instant of the controlled time."""

    def __init__(self) -> None:
        self.now = 0.0
        self.delays: list[float] = []
        self._parked: asyncio.Queue[tuple[float, asyncio.Future[None]]] = asyncio.Queue()
        self._current: tuple[float, asyncio.Future[None]] | None = None

    def __call__(self) -> float:
        return self.now

    async def sleep(self, delay_s: float) -> None:
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        await self._parked.put((delay_s, done))
        await done

    async def next_sleep(self) -> float:
        self._current = await self._parked.get()
        self.delays.append(self._current[0])
        return self._current[0]

    def wake(self) -> None:
        assert self._current is not None, "next_sleep() first"
        delay_s, done = self._current
        self._current = None
        self.now += delay_s
        done.set_result(None)


class PeerServer:
    """A real HTTP peer on 127.0.0.1 serving the heartbeat and watch routes of the peer
    protocol, for the heartbeat tests. `watch` says how the watch route answers: "hold" (200,
    then streams until `end_watch` is set), "at_once" (200, one byte, closed), "absent" (no such
    route: an older version's 404) or an HTTP status (a problem+json refusal). Heartbeats are
    answered, or held until `release` is set while `hold_heartbeats` is. Counts what it got."""

    def __init__(self, watch: str | int = "hold") -> None:
        self.watch = watch
        self.hold_heartbeats = False
        self.release = asyncio.Event()
        self.end_watch = asyncio.Event()
        self.watch_opened = asyncio.Event()
        self.watch_attempts = 0
        self.heartbeats = 0
        self._beat = asyncio.Condition()
        self._server: TestServer | None = None
        self.url = ""

    async def start(self) -> str:
        app = web.Application()
        app.router.add_post("/v1/peer/heartbeats", self._heartbeat)
        app.router.add_get("/v1/peer/watch", self._watch)
        server = TestServer(app, host="127.0.0.1")
        await server.start_server()
        self._server = server
        self.url = str(server.make_url("")).rstrip("/")
        return self.url

    async def close(self) -> None:
        self.release.set()
        self.end_watch.set()
        if self._server is not None:
            await self._server.close()

    async def kill(self) -> None:
        """What a killed process looks like: its port refuses first, then the kernel ends its
        streams. (Stopping the listener leaves open connections open.)"""
        assert self._server is not None and self._server.runner is not None
        for site in list(self._server.runner.sites):
            await site.stop()
        self.end_watch.set()

    async def heartbeats_reach(self, n: int) -> None:
        """Wait until `n` heartbeats arrived (an event, not a time)."""
        async with self._beat:
            await self._beat.wait_for(lambda: self.heartbeats >= n)

    async def _heartbeat(self, request: web.Request) -> web.Response:
        msg = msgspec.json.decode(await request.read(), type=HeartbeatMsg)
        async with self._beat:
            self.heartbeats += 1
            self._beat.notify_all()
        if self.hold_heartbeats:
            await self.release.wait()
        ack = HeartbeatAck(role="prefill", url=self.url, incarnation="p1", live=msg.live)
        return web.Response(body=msgspec.json.encode(ack), content_type="application/json")

    async def _watch(self, request: web.Request) -> web.StreamResponse:
        self.watch_attempts += 1
        if self.watch == "absent":
            raise web.HTTPNotFound()
        if isinstance(self.watch, int):
            problem = {"status": self.watch, "code": {401: "unauthorized"}.get(self.watch)}
            return web.Response(
                status=self.watch,
                body=msgspec.json.encode({k: v for k, v in problem.items() if v is not None}),
                content_type="application/problem+json",
            )
        response = web.StreamResponse(headers={"Content-Type": "text/plain"})
        await response.prepare(request)
        await response.write(b"\n")
        if self.watch == "hold":
            self.watch_opened.set()
            await self.end_watch.wait()
        return response
