"""Real SGLang servers for the engine tests: started, waited on, killed.

Each server is `python -m sglang.launch_server` on SGLang's CPU path (`LAUNCH` below: the same
flags the README shows), in its own process group so a teardown or a test's SIGKILL reaches
its scheduler, detokenizer and PP/TP children too. Its output goes to a log file that a failed
start prints. The start-up timeout is a liveness bound (a 2-core machine shared with other
work), not a performance assertion. A server's environment is the caller's without any
`KVHANDOFF_*` variable (kvhandoff reads each as a config override: a caller's variable would
change, or break, every rank's settings), plus what `Server.env` names.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
STUBS = Path(__file__).resolve().parent / "stubs"
SGLANG_STUBS = ROOT / "tests" / "sglang" / "stubs"  # torchvision, as for tests/sglang
#: SGLang's CPU path with torch-native kernels, float32, prompts as token ids. An idle
#: scheduler polls its sockets in a busy loop, a whole core per server, unless it sleeps on idle
#: (measured: 0.95 CPU-seconds a second idle, 0.0 with the flag): without it the servers a
#: session keeps up starve whichever one is working or starting.
LAUNCH = [
    "--device",
    "cpu",
    "--attention-backend",
    "torch_native",
    "--sampling-backend",
    "pytorch",
    "--dtype",
    "float32",
    "--skip-tokenizer-init",
    "--sleep-on-idle",
]
#: What a PD server adds: the kvhandoff backend; the decode's retraction backup in a CPU tensor
#: (the default host pool pins memory through CUDA).
PD = ["--disaggregation-transfer-backend", "kvhandoff"]
DECODE = [
    "--disaggregation-mode",
    "decode",
    "--disaggregation-decode-retraction-backup",
    "cpu_tensor",
]
#: Prompts longer than this are prefilled in chunks by the PP 1 prefill.
CHUNK_TOKENS = 32
#: The decode's KV pool in tokens: 32 requests of up to 96 tokens fit at once (a request the
#: decode cannot give pages waits in its queue while the prefill's handoff deadline runs);
#: pages of finished and failed requests are reused by the next ones.
DECODE_TOKENS = 4096


def prefill_args(*extra: str) -> list[str]:
    return [*PD, "--disaggregation-mode", "prefill", "--max-total-tokens", "4096", *extra]


def decode_args(*extra: str) -> list[str]:
    return [*PD, *DECODE, *extra, "--max-total-tokens", str(DECODE_TOKENS)]


#: SGLang's early send of a computed or cached prefix creates a CUDA event, which ends a CPU
#: prefill's scheduler under overlap scheduling (a PP 1 prefill; PP turns overlap off): off,
#: chunks are still sent one by one.
EARLY_SEND_OFF = {"SGLANG_DISAGG_PREFILL_EARLY_SEND_CACHED_PREFIX": "0"}
#: What each of the tests' servers adds to `LAUNCH`, and to its environment, by name: the
#: launch lines docs/guides/sglang/support.md shows (tests/unit/test_docs.py compares them).
#: The PP 1 prefill is chunked; the decode keeps a radix cache; the TP 2 pair runs alone, once
#: the others are stopped (`test_tp2.py`).
SERVERS: dict[str, tuple[list[str], dict[str, str]]] = {
    "single": (["--max-total-tokens", "4096"], {}),
    "decode": (decode_args("--disaggregation-decode-enable-radix-cache"), {}),
    "prefill": (prefill_args("--chunked-prefill-size", str(CHUNK_TOKENS)), {**EARLY_SEND_OFF}),
    "prefill-pp2": (prefill_args("--pp-size", "2"), {}),
    # Its ranks' state directories apart from the TP 1 decode's (same rank names), below the
    # server's working directory.
    "decode-tp2": (decode_args("--tp-size", "2"), {"KVHANDOFF_SERVER__STATE_DIR": "state-tp2"}),
    "prefill-tp2": (prefill_args("--tp-size", "2"), {**EARLY_SEND_OFF}),
}
START_TIMEOUT_S = 600.0
PEER_SECRET = "engine-tests-peer-secret"
#: kvhandoff's deadline for a handoff (a decode-only request fails at it).
DEADLINE_S = 90.0
#: `handoff.max_grace_s`: how long past the deadline a release may take.
MAX_GRACE_S = 60.0
#: SGLang's deferred-release timeout for the decode: the longest kvhandoff may hold the pages.
RELEASE_S = DEADLINE_S + MAX_GRACE_S
_used_ports: set[int] = set()


def write_kvhandoff_config(workdir: Path) -> Path:
    """The SGLang backend's kvhandoff settings (`SGLANG_KVHANDOFF_CONFIG`) for every server, in
    `workdir`: a peer silent for 15 s is lost, in heartbeats and in each peer call alike (a
    scheduler starved on a loaded 2-core machine went silent for 3 s and failed live handoffs as
    unreachable); 32 KiB landing windows, so a
    request's KV (1 KiB a token for the tests' model) moves as several segments when its
    prompt is long, whether or not it was prefilled in chunks."""
    path = workdir / "kvhandoff.toml"
    path.write_text(
        f'[server]\nstate_dir = "{workdir / "state"}"\n[auth]\npeer = "{PEER_SECRET}"\n'
        "[transfer]\nlanding_bytes = 16777216\nwindow_bytes = 32768\n"
        f"staging_bytes = 16777216\n[handoff]\ndefault_deadline_s = {DEADLINE_S}\n"
        "heartbeat_interval_s = 1.0\npeer_timeout_s = 15.0\n"
        f"max_grace_s = {MAX_GRACE_S}\n[peers]\nrequest_timeout_s = 15.0\n"
    )
    return path


def kvhandoff_env(config: Path) -> dict[str, str]:
    """What a server over kvhandoff adds to its environment."""
    return {
        "SGLANG_KVHANDOFF_CONFIG": str(config),
        # SGLang holds a failed request's decode pages until kvhandoff released them or this
        # passes; a decode refuses to start where it is below deadline + max_grace_s.
        "SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE_TIMEOUT": str(int(RELEASE_S)),
    }


def free_port(span: int = 1) -> int:
    """A port whose next `span - 1` are free too, never handed out before in this session
    (SGLang derives some of its own ports from `--port`)."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = int(s.getsockname()[1])
        block = set(range(base, base + span))
        if block & _used_ports or base + span > 65535:
            continue
        if all(_bindable(p) for p in block):
            _used_ports.update(block)
            return base


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


