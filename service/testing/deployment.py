"""A local multi-process deployment: one decode service and PP prefill services, each its own
`kvhandoff serve` process, with the harness playing the engines' memory.

A supported test utility (docs/guides/testing.md): used by `kvhandoff demo`, the benchmarks,
the integration tests and integrators' CI. `LocalDeployment` creates one /dev/shm pool
file per prefill stage and one for decode (regions = the layout's entries, KV first, then state,
at `pool.offsets[i]`), writes one TOML config per process naming them `shm:<name>` (the services
attach them), starts the processes on free loopback ports and waits for `/readyz`. It owns
everything it started: `close()` (also on exceptions, Ctrl-C and, as a backup, at interpreter
exit) stops every process and unlinks every pool file. Should the harness die without closing
(SIGKILL), its services get SIGTERM from the kernel and the next harness unlinks its pool files.
"""

from __future__ import annotations

import atexit
import contextlib
import itertools
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

import msgspec
import numpy as np
import numpy.typing as npt

from kvhandoff.pipelines.layout import StageLayout
from kvhandoff.pipelines.models import ModelSpec, decode_layout, partition_layers, stage_layout
from kvhandoff.pipelines.pairing import PairingCache
from kvhandoff.pipelines.planning import plan
from kvhandoff.service.config import (
    ENV_PREFIX,
    HandoffConfig,
    ModelConfig,
    RecordsConfig,
    TransferConfig,
    TransportConfig,
    WebhooksConfig,
    load_config,
)
from kvhandoff.transport.blocks import Blocks
from kvhandoff.transport.config import MooncakeConfig
from kvhandoff.transport.pool_shm import SHM_DIR, ShmPool

HOST = "127.0.0.1"
Pages = Sequence[int] | npt.NDArray[np.int64]
#: Log bytes quoted in a start-up error.
LOG_TAIL_BYTES = 4000
_deployments = itertools.count()
#: Pool files are `kvh-<pid>-<n>-s<rank>` and `kvh-<pid>-<n>-decode`.
POOL_PREFIX = "kvh"
_POOL_NAME = re.compile(rf"^{POOL_PREFIX}-(?P<pid>\d+)-\d+-(s\d+|decode)$")

#: A service process's entry point: `kvhandoff` with the harness's pid first. A harness that dies
#: without closing (SIGKILL, an unhandled SIGTERM) runs neither finally nor atexit; Linux's
#: parent-death signal then still stops its services (pid 0: not watched).
_BOOT = """\
import ctypes, os, runpy, signal, sys
parent = int(sys.argv.pop(1))
libc = ctypes.CDLL(None)
if parent and hasattr(libc, "prctl"):
    libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    if os.getppid() != parent:  # the harness died before the line above
        sys.exit(1)
runpy.run_module("kvhandoff.service.cli", run_name="__main__")
"""


class DeploymentError(RuntimeError):
    """A service process did not come up (exited, or not ready in time); the message quotes its
    log tail."""


