"""The benchmarks' CPU accounting (`kvhandoff.service.tools.bench.cpu`) against real processes."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator

import pytest

from kvhandoff.service.tools.bench.cpu import CpuMeter, cpu_figures, process_cpu_s, thread_cpu_s
from kvhandoff.transport.mooncake import WORKER_NICE

# A child that, on each line read, spins for that many seconds in its main thread ("main") or
# in a thread at the transport workers' niceness ("nice"), then answers.
_CHILD = f"""
import os, sys, threading, time

def spin(seconds):
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass

def niced(seconds, done):
    os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), {WORKER_NICE})
    spin(seconds)
    done.set()
    threading.Event().wait()  # stays alive, idle, as a transport worker between calls

for line in sys.stdin:
    where, seconds = line.split()
    if where == "main":
        spin(float(seconds))
    else:
        done = threading.Event()
        threading.Thread(target=niced, args=(float(seconds), done), daemon=True).start()
        done.wait()
    print("done", flush=True)
"""


@pytest.fixture
def child() -> Iterator[subprocess.Popen[str]]:
    proc = subprocess.Popen(
        [sys.executable, "-c", _CHILD], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        yield proc
    finally:
        proc.kill()
        proc.wait()


def _spin(proc: subprocess.Popen[str], where: str, seconds: float) -> None:
    assert proc.stdin is not None and proc.stdout is not None
    proc.stdin.write(f"{where} {seconds}\n")
    proc.stdin.flush()
    assert proc.stdout.readline().strip() == "done"


def test_a_process_is_charged_the_cpu_it_spent_between_start_and_stop(
    child: subprocess.Popen[str],
) -> None:
    meter = CpuMeter({"child": child.pid})
    _spin(child, "main", 0.1)  # before the span: not counted
    meter.start()
    _spin(child, "main", 0.3)
    meter.stop()
    time.sleep(0.05)
    assert 0.25 <= meter.seconds["child"] <= 0.45
    assert meter.by_kind["child"]["main"] == pytest.approx(meter.seconds["child"], abs=0.05)
    assert meter.wall_s >= 0.3


def test_a_thread_at_the_transport_workers_niceness_is_a_transport_call(
    child: subprocess.Popen[str],
) -> None:
    meter = CpuMeter({"child": child.pid})
    meter.start()
    _spin(child, "nice", 0.3)
    meter.stop()
    assert meter.seconds["child"] >= 0.25
    assert meter.by_kind["child"]["mooncake-call"] >= 0.25
    assert meter.by_kind["child"]["main"] < 0.1
    kinds = sorted(kind for kind, _ in thread_cpu_s(child.pid).values())
    assert kinds == ["main", "mooncake-call"]


def test_a_process_gone_reads_zero_and_no_thread() -> None:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    assert process_cpu_s(proc.pid) == 0.0
    assert thread_cpu_s(proc.pid) == {}


def test_figures_are_seconds_per_gb_by_side_and_thread_kind() -> None:
    meters = {kind: CpuMeter({}) for kind in ("raw", "landed", "direct")}
    for kind, decode, senders in (("raw", 0.1, 0.7), ("landed", 0.3, 0.8), ("direct", 0.2, 0.6)):
        m = meters[kind]
        names = ["decode", "raw-0" if kind == "raw" else "prefill-0"]
        m.pids = dict.fromkeys(names, 0)
        m.seconds = {names[0]: decode, names[1]: senders}
        m.by_kind = {names[0]: {"main": decode}, names[1]: {"worker": senders}}
        m.wall_s = 0.5
    # Two runs of 0.5 GB each: 1 GB per meter.
    got = cpu_figures(meters, dict.fromkeys(meters, 500_000_000), 2)
    assert got["landed_decode_cpu_s_per_gb"] == pytest.approx(0.3)
    assert got["landed_prefill_cpu_s_per_gb"] == pytest.approx(0.8)
    assert got["raw_writer_cpu_s_per_gb"] == pytest.approx(0.7)
    assert got["raw_cpu_s_per_gb"] == pytest.approx(0.8)
    assert got["direct_cpu_cores"] == pytest.approx(1.6)
    assert got["decode_cpu_landed_vs_direct"] == pytest.approx(1.5)
    assert got["cpu_threads"]["landed.prefill-0.worker"] == pytest.approx(0.8)