@dataclass
class Server:
    """One `launch_server` process: `args` after the model and port; `extra_path` goes first on
    its PYTHONPATH (a test-only hook); `env` is added to the environment."""

    name: str
    model: Path
    workdir: Path
    args: list[str]
    env: dict[str, str] = field(default_factory=dict)
    extra_path: list[Path] = field(default_factory=list)
    port: int = 0
    bootstrap_port: int = 0
    proc: subprocess.Popen[bytes] | None = None
    #: Seconds each start took until healthy (reported at the session's end).
    start_s: list[float] = field(default_factory=list)
    #: Its latest start answered `/health` (`wait_healthy` returns at once).
    healthy: bool = False
    _started_at: float = 0.0

    def __post_init__(self) -> None:
        self.port = self.port or free_port(span=8)
        if "--disaggregation-mode" in self.args and "prefill" in self.args:
            self.bootstrap_port = self.bootstrap_port or free_port()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def log(self) -> Path:
        return self.workdir / f"{self.name}.log"

    def argv(self) -> list[str]:
        argv = [sys.executable, "-m", "sglang.launch_server", "--model-path", str(self.model)]
        argv += ["--host", "127.0.0.1", "--port", str(self.port), *LAUNCH, *self.args]
        if self.bootstrap_port:
            argv += ["--disaggregation-bootstrap-port", str(self.bootstrap_port)]
        return argv

    @property
    def ranks(self) -> int:
        """Scheduler processes: the product of its `--tp-size` and `--pp-size`."""
        n = 1
        for flag in ("--tp-size", "--pp-size"):
            if flag in self.args:
                n *= int(self.args[self.args.index(flag) + 1])
        return n

    def environment(self, inherited: dict[str, str]) -> dict[str, str]:
        """The server's environment: `inherited` without its `KVHANDOFF_*` variables, what
        SGLang's CPU path needs, then `env`."""
        paths = [*self.extra_path, STUBS, SGLANG_STUBS, ROOT, inherited.get("PYTHONPATH", "")]
        cpus = sorted(os.sched_getaffinity(0))
        return {
            **{k: v for k, v in inherited.items() if not k.startswith("KVHANDOFF_")},
            "PYTHONPATH": os.pathsep.join(str(p) for p in paths if str(p)),
            "SGLANG_USE_CPU_ENGINE": "1",
            "HF_HUB_OFFLINE": "1",
            # SGLang's CPU path wants a NUMA node per rank unless told each rank's cores: every
            # rank shares all of ours (without AMX SGLang only logs the binding).
            "SGLANG_CPU_OMP_THREADS_BIND": "|".join([f"{cpus[0]}-{cpus[-1]}"] * self.ranks),
            **self.env,
        }

    def start(self) -> None:
        env = self.environment(dict(os.environ))
        with self.log.open("ab") as log:
            log.write(f"\n=== {' '.join(self.argv())}\n".encode())
            log.flush()
            self._started_at = time.monotonic()
            self.healthy = False
            self.proc = subprocess.Popen(
                self.argv(),
                env=env,
                cwd=self.workdir,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def wait_healthy(self, timeout_s: float = START_TIMEOUT_S) -> None:
        """Returns once `/health` answers 200 (SGLang's warm-up done); raises with the log's
        tail if the process exits or the bound, counted from `start`, passes first."""
        assert self.proc is not None
        if self.healthy:
            return
        t0 = self._started_at
        until = t0 + timeout_s
        while time.monotonic() < until:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited ({self.proc.returncode}):\n{self.tail()}")
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=5) as r:
                    if r.status == 200:
                        self.start_s.append(time.monotonic() - t0)
                        self.healthy = True
                        return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(1.0)
        raise RuntimeError(f"{self.name} not healthy after {timeout_s:.0f} s:\n{self.tail()}")

    def kill(self, sig: int = signal.SIGKILL) -> None:
        """Signal the whole process group and reap the leader."""
        if self.proc is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, sig)
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(30)

    def stop(self) -> None:
        """SIGKILL the group: graceful shutdown is not under test, and SGLang's takes seconds."""
        self.kill()
        self.proc = None

    def tail(self, n: int = 80) -> str:
        lines = self.log.read_text(errors="replace").splitlines() if self.log.exists() else []
        return "\n".join(lines[-n:])