@dataclass
class ServiceProcess:
    """One `kvhandoff serve` process of the deployment."""

    name: str  # "decode", "prefill-0", "prefill-1", ...
    role: str
    ranks: tuple[int, ...]  # PP ranks hosted (decode: its one stage, rank 0)
    url: str
    config_path: Path
    log_path: Path
    popen: subprocess.Popen[bytes] | None = None

    @property
    def running(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    def log_tail(self, max_bytes: int = LOG_TAIL_BYTES) -> str:
        try:
            data = self.log_path.read_bytes()
        except OSError:
            return "(no log)"
        return data[-max_bytes:].decode(errors="replace")


def _stage_groups(
    pp_size: int, groups: Sequence[Sequence[int]] | None, spares: Sequence[Sequence[int]]
) -> tuple[list[tuple[int, ...]], list[tuple[int, ...]]]:
    """The ranks each prefill process hosts (default: one each), every rank exactly once, and
    the spare processes' ranks, each a set of hosted ranks; ValueError otherwise."""
    hosts = [tuple(g) for g in (groups or [[r] for r in range(pp_size)])]
    hosted = sorted(r for g in hosts for r in g)
    if hosted != list(range(pp_size)) or any(not g for g in hosts):
        raise ValueError(f"groups {hosts} must host each of ranks 0..{pp_size - 1} once")
    extra = [tuple(g) for g in spares]
    if any(not g or not set(g) <= set(hosted) or len(set(g)) != len(g) for g in extra):
        raise ValueError(f"spares {extra} must each host distinct ranks of 0..{pp_size - 1}")
    return hosts, extra


class LocalDeployment:
    """Decode + PP prefill as separate processes on loopback. Use as a context manager.

    `groups` says which PP ranks share a prefill process (default: one process per stage, e.g.
    `[[0, 1], [2, 3]]` or `[[0, 1, 2, 3]]`). `num_pages`/`num_slots` size every stage pool and,
    unless `decode_pages`/`decode_slots` are given, the decode pool. `model` holds preset
    overrides (`scale`, `num_layers`, `page_size`, `indexer`). `env` is added to the inherited
    environment of every process (`KVHANDOFF_*` variables of this process are not inherited:
    the written configs are the whole configuration). `spares` adds prefill processes
    (`spare-0`, ...) hosting those ranks again from the same stage pools (so they send the same
    source bytes), listed neither in `prefill_urls` nor in the decode's default peers: a second,
    healthy set of stages for a test that stops the first (name them in the create body).
    `preallocate` allocates every pool file's memory when it is created (`posix_fallocate`), as
    an engine's KV memory is allocated before any request: see `_preallocate`.
    """

    def __init__(
        self,
        *,
        preset: str = "hybrid-npu-mla",
        model: Mapping[str, int | bool] | None = None,
        pp_size: int = 4,
        groups: Sequence[Sequence[int]] | None = None,
        spares: Sequence[Sequence[int]] = (),
        num_pages: int = 1024,
        num_slots: int = 64,
        decode_pages: int | None = None,
        decode_slots: int | None = None,
        transport: TransportConfig | None = None,
        handoff: HandoffConfig | None = None,
        transfer: TransferConfig | None = None,
        webhooks: WebhooksConfig | None = None,
        records: RecordsConfig | None = None,
        token: str | None = None,
        log_level: str = "info",
        work_dir: str | Path | None = None,
        env: Mapping[str, str] | None = None,
        ready_timeout_s: float = 60.0,
        preallocate: bool = False,
    ) -> None:
        self.groups, self.spares = _stage_groups(pp_size, groups, spares)
        self._model_table: dict[str, Any] = {"preset": preset, **(model or {})}
        self.model: ModelSpec = msgspec.convert(self._model_table, ModelConfig).build()
        self.partition = partition_layers(self.model.num_layers, pp_size)
        self.stage_layouts: dict[int, StageLayout] = {
            r: stage_layout(self.model, self.partition, r, num_pages=num_pages, num_slots=num_slots)
            for r in range(pp_size)
        }
        self._sizes = {"decode": (decode_pages or num_pages, decode_slots or num_slots)}
        self._sizes["prefill"] = (num_pages, num_slots)
        self.decode_layout: StageLayout = decode_layout(
            self.model, num_pages=self._sizes["decode"][0], num_slots=self._sizes["decode"][1]
        )
        self.transport = transport or MooncakeConfig()
        self.handoff = handoff or HandoffConfig()
        # Small landing and staging memory: a deployment on one machine runs several services.
        self.transfer = transfer or TransferConfig(
            landing_bytes=32 << 20, window_bytes=4 << 20, staging_bytes=16 << 20
        )
        self.webhooks = webhooks or WebhooksConfig()
        self.records = records or RecordsConfig()
        self.token = token
        self.log_level = log_level
        self.ready_timeout_s = ready_timeout_s
        self.preallocate = preallocate
        self.work_dir = Path(work_dir) if work_dir is not None else None
        self._made_dir: Path | None = None  # a temp dir start() made, removed by close()
        self._env = {k: v for k, v in os.environ.items() if not k.startswith(ENV_PREFIX)}
        self._env.update(env or {})
        self._prefix = f"{POOL_PREFIX}-{os.getpid()}-{next(_deployments)}"
        self._stage_pools: dict[int, ShmPool] = {}
        self._decode_pool: ShmPool | None = None
        self.processes: list[ServiceProcess] = []
        self._port_holds: list[socket.socket] = []  # see _hold_ports; closed by close()
        self._started = self._closed = False

    # -- start ------------------------------------------------------------------------------

    def start(self) -> LocalDeployment:
        """Create the pools, write the configs, start every process and wait until all are
        ready. On any failure (Ctrl-C included) everything started so far is torn down."""
        if self._started:
            raise RuntimeError("this deployment was already started")
        self._started = True
        atexit.register(self.close)
        try:
            if self.work_dir is None:
                self.work_dir = self._made_dir = Path(tempfile.mkdtemp(prefix="kvhandoff-"))
            self.work_dir.mkdir(parents=True, exist_ok=True)
            _sweep_stale_pools()
            self._create_pools()
            self._plan_processes()
            for proc in self.processes:
                self._launch(proc)
            self._wait_ready()
        except BaseException as exc:
            # Keep the logs a DeploymentError points at; anything else (Ctrl-C) cleans up fully.
            if isinstance(exc, DeploymentError):
                self._made_dir = None
            self.close()
            raise
        return self

    def _create_pools(self) -> None:
        align = self.transport.align_bytes
        # The engine's part: the services only attach (create=False) files that already exist.
        for r, layout in self.stage_layouts.items():
            name = f"{self._prefix}-s{r}"
            self._stage_pools[r] = ShmPool(name, layout.region_sizes, align_bytes=align)
        self._decode_pool = ShmPool(
            f"{self._prefix}-decode", self.decode_layout.region_sizes, align_bytes=align
        )
        if self.preallocate:
            for pool in [*self._stage_pools.values(), self._decode_pool]:
                _preallocate(pool)

    def _plan_processes(self) -> None:
        work = self.work_dir
        assert work is not None  # set by start()
        self._port_holds = _hold_ports(1 + len(self.groups) + len(self.spares))
        ports = [int(s.getsockname()[1]) for s in self._port_holds]
        names = ["decode", *(f"prefill-{i}" for i in range(len(self.groups)))]
        names += [f"spare-{i}" for i in range(len(self.spares))]
        for name, port, ranks in zip(names, ports, [(0,), *self.groups, *self.spares]):
            proc = ServiceProcess(
                name=name,
                role="decode" if name == "decode" else "prefill",
                ranks=tuple(ranks),
                url=f"http://{HOST}:{port}",
                config_path=work / f"{name}.toml",
                log_path=work / f"{name}.log",
            )
            self.processes.append(proc)
        prefill_urls = self.prefill_urls
        for proc, port in zip(self.processes, ports):
            proc.config_path.write_text(_to_toml(self._config_table(proc, port, prefill_urls)))
            load_config(proc.config_path, {})  # a mistake here is ours: fail with its key path

    def _config_table(self, proc: ServiceProcess, port: int, prefill: list[str]) -> dict[str, Any]:
        server = {
            "host": HOST,
            "port": port,
            "token": self.token,
            "log_level": self.log_level,
            "state_dir": str(proc.config_path.parent / f"{proc.name}-state"),
        }
        num_pages, num_slots = self._sizes[proc.role]
        pools = (
            {0: self.decode_pool}
            if proc.role == "decode"
            else {r: self.stage_pool(r) for r in proc.ranks}
        )
        stages = [
            {
                "pp_rank": r,
                "pp_size": 1 if proc.role == "decode" else self.pp_size,
                "num_pages": num_pages,
                "num_slots": num_slots,
                "pool": f"shm:{pool.name}",
            }
            for r, pool in pools.items()
        ]
        return {
            "role": proc.role,
            "server": server,
            "transport": msgspec.to_builtins(self.transport),
            "model": self._model_table,
            "handoff": msgspec.to_builtins(self.handoff),
            "transfer": msgspec.to_builtins(self.transfer),
            "peers": {"prefill": prefill} if proc.role == "decode" else {},
            "webhooks": msgspec.to_builtins(self.webhooks),
            "records": msgspec.to_builtins(self.records),
            "stages": stages,
        }

    def _launch(self, proc: ServiceProcess, *, append: bool = False) -> None:
        # The kernel's parent-death signal follows the thread that forked: only from the main
        # thread does it mean "the harness died" rather than "a worker thread ended".
        watch = os.getpid() if threading.current_thread() is threading.main_thread() else 0
        cmd = [sys.executable, "-c", _BOOT, str(watch), "serve", "--config", str(proc.config_path)]
        with proc.log_path.open("ab" if append else "wb") as log:
            # Same session as ours, so a terminal's Ctrl-C reaches the services too; close()
            # stops whatever is left either way.
            proc.popen = subprocess.Popen(
                cmd,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=self._env,
                cwd=self.work_dir,
            )

    def _wait_ready(self, processes: list[ServiceProcess] | None = None) -> None:
        deadline = time.monotonic() + self.ready_timeout_s
        waiting = list(self.processes if processes is None else processes)
        while waiting:
            for proc in list(waiting):
                assert proc.popen is not None
                code = proc.popen.poll()
                if code is not None:
                    raise DeploymentError(
                        f"{proc.name} exited with status {code} before it was ready; "
                        f"log {proc.log_path}:\n{proc.log_tail()}"
                    )
                if _ready(proc.url):
                    waiting.remove(proc)
            if waiting and time.monotonic() > deadline:
                proc = waiting[0]
                raise DeploymentError(
                    f"{proc.name} ({proc.url}) not ready after {self.ready_timeout_s:.0f} s; "
                    f"log {proc.log_path}:\n{proc.log_tail()}"
                )
            if waiting:
                time.sleep(0.05)

    # -- what tests and the demo use -----------------------------------------------------------

    @property
    def pp_size(self) -> int:
        return len(self.stage_layouts)

    @property
    def decode_url(self) -> str:
        return self.process("decode").url

    @property
    def prefill_urls(self) -> list[str]:
        return [p.url for p in self.processes if p.name.startswith("prefill-")]

    @property
    def spare_urls(self) -> list[str]:
        return [p.url for p in self.processes if p.name.startswith("spare-")]

    def url_of_stage(self, pp_rank: int) -> str:
        """The URL of the prefill process hosting `pp_rank`."""
        return self._stage_process(pp_rank).url

    def stage_pool(self, pp_rank: int) -> ShmPool:
        """This process's mapping of stage `pp_rank`'s pool (region i = layout entry i)."""
        return self._stage_pools[pp_rank]

    @property
    def decode_pool(self) -> ShmPool:
        if self._decode_pool is None:
            raise RuntimeError("the deployment has not been started")
        return self._decode_pool

    def process(self, name: str) -> ServiceProcess:
        for proc in self.processes:
            if proc.name == name:
                return proc
        raise KeyError(f"no process {name!r}; have {[p.name for p in self.processes]}")

    def _stage_process(self, pp_rank: int) -> ServiceProcess:
        for proc in self.processes:
            if proc.name.startswith("prefill-") and pp_rank in proc.ranks:
                return proc
        raise KeyError(f"no prefill process hosts pp_rank {pp_rank}")

    def planned_blocks(
        self,
        decode: StageLayout,
        moves: Iterable[tuple[Pages, Pages, int | None, int | None]],
    ) -> Blocks:
        """The blocks the services move for `moves` — (src_pages, dst_pages, src_slot, dst_slot)
        per request — planned with the same pairing from this process's mapping of the source
        pools into `decode` (the placed layout the decode service publishes). Baselines write
        exactly these with the raw engine."""
        return Blocks.concat(self.stage_blocks(decode, moves))

    def stage_blocks(
        self,
        decode: StageLayout,
        moves: Iterable[tuple[Pages, Pages, int | None, int | None]],
    ) -> list[Blocks]:
        """`planned_blocks` split by the stage that moves them (index = PP rank)."""
        cache = PairingCache()
        moves = list(moves)
        out = []
        for r, layout in self.stage_layouts.items():
            pairing = cache.get(layout.place(self.stage_pool(r).bases), decode)
            out.append(
                Blocks.concat(
                    [plan(pairing, src, dst, ss, ds).blocks for src, dst, ss, ds in moves]
                )
            )
        return out

    def kill(
        self, target: int | str, sig: int = signal.SIGKILL, *, wait_s: float | None = 5.0
    ) -> ServiceProcess:
        """Signal a process, named (`"decode"`, `"prefill-1"`) or by a PP rank it hosts (an
        int), and wait up to `wait_s` for it to exit (None: do not wait, e.g. for SIGSTOP)."""
        proc = self._stage_process(target) if isinstance(target, int) else self.process(target)
        if proc.running:
            assert proc.popen is not None
            proc.popen.send_signal(sig)
            if wait_s is not None:
                proc.popen.wait(wait_s)
        return proc

    def restart(self, name: str) -> ServiceProcess:
        """Start a process that exited (e.g. after `kill`) again: same config, port, pools and
        state directory (its log is appended to), and wait until it is ready."""
        proc = self.process(name)
        if proc.running:
            raise RuntimeError(f"{name} is still running")
        with proc.log_path.open("ab") as log:
            log.write(b"\n--- restarted ---\n")
        self._launch(proc, append=True)
        self._wait_ready([proc])
        return proc

    # -- stop -------------------------------------------------------------------------------

    def close(self, grace_s: float = 5.0) -> None:
        """SIGTERM every process still running, SIGKILL what is left after `grace_s`, unlink the
        pool files and remove a work dir this deployment made. Safe to call twice."""
        if self._closed:
            return
        try:
            _stop_all([p.popen for p in self.processes if p.popen is not None], grace_s)
        finally:
            for pool in [*self._stage_pools.values(), *filter(None, [self._decode_pool])]:
                pool.close()
            for hold in self._port_holds:
                hold.close()
            if self._made_dir is not None:
                shutil.rmtree(self._made_dir, ignore_errors=True)
        # Only now: a second Ctrl-C that cut the stop short leaves the atexit call to finish it.
        self._closed = True
        atexit.unregister(self.close)

    def __enter__(self) -> LocalDeployment:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


def _stop_all(popens: list[subprocess.Popen[bytes]], grace_s: float) -> None:
    running = [p for p in popens if p.poll() is None]
    for p in running:
        p.terminate()
    deadline = time.monotonic() + grace_s
    for p in running:
        try:
            p.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def _preallocate(pool: ShmPool) -> None:
    """Allocate the memory of `pool`'s file now. A /dev/shm file is sparse: its pages are
    allocated when first touched, and when that first touch is a Mooncake server's `recv` into
    a landed or written page while the host is short of memory, the kernel cannot fault the page
    in and the receive fails with EFAULT ("ServerSession::readBody failed ... Bad address"), the
    server drops the connection and the writer's batch fails ("WRITE rejected by server",
    connection reset) — after stalling in reclaim. Benchmarks preallocate, so a shortage fails
    the start with ENOMEM/ENOSPC here instead, and no timed transfer pays for page allocation."""
    fd = os.open(pool.path, os.O_RDWR)
    try:
        os.posix_fallocate(fd, 0, pool.nbytes)
    except OSError as exc:
        raise DeploymentError(
            f"cannot allocate {pool.nbytes / 2**20:.0f} MiB for the pool {pool.path}: {exc}"
        ) from exc
    finally:
        os.close(fd)


def _sweep_stale_pools() -> None:
    """Unlink pool files left by harnesses that died without closing (SIGKILL): they are named
    after a pid that no longer runs, and would otherwise hold their memory until reboot."""
    for name in os.listdir(SHM_DIR):
        m = _POOL_NAME.match(name)
        if m is None:
            continue
        try:
            os.kill(int(m["pid"]), 0)
        except ProcessLookupError:
            with contextlib.suppress(OSError):  # gone meanwhile, or not ours to remove
                os.unlink(os.path.join(SHM_DIR, name))
        except PermissionError:  # alive, someone else's
            pass


def _hold_ports(n: int) -> list[socket.socket]:
    """`n` distinct loopback ports, each held until `close()` by a socket bound to it that never
    listens. A port picked, released and bound by the service later could be taken meanwhile by
    any program on the machine (an outgoing connection's ephemeral port included): the service
    then failed to start, or the readiness wait found another service's `/readyz` there. Held,
    the port is the service's alone: nothing else can bind it or pick it, connections to it are
    refused while the service is down (before start, after a kill), and the service binds it
    beside the holder (both set SO_REUSEADDR, as aiohttp does on Linux; only one listens)."""
    holds = []
    try:
        for _ in range(n):
            hold = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            holds.append(hold)
            hold.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            hold.bind((HOST, 0))
    except BaseException:
        for hold in holds:
            hold.close()
        raise
    return holds


def _ready(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/readyz", timeout=1.0) as resp:
            return bool(resp.status == 200)
    except (urllib.error.URLError, OSError):  # refused, 503 (HTTPError), reset while starting
        return False


def _to_toml(table: Mapping[str, Any]) -> str:
    """TOML for the config tree: top-level scalars, then tables and arrays of tables. None
    values are left out (TOML has no null; every such key defaults to None)."""
    head, body = [], []
    for key, value in table.items():
        if isinstance(value, Mapping):
            body += ["", f"[{key}]", *_pairs(value)]
        elif isinstance(value, list) and value and isinstance(value[0], Mapping):
            for item in value:
                body += ["", f"[[{key}]]", *_pairs(item)]
        elif value is not None:
            head.append(f"{key} = {_toml_value(value)}")
    return "\n".join(head + body) + "\n"


def _pairs(table: Mapping[str, Any]) -> list[str]:
    return [f"{k} = {_toml_value(v)}" for k, v in table.items() if v is not None]


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)  # a JSON string is a valid TOML basic string
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    if isinstance(value, Mapping):
        pairs = (f"{json.dumps(k)} = {_toml_value(v)}" for k, v in value.items())
        return "{" + ", ".join(pairs) + "}"
    raise TypeError(f"cannot write {type(value).__name__} to TOML")
