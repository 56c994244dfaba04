"""CPU seconds of benchmark processes and of their threads, from /proc: what the bulk
benchmarks charge per GB moved (`kvhandoff bench handoff --cases bulk`, `bench.e2e`).

On a host with fewer cores than busy threads the bytes are CPU bound, so a mode's throughput
against another's is about the inverse of their CPU seconds per GB; these figures say where
those seconds go. A process's own counters (`/proc/PID/stat`, utime + stime) include every
thread it ran, ended ones too; the per-thread split (`/proc/PID/task/TID/stat`) sees only the
threads alive at both readings, and names them by what they are:

- `main`: the main thread (a service's event loop: HTTP, peer messages, bookkeeping, small
  copies; a raw writer's engine call);
- `mooncake-call`: kvhandoff's transport workers (niceness `WORKER_NICE`), inside the engine's
  synchronous batch call, which busy-waits until the batch is done;
- `worker`: other threads at normal priority that kvhandoff or Python started (the gathers' and
  commits' `asyncio.to_thread` pool, the raw baseline's writer);
- anything else by its kernel name (`comm`): the transfer engine's own threads (its TCP
  sender/receiver and handshake threads).

Python 3.11 gives threads no kernel names, so `main` and `mooncake-call` are told apart from the
rest by thread id and niceness, not by name.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvhandoff.transport.mooncake import WORKER_NICE

if TYPE_CHECKING:
    from kvhandoff.service.testing.deployment import LocalDeployment

_TICK_S = 1.0 / os.sysconf("SC_CLK_TCK")


def deployment_pids(dep: LocalDeployment) -> dict[str, int]:
    """The running processes of `dep` by name (`decode`, `prefill-0`, ...)."""
    return {p.name: p.popen.pid for p in dep.processes if p.popen is not None and p.running}


def _stat_fields(path: Path) -> list[str] | None:
    """The fields of a `stat` file after the command name (which may hold spaces), or None
    when the process or thread is gone."""
    try:
        text = path.read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None
    return text.rsplit(")", 1)[1].split()


def process_cpu_s(pid: int) -> float:
    """Every thread's user + system CPU seconds of process `pid` so far (0.0 once it is gone)."""
    fields = _stat_fields(Path(f"/proc/{pid}/stat"))
    if fields is None:
        return 0.0
    return (int(fields[11]) + int(fields[12])) * _TICK_S


def thread_kind(pid: int, tid: int, comm: str, nice: int) -> str:
    """What a thread of process `pid` is, for the per-thread split (module docstring)."""
    if tid == pid:
        return "main"
    if nice == WORKER_NICE:
        return "mooncake-call"
    if comm.startswith("python"):
        return "worker"
    return comm


def thread_cpu_s(pid: int) -> dict[int, tuple[str, float]]:
    """Each live thread of process `pid`: its kind (`thread_kind`) and CPU seconds so far."""
    out: dict[int, tuple[str, float]] = {}
    task = Path(f"/proc/{pid}/task")
    try:
        tids = [int(t) for t in os.listdir(task)]
    except (FileNotFoundError, ProcessLookupError):
        return out
    for tid in tids:
        fields = _stat_fields(task / str(tid) / "stat")
        try:
            comm = (task / str(tid) / "comm").read_text().strip()
        except (FileNotFoundError, ProcessLookupError):
            continue
        if fields is None:
            continue
        seconds = (int(fields[11]) + int(fields[12])) * _TICK_S
        out[tid] = (thread_kind(pid, tid, comm, int(fields[16])), seconds)
    return out


