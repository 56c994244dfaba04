"""`python -m bench.events` runs end to end and every reader gets every frame (small sizes; the
numbers themselves are reported, not asserted: speed is never a timed test)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]


def test_events_benchmark_delivers_every_frame_to_every_reader() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "bench.events", "--subscribers", "3",
         "--events", "2000", "--json"],
        capture_output=True, text=True, timeout=120, check=False, cwd=ROOT,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["frames_delivered"] == 3 * 2000
    assert result["dropped"] == 0
    assert result["fanout_events_per_s_total"] > 0 and result["fanout_vs_bus_only"] > 0
