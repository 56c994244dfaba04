"""`kvhandoff demo` end to end: PP=4 hybrid NPU-MLA into one decode, every byte checked."""

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.integration


@pytest.mark.parametrize("transport", ["local", "mooncake"])
def test_demo_completes_and_verifies_every_byte(transport: str) -> None:
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "service.cli",
            "demo",
            "--requests",
            "12",
            "--concurrency",
            "4",
            "--transport",
            transport,
            "--verify-digests",
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=150,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    summary = json.loads(out.stdout.strip().splitlines()[-1])
    assert summary["completed"] == summary["verified"] == 12
    assert summary["failed"] == 0 and summary["bytes"] > 0
