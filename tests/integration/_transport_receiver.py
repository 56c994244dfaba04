"""A receiving process for the transport integration tests and the transport benchmark.

Run as a script with one JSON argument {"shm": name, "sizes": [...], "config": {...}}: creates
the shm pool, starts a Mooncake engine, registers the pool and prints one JSON line
{"target": ..., "bases": [...], "pid": ...}. It then waits for stdin to close, and unlinks the
pool on the way out. The test process maps the same /dev/shm file to check every byte.
"""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec

from kvhandoff.transport.config import MooncakeConfig
from kvhandoff.transport.mooncake import MooncakeTransport
from kvhandoff.transport.pool_shm import ShmPool


def main(spec: dict[str, Any]) -> None:
    config = msgspec.convert(spec.get("config", {}), MooncakeConfig)
    pool = ShmPool(spec["shm"], spec["sizes"], align_bytes=config.align_bytes, create=True)
    try:
        transport = MooncakeTransport.start(config)
        pool.register(transport)
        print(json.dumps({"target": transport.local_target, "bases": pool.bases}), flush=True)
        sys.stdin.read()
        pool.close()
        transport.close()
    finally:
        pool.close()


@dataclass
class Receiver:
    """Handle on a receiver process started by `spawn`."""

    proc: subprocess.Popen[str]
    target: str
    bases: list[int]

    def stop(self) -> None:
        if self.proc.poll() is None:
            assert self.proc.stdin is not None
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def spawn(shm: str, sizes: list[int], config: dict[str, Any] | None = None) -> Receiver:
    """Start a receiver and wait for its target name and region bases."""
    spec = json.dumps({"shm": shm, "sizes": sizes, "config": config or {}})
    proc = subprocess.Popen(
        [sys.executable, str(Path(__file__).resolve()), spec],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if not line:
        proc.wait()
        raise RuntimeError(f"receiver exited with {proc.returncode} before announcing itself")
    hello = json.loads(line)
    return Receiver(proc, hello["target"], [int(b) for b in hello["bases"]])


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
