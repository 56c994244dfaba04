"""The Makefile's apt steps (issue 18 D): they wait for a lock another apt holds instead of
failing, and the test tools install no Prometheus server. Run against a fake `apt-get` on PATH,
so nothing is installed and no lock of this machine is touched."""

from __future__ import annotations

import os
import shutil
import subprocess
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
MAKEFILE = ROOT / "Makefile"
LOCKED = "E: Could not get lock /var/lib/apt/lists/lock. It is held by process 4242 (apt-get)"

pytestmark = pytest.mark.skipif(shutil.which("make") is None, reason="needs make")


def fake_apt(tmp_path: Path, locked_for: int, failure: str = LOCKED) -> Path:
    """An `apt-get` that fails with `failure` on its first `locked_for` calls, then succeeds;
    each call is counted in `calls`."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    script = bin_dir / "apt-get"
    script.write_text(
        textwrap.dedent(
            f"""\
            #!/bin/sh
            echo "$*" >> {tmp_path}/calls
            n=$(wc -l < {tmp_path}/calls)
            if [ "$n" -le {locked_for} ]; then echo "{failure}" >&2; exit 100; fi
            exit 0
            """
        )
    )
    script.chmod(0o755)
    return bin_dir


def apt_lists(tmp_path: Path, bin_dir: Path, timeout_s: int) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["make", "-s", "-f", str(MAKEFILE), "apt-lists", "SUDO=", "APT_RETRY_S=1",
         f"APT_LOCK_TIMEOUT_S={timeout_s}"],
        cwd=tmp_path,
        env={**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}"},
        capture_output=True,
        text=True,
        timeout=60,
    )  # fmt: skip


def calls(tmp_path: Path) -> list[str]:
    return (tmp_path / "calls").read_text().splitlines()


def test_apt_update_waits_while_another_apt_holds_the_lists_lock(tmp_path: Path) -> None:
    done = apt_lists(tmp_path, fake_apt(tmp_path, locked_for=2), timeout_s=30)
    assert done.returncode == 0, done.stderr
    assert len(calls(tmp_path)) == 3  # twice locked, then through
    assert all("-o DPkg::Lock::Timeout=30 update" in c for c in calls(tmp_path))
    assert done.stderr.count("locked by another process; waiting") == 2


def test_apt_update_gives_up_after_the_bound(tmp_path: Path) -> None:
    done = apt_lists(tmp_path, fake_apt(tmp_path, locked_for=99), timeout_s=2)
    assert done.returncode != 0
    assert LOCKED in done.stderr and len(calls(tmp_path)) == 3


def test_another_apt_failure_stops_at_once(tmp_path: Path) -> None:
    failure = "E: Failed to fetch http://deb.invalid/dists/x  Temporary failure resolving"
    done = apt_lists(tmp_path, fake_apt(tmp_path, locked_for=1, failure=failure), timeout_s=30)
    assert done.returncode != 0 and failure in done.stderr
    assert len(calls(tmp_path)) == 1


def test_every_apt_call_waits_for_locks_and_no_prometheus_server_is_installed() -> None:
    text = MAKEFILE.read_text()
    apt_lines = [line for line in text.splitlines() if "apt-get" in line and "#" not in line]
    assert apt_lines == [
        "APT_GET := $(SUDO) env DEBIAN_FRONTEND=noninteractive apt-get "
        "-o DPkg::Lock::Timeout=$(APT_LOCK_TIMEOUT_S)"
    ]  # everything else goes through APT_GET
    dry = subprocess.run(
        ["make", "-n", "-f", str(MAKEFILE), "test-tools"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    ).stdout
    installs = [line for line in dry.splitlines() if " install " in line and "apt-get" in line]
    assert installs and not any("prometheus" in line for line in installs), installs
    # promtool comes unpacked out of the package, never installed with it (which enables and
    # starts the server).
    assert "download -qq prometheus" in dry and "dpkg-deb -x prometheus_*.deb root" in dry
