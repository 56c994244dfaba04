"""`kvhandoff demo` end to end, and the `LocalDeployment` harness it runs on: PP hybrid NPU-MLA
prefill processes into one decode process over Mooncake TCP, every byte checked."""

from __future__ import annotations

import glob
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvhandoff.service.config import HandoffConfig
from kvhandoff.service.testing.deployment import DeploymentError, LocalDeployment

DeploymentFactory = Callable[..., LocalDeployment]  # the `deployment` fixture (conftest.py)

pytestmark = pytest.mark.integration
DEMO = [sys.executable, "-m", "kvhandoff.service.cli", "demo"]


def _demo(*flags: str) -> dict[str, Any]:
    out = subprocess.run([*DEMO, *flags], capture_output=True, text=True, timeout=150)
    assert out.returncode == 0, out.stderr[-2000:]
    summary: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    return summary


def _large_and_small(summary: dict[str, Any], bulk: int, small: int) -> dict[str, Any]:
    """The data plane's figures, after checking both workloads verified every handoff and the
    large ones are the large ones."""
    data: dict[str, Any] = summary["data_plane"]
    assert summary["completed"] == summary["verified"] == small
    assert data["completed"] == data["verified"] == bulk
    assert summary["failed"] == data["failed"] == 0 and not summary["errors"] + data["errors"]
    # --bulk-scale 1 against --scale 64: each large handoff moves many times a small one's bytes.
    assert data["bytes_per_handoff"] > 4 * summary["bytes_per_handoff"] > 0
    assert data["gb_per_s"] > 0 and summary["handoffs_per_s"] > 0
    return data


@pytest.mark.parametrize("transport", ["local", "mooncake"])
def test_inprocess_demo_completes_and_verifies_every_byte(transport: str) -> None:
    flags = ["--requests", "12", "--concurrency", "4", "--bulk", "2", "--verify-digests", "--json"]
    summary = _demo("--inprocess", "--transport", transport, *flags)
    assert summary["mode"] == "inprocess"
    _large_and_small(summary, bulk=2, small=12)


def test_multiprocess_demo_completes_and_verifies_every_byte() -> None:
    summary = _demo(
        "--requests", "12", "--concurrency", "4", "--bulk", "3", "--verify-digests",
        "--baseline", "--json",
    )  # fmt: skip
    assert summary["mode"] == "multiprocess" and summary["transport"] == "mooncake"
    data = _large_and_small(summary, bulk=3, small=12)
    # The raw engine rewrote exactly the large handoffs' blocks and was timed; direct mode moved
    # the same requests.
    assert data["raw_blocks"] > 0 and data["raw_mooncake_gb_per_s"] > 0
    assert data["vs_raw"] == pytest.approx(data["gb_per_s"] / data["raw_mooncake_gb_per_s"])
    assert data["vs_direct"] == pytest.approx(data["gb_per_s"] / data["direct_gb_per_s"])


def test_the_summary_leads_with_the_data_plane_and_the_control_plane() -> None:
    out = subprocess.run(
        [*DEMO, "--inprocess", "--transport", "local", "--requests", "6", "--bulk", "2"],
        capture_output=True, text=True, timeout=150,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    lines = out.stdout.splitlines()
    assert lines[0].startswith("kvhandoff demo: PP=4 hybrid NPU-MLA -> decode over local")
    assert lines[1].split()[:4] == ["data", "plane", lines[1].split()[2], "GB/s"]
    assert "2 handoffs of" in lines[1] and "(model bytes / 1)" in lines[1]
    assert lines[2].split()[:4] == ["control", "plane", lines[2].split()[2], "handoffs/s"]
    assert "6 handoffs of" in lines[2] and "p50" in lines[2] and "p99" in lines[2]
    assert lines[3].split()[:4] == ["verified", "8", "of", "8"]
    assert "make bench" in lines[-1]


def test_handoff_benchmark_runs_both_cases() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "kvhandoff.service.cli", "bench", "handoff", "--repeat", "1",
        "--json",
         "--cases", "bulk,small",
         "--bulk-requests", "2", "--bulk-pages", "8", "--bulk-concurrency", "2",
         "--small-requests", "100", "--small-concurrency", "8"],
        capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    bulk, small = json.loads(out.stdout.strip().splitlines()[-1])["handoff"]
    assert min(bulk["landed_gb_s"], bulk["direct_gb_s"], bulk["raw_large_gb_s"]) > 0
    assert bulk["landed_vs_direct"] == pytest.approx(bulk["landed_gb_s"] / bulk["direct_gb_s"])
    assert bulk["commit_share"] > 0  # the decode's commits were timed
    assert bulk["bytes_per_request"] > 0 and small["handoffs_per_s"] > 0