class CpuMeter:
    """CPU seconds of named processes between `start` and `stop`, summed over every span
    measured: per process (`seconds`) and per process and thread kind (`by_kind`), beside the
    spans' wall seconds (`wall_s`)."""

    def __init__(self, pids: Mapping[str, int]) -> None:
        self.pids = dict(pids)
        self.seconds: dict[str, float] = dict.fromkeys(self.pids, 0.0)
        self.by_kind: dict[str, dict[str, float]] = {name: {} for name in self.pids}
        self.wall_s = 0.0
        self._wall0 = 0.0
        self._proc0: dict[str, float] = {}
        self._threads0: dict[str, dict[int, tuple[str, float]]] = {}

    def start(self) -> None:
        self._wall0 = time.monotonic()
        self._proc0 = {name: process_cpu_s(pid) for name, pid in self.pids.items()}
        self._threads0 = {name: thread_cpu_s(pid) for name, pid in self.pids.items()}

    def stop(self) -> None:
        self.wall_s += time.monotonic() - self._wall0
        for name, pid in self.pids.items():
            self.seconds[name] += process_cpu_s(pid) - self._proc0[name]
            before = self._threads0[name]
            kinds = self.by_kind[name]
            for tid, (kind, seconds) in thread_cpu_s(pid).items():
                spent = seconds - before.get(tid, (kind, 0.0))[1]
                kinds[kind] = kinds.get(kind, 0.0) + spent

    def total(self, names: list[str] | None = None) -> float:
        """The CPU seconds of `names` (default: every process) over the spans measured."""
        return sum(self.seconds[n] for n in (self.pids if names is None else names))


def run_meters(
    deps: Mapping[str, LocalDeployment], raw_pids: Mapping[str, int]
) -> dict[str, CpuMeter]:
    """A meter per kind of run: each deployment's processes (by mode), and the raw writers
    with the decode they write into (`raw`: the direct deployment's, whose KV memory they
    write)."""
    meters = {mode: CpuMeter(deployment_pids(dep)) for mode, dep in deps.items()}
    meters["raw"] = CpuMeter({**raw_pids, "decode": deployment_pids(deps["direct"])["decode"]})
    return meters


def cpu_figures(
    meters: Mapping[str, CpuMeter], bytes_per_run: Mapping[str, int], runs: int
) -> dict[str, Any]:
    """CPU seconds per GB of the runs each meter measured (`runs` runs of
    `bytes_per_run[kind]` bytes each): for `landed` and `direct`, their decode, their prefills
    together and all; for `raw`, its writers, its receiving decode and all; the cores each kept
    busy; the decode's landed against direct; and `cpu_threads`, every process's thread kinds,
    as `kind.process.thread`."""
    out: dict[str, Any] = {}
    threads: dict[str, float] = {}
    for kind, meter in meters.items():
        gb = bytes_per_run[kind] * runs / 1e9
        senders = [n for n in meter.pids if n != "decode"]
        side = "writer" if kind.startswith("raw") else "prefill"
        out[f"{kind}_decode_cpu_s_per_gb"] = meter.seconds["decode"] / gb
        out[f"{kind}_{side}_cpu_s_per_gb"] = meter.total(senders) / gb
        out[f"{kind}_cpu_s_per_gb"] = meter.total() / gb
        # Cores these processes kept busy on average: near the host's count, the run was CPU
        # bound and its GB/s is about cores / (CPU s per GB).
        out[f"{kind}_cpu_cores"] = meter.total() / meter.wall_s if meter.wall_s else 0.0
        for name in meter.pids:
            for thread, seconds in sorted(meter.by_kind[name].items()):
                threads[f"{kind}.{name}.{thread}"] = seconds / gb
    out["decode_cpu_landed_vs_direct"] = (
        out["landed_decode_cpu_s_per_gb"] / out["direct_decode_cpu_s_per_gb"]
    )
    out["cpu_threads"] = threads
    return out


def print_cpu(r: Mapping[str, Any]) -> None:
    """`cpu_figures`' figures as a few lines: per run kind, per process, per thread kind."""
    for kind in ("raw", "landed", "direct"):
        side = "writer" if kind == "raw" else "prefill"
        print(
            f"  CPU s per GB, {kind} ({r[f'{kind}_cpu_cores']:.2f} cores busy): "
            f"all {r[f'{kind}_cpu_s_per_gb']:.3f}, decode "
            f"{r[f'{kind}_decode_cpu_s_per_gb']:.3f}, "
            f"{side}s {r[f'{kind}_{side}_cpu_s_per_gb']:.3f}"
        )
        parts = [
            (k.split(".", 1)[1], v) for k, v in r["cpu_threads"].items() if k.startswith(f"{kind}.")
        ]
        print("    " + ", ".join(f"{name} {v:.3f}" for name, v in parts))
