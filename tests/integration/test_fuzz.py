"""Schemathesis against a live deployment: decode + PP=2 prefill as real processes (Mooncake
TCP, shm pools), every check on, zero failures, at least 1,000 generated cases per run.

The run is the `st` command line over each service's own `/openapi.json`, with the hooks and
settings in tests/fuzz/. `KVHANDOFF_FUZZ_EXAMPLES` (cases per operation and phase, default 30)
and `KVHANDOFF_FUZZ_SEED` (default fixed, so CI runs are reproducible; "random" for a new one)
let `make fuzz` run a longer pass. The one check left out is `use_after_free`, whose premise (a
2xx DELETE removes the resource) is not this API's: DELETE aborts, and the handoff's record stays
readable in its terminal state (tests/fuzz/schemathesis.toml).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvhandoff.service.testing.deployment import LocalDeployment

# Each pass may take up to its own 600 s bound (`run_schemathesis`); a busy machine stretches
# them far past the suite's 180 s default, which must not cut a passing run short.
pytestmark = [pytest.mark.integration, pytest.mark.timeout(2 * 600 + 120)]

ROOT = Path(__file__).resolve().parents[2]
FUZZ = ROOT / "tests" / "fuzz"
TOKEN, PEER = "fuzz-router-and-engine", "fuzz-peer"
EXAMPLES = int(os.environ.get("KVHANDOFF_FUZZ_EXAMPLES", "30"))
SEED = os.environ.get("KVHANDOFF_FUZZ_SEED", "20261201")
MIN_CASES = 1000
_SUMMARY = re.compile(r"(\d+) generated")
_FAILED = re.compile(r"(\d+) found|(\d+) errored")


@pytest.fixture(scope="module")
def dep() -> Iterator[LocalDeployment]:
    # Router and engine share server.token (both fall back on it); the peer secret is apart, so
    # peer routes answer the fuzzer's bearer token with 403, as documented.
    env = {"KVHANDOFF_SERVER__TOKEN": TOKEN, "KVHANDOFF_AUTH__PEER": PEER}
    with LocalDeployment(
        preset="hybrid-npu-mla",
        model={"scale": 64, "page_size": 16, "num_layers": 16},
        pp_size=2,
        num_pages=64,
        num_slots=8,
        env=env,
    ) as deployment:
        yield deployment


def run_schemathesis(
    dep: LocalDeployment,
    url: str,
    workdir: Path,
    *,
    examples: int = EXAMPLES,
    seed: str = SEED,
    token: str = TOKEN,
) -> tuple[int, str]:
    """One schemathesis pass over the service at `url` (exit status, output); also used by
    `tests/reliability.py`. schemathesis leaves its cache in `workdir`."""
    command = [
        str(Path(sys.executable).parent / "st"),
        "--config-file",
        str(FUZZ / "schemathesis.toml"),
        "run",
        f"{url}/openapi.json",
        "--checks",
        "all",
        "--exclude-checks",
        "use_after_free",
        "--max-examples",
        str(examples),
        "--workers",
        "1",
        "--no-color",
    ]
    if seed != "random":
        command += ["--seed", seed]
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "SCHEMATHESIS_HOOKS": "tests.fuzz.hooks",
        "KVHANDOFF_FUZZ_TOKEN": token,
        "KVHANDOFF_FUZZ_DECODE": dep.decode_url,
        "KVHANDOFF_FUZZ_PREFILL": ",".join(dep.prefill_urls),
    }
    done = subprocess.run(
        command,
        cwd=workdir,
        env=env,
        capture_output=True,
        text=True,
        timeout=max(600, 20 * examples),
        check=False,
    )
    output = done.stdout + done.stderr
    return done.returncode, output


def test_schemathesis_finds_nothing(dep: LocalDeployment, tmp_path: Path) -> None:
    generated = 0
    for url in (dep.decode_url, dep.prefill_urls[0]):
        code, output = run_schemathesis(dep, url, tmp_path)
        tail = output[-6000:]
        assert code == 0, tail
        summary = _SUMMARY.findall(output)
        assert summary, tail
        assert not _FAILED.search(output.rsplit("Test cases:", 1)[-1]), tail
        generated += int(summary[-1])
    assert generated >= MIN_CASES, generated
    # Every service survived the run and still answers.
    for proc in dep.processes:
        assert proc.running, proc.log_tail()