def _children(pid: int) -> list[int]:
    """Processes whose parent is `pid` (from /proc, field 4 of stat)."""
    out = []
    for stat in glob.glob("/proc/[0-9]*/stat"):
        try:
            with open(stat) as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:  # exited while we looked
            continue
        if int(fields[1]) == pid:
            out.append(int(stat.split("/")[2]))
    return out


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_serve_prints_its_urls_and_cleans_up_on_a_signal(sig: int) -> None:
    proc = subprocess.Popen(
        [*DEMO, "--requests", "4", "--concurrency", "2", "--bulk", "0", "--serve", "--json"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        summary = json.loads(proc.stdout.readline())
        info = json.loads(proc.stdout.readline())
        assert summary["verified"] == 4
        assert set(info) == {"decode", "prefill", "stages", "openapi", "dashboard", "metrics"}
        with urllib.request.urlopen(info["dashboard"], timeout=10) as page:
            assert page.headers["Content-Type"].startswith("text/html")
        with urllib.request.urlopen(info["metrics"], timeout=10) as metrics:
            assert b"kvhandoff_handoffs_finished_total" in metrics.read()
        assert sorted(info["stages"]) == ["0", "1", "2", "3"]
        assert sorted(info["stages"].values()) == sorted(info["prefill"])
        for url in [info["decode"], *info["prefill"]]:
            assert _get(f"{url}/readyz")[0] == 200
        assert _get(info["openapi"])[0] == 200
        children = _children(proc.pid)
        shm = glob.glob(f"/dev/shm/kvh-{proc.pid}-*")
        assert len(children) == 5 and len(shm) == 5  # decode + 4 stages

        proc.send_signal(sig)
        assert proc.wait(30) == 0, proc.stderr.read() if proc.stderr else ""
        assert not [pid for pid in children if _alive(pid)]
        assert not glob.glob(f"/dev/shm/kvh-{proc.pid}-*")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


# ---------------------------------------------------------------------------------------------
# The harness on its own, over the services' HTTP API


def _get(url: str) -> tuple[int, Any]:
    return _call("GET", url)


def _call(method: str, url: str, body: Any = None) -> tuple[int, Any]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(
        url, data=data, method=method, headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status, json.loads(resp.read() or b"null")
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"null")


def _entry_rows(dep: LocalDeployment, pp_rank: int | None) -> dict[tuple[int, str], np.ndarray]:
    """Every entry of a stage (None: decode) as rows (pages or slots) x bytes, keyed by
    (layer, group or kind)."""
    layout = dep.decode_layout if pp_rank is None else dep.stage_layouts[pp_rank]
    pool = dep.decode_pool if pp_rank is None else dep.stage_pool(pp_rank)
    out = {}
    for i, e in enumerate(layout.kv):
        out[(e.layer_id, str(e.group))] = pool.view(i)[: e.nbytes].reshape(e.num_items, -1)
    for j, s in enumerate(layout.state):
        rows = pool.view(len(layout.kv) + j)[: s.num_slots * s.item_len]
        out[(s.layer_id, s.kind)] = rows.reshape(s.num_slots, -1)
    return out


def test_stages_grouped_into_processes_hand_off_every_layer(deployment: DeploymentFactory) -> None:
    dep = deployment(pp_size=4, groups=[[0, 1], [2, 3]])
    assert len(dep.prefill_urls) == 2
    assert dep.url_of_stage(0) == dep.url_of_stage(1) != dep.url_of_stage(2)
    rng = np.random.default_rng(7)
    for r in range(4):
        for i in range(len(dep.stage_layouts[r].region_sizes)):
            view = dep.stage_pool(r).view(i)
            view[:] = rng.integers(0, 256, view.shape[0], dtype=np.uint8)
    src_pages, dst_pages, src_slot, dst_slot = [9, 2, 3, 40], [5, 6, 7, 1], 3, 6
    status, view = _call(
        "POST",
        f"{dep.decode_url}/v1/handoffs",
        {
            "id": "grouped",
            "prefill": dep.prefill_urls,
            "dst_pages": dst_pages,
            "dst_slot": dst_slot,
        },
    )
    assert status == 201, view
    for r in range(4):
        url = f"{dep.url_of_stage(r)}/v1/handoffs/grouped/stages/{r}/ready"
        status, ack = _call("POST", url, {"src_pages": src_pages, "src_slot": src_slot})
        assert status == 202, ack
    status, view = _get(f"{dep.decode_url}/v1/handoffs/grouped?wait_s=20")
    assert view["state"] == "completed", view
    decode = _entry_rows(dep, None)
    landed = set()
    for r in range(4):
        for key, rows in _entry_rows(dep, r).items():
            src, dst = (src_slot, dst_slot) if not key[1].isdigit() else (src_pages, dst_pages)
            np.testing.assert_array_equal(decode[key][dst], rows[src], err_msg=f"{key}")
            landed.add(key)
    assert landed == set(decode)  # every decode entry was some stage's


def test_a_killed_stage_fails_its_handoff_within_the_peer_timeout(
    deployment: DeploymentFactory,
) -> None:
    dep = deployment(pp_size=2, handoff=HandoffConfig(heartbeat_interval_s=0.2, peer_timeout_s=1.0))
    status, view = _call(
        "POST",
        f"{dep.decode_url}/v1/handoffs",
        {"id": "doomed", "prefill": dep.prefill_urls, "dst_pages": [1, 2], "dst_slot": 0},
    )
    assert status == 201, view
    url = f"{dep.url_of_stage(0)}/v1/handoffs/doomed/stages/0/ready"
    assert _call("POST", url, {"src_pages": [3, 4], "src_slot": 1})[0] == 202
    killed = dep.kill(1)
    assert not killed.running and killed.popen is not None and killed.popen.returncode == -9
    t0 = time.monotonic()
    status, view = _get(f"{dep.decode_url}/v1/handoffs/doomed?wait_s=20")
    assert view["state"] == "failed", view
    assert time.monotonic() - t0 < 10  # the peer timeout, not the 30 s deadline
    assert dep.process("decode").running and dep.process("prefill-0").running


def test_a_service_that_cannot_start_is_reported_with_its_log_and_cleaned_up(
    tmp_path: Path,
) -> None:
    dep = LocalDeployment(
        work_dir=tmp_path,
        model={"scale": 64, "num_layers": 8},
        pp_size=2,
        num_pages=16,
        num_slots=2,
        env={"KVHANDOFF_SERVER__BOGUS": "1"},
    )
    with pytest.raises(DeploymentError, match=r"unknown key 'server\.bogus'"):
        dep.start()
    assert not [p for p in dep.processes if p.running]
    assert not glob.glob(f"/dev/shm/{dep.decode_pool.name.rsplit('-', 1)[0]}-*")
    assert (tmp_path / "decode.log").exists()  # kept: the error points at it


def test_close_stops_every_process_and_removes_the_pools(deployment: DeploymentFactory) -> None:
    dep = deployment(pp_size=2, groups=[[0, 1]])
    names = [dep.decode_pool.name, dep.stage_pool(0).name, dep.stage_pool(1).name]
    assert all(os.path.exists(f"/dev/shm/{n}") for n in names)
    assert [p.name for p in dep.processes] == ["decode", "prefill-0"]
    work_dir = dep.work_dir
    dep.close()
    dep.close()  # idempotent
    assert not [p for p in dep.processes if p.running]
    assert not [n for n in names if os.path.exists(f"/dev/shm/{n}")]
    assert work_dir is not None and not work_dir.exists()


_HARNESS = """\
import json, sys, time
from kvhandoff.service.testing.deployment import LocalDeployment
model = {"scale": 64, "num_layers": 8}
dep = LocalDeployment(model=model, pp_size=2, num_pages=16, num_slots=2, work_dir=sys.argv[1])
dep.start()
pools = [dep.decode_pool.name, dep.stage_pool(0).name, dep.stage_pool(1).name]
print(json.dumps({"pids": [p.popen.pid for p in dep.processes], "pools": pools}), flush=True)
time.sleep(120)
"""


def _alive(pid: int) -> bool:
    """Running, and not a zombie waiting for a reaper."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_nothing_outlives_a_harness_killed_without_closing(
    deployment: DeploymentFactory, tmp_path: Path
) -> None:
    harness = subprocess.Popen(
        [sys.executable, "-c", _HARNESS, str(tmp_path)], stdout=subprocess.PIPE, text=True
    )
    assert harness.stdout is not None
    info = json.loads(harness.stdout.readline())
    harness.kill()  # no finally, no atexit
    harness.wait()
    deadline = time.monotonic() + 10
    while any(_alive(pid) for pid in info["pids"]):
        assert time.monotonic() < deadline, "services outlived their harness"
        time.sleep(0.1)
    # The next harness to start unlinks the pool files of a dead one (one started by another
    # test session meanwhile may already have: so no check that they are still there).
    deployment(pp_size=1)
    assert not [name for name in info["pools"] if os.path.exists(f"/dev/shm/{name}")]
