from __future__ import annotations

import asyncio
import os
import re
import signal
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web

from kvhandoff.service.cli import build_parser
from kvhandoff.service.http.app import CONFIG, PEERS
from kvhandoff.service.serve import cli_overrides, serve

from .conftest import make_config

REPO = Path(__file__).resolve().parents[3]

CONFIG_TOML = """
role = "decode"
[server]
port = 0
[transport]
backend = "local"
[model]
preset = "dense-mha"
scale = 64
num_layers = 4
[[stages]]
num_pages = 8
"""


async def test_serve_on_port_zero_publishes_the_real_url_and_cleans_up() -> None:
    events: list[str] = []

    async def resource(app: web.Application) -> Any:
        events.append("start")
        yield
        events.append("stop")

    def install(app: web.Application) -> None:
        app.cleanup_ctx.append(resource)

    async with serve(make_config(**{"server.port": 0}), [install]) as server:
        port = server.config.server.port
        assert port != 0
        assert server.url == f"http://127.0.0.1:{port}"
        assert server.app[CONFIG].server.public_url == server.url
        async with aiohttp.ClientSession() as session, session.get(server.url + "/healthz") as r:
            assert r.status == 200
        health = await server.app[PEERS].get(server.url, "/healthz", dict)
        assert health["role"] == "decode"
        assert events == ["start"]
    assert events == ["start", "stop"]


async def test_serve_keeps_an_explicit_public_url() -> None:
    config = make_config(**{"server.port": 0, "server.public_url": "http://decode:9"})
    async with serve(config) as server:
        assert server.url == "http://decode:9"
        assert server.config.server.port != 0


def test_cli_flags_become_overrides() -> None:
    argv = ["serve", "--config", "f.toml", "--port", "9", "--token", "t", "--role", "prefill"]
    args = build_parser(argv).parse_args(argv)
    assert cli_overrides(args) == {"role": "prefill", "server.port": 9, "server.token": "t"}


def _kvhandoff(*argv: str, env: dict[str, str]) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "kvhandoff.service.cli", *argv],
        cwd=REPO,
        env={**os.environ, **env},
        stderr=subprocess.PIPE,
        text=True,
    )


async def test_kvhandoff_serve_reads_env_and_stops_on_sigterm(tmp_path: Path) -> None:
    path = tmp_path / "decode.toml"
    path.write_text(CONFIG_TOML)
    proc = _kvhandoff(
        "serve",
        "--config",
        str(path),
        "--log-level",
        "info",
        env={"KVHANDOFF_SERVER__TOKEN": "from-env", "XDG_STATE_HOME": str(tmp_path)},
    )
    try:
        assert proc.stderr is not None
        line = await asyncio.wait_for(asyncio.to_thread(proc.stderr.readline), 30)
        match = re.search(r"serving at (http://\S+) .* target (local:\d+)", line)
        assert match, line  # the startup line names the transport's target
        url = match[1]
        async with aiohttp.ClientSession() as session:
            async with session.get(url + "/v1/anything") as r:
                assert r.status == 401  # the token came from the environment
            async with session.get(url + "/readyz") as r:
                assert r.status == 200  # the transport extension started with the app
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(asyncio.to_thread(proc.wait), 30) == 0
        rest = proc.stderr.read()
        assert "shutting down" in rest
        # Start-up's objects left the collector's reach once the service was up.
        assert re.search(r"\b[1-9]\d* start-up objects frozen out of garbage collection", rest)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if proc.stderr is not None:
            proc.stderr.close()


def test_kvhandoff_serve_rejects_a_bad_config(tmp_path: Path) -> None:
    path = tmp_path / "bad.toml"
    path.write_text(CONFIG_TOML.replace("port = 0", "prot = 0"))
    proc = _kvhandoff("serve", "--config", str(path), env={})
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 2
    assert "server.prot: unknown key" in err


async def test_a_second_decode_on_the_same_state_dir_refuses_to_start(tmp_path: Path) -> None:
    """Issue 18 B: the second of two decodes on one state_dir reported the first's live
    handoffs `failed / service_restarted`. It now refuses to start, naming the holder, and the
    first goes on serving."""
    import pytest

    from kvhandoff.service.config import ConfigError
    from tests.unit.service.handoff_fixtures import decode_config, extensions

    settings = {"server.state_dir": str(tmp_path)}
    async with serve(decode_config(settings), extensions) as first:
        with pytest.raises(ConfigError, match=rf"server.state_dir.*in use by pid {os.getpid()}"):
            async with serve(decode_config(settings), extensions):
                pass
        async with aiohttp.ClientSession() as http, http.get(f"{first.url}/readyz") as resp:
            assert resp.status == 200, await resp.text()
    async with serve(decode_config(settings), extensions):  # once it stopped, the next starts
        pass


def test_start_up_mistakes_print_one_line_and_exit_2(tmp_path: Path) -> None:
    """Issue 18 D: a port in use or a state_dir another decode holds is one line naming the
    key, status 2 — not a traceback."""
    from kvhandoff.service.storage import FILE_NAME, Database

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        path = tmp_path / "decode.toml"
        path.write_text(CONFIG_TOML.replace("port = 0", f'port = {port}\nhost = "127.0.0.1"'))
        proc = _kvhandoff("serve", "--config", str(path), env={"XDG_STATE_HOME": str(tmp_path)})
        _, err = proc.communicate(timeout=60)
    assert proc.returncode == 2, err
    assert "Traceback" not in err
    assert err.strip().splitlines()[-1] == (
        f"kvhandoff serve: server.port: 127.0.0.1:{port} is in use by another process "
        "(set server.port or --port)"
    )
    state = tmp_path / "state"
    held = Database(state / FILE_NAME)
    try:
        path.write_text(CONFIG_TOML.replace("[server]", f'[server]\nstate_dir = "{state}"'))
        proc = _kvhandoff("serve", "--config", str(path), env={})
        _, err = proc.communicate(timeout=60)
    finally:
        held.close()
    assert proc.returncode == 2, err
    assert "Traceback" not in err
    last = err.strip().splitlines()[-1]
    assert last.startswith("kvhandoff serve: server.state_dir: ") and f"pid {os.getpid()}" in last


def test_pool_mistakes_print_one_line_and_exit_2(tmp_path: Path) -> None:
    """Issue 18 D: a CUDA pool on a CPU build of torch (a bare AssertionError deep in torch
    before) and a shm pool no engine created are one line naming the stage's pool, status 2."""
    import torch

    cases = {
        "torch:cuda:0": "stages[0].pool: pool device 'cuda:0' needs a CUDA build of torch",
        "shm:kvh-test-no-pool": "stages[0].pool: /dev/shm/kvh-test-no-pool does not exist",
    }
    if torch.version.cuda is not None:  # a CUDA build: the first mistake is not one here
        del cases["torch:cuda:0"]
    for pool, reason in cases.items():
        path = tmp_path / "decode.toml"
        path.write_text(CONFIG_TOML + f'pool = "{pool}"\n')
        proc = _kvhandoff("serve", "--config", str(path), env={"XDG_STATE_HOME": str(tmp_path)})
        _, err = proc.communicate(timeout=60)
        assert proc.returncode == 2, err
        assert "Traceback" not in err, err
        lines = err.strip().splitlines()
        assert lines[-1].startswith(f"kvhandoff serve: {reason}"), lines


def test_port_moves_a_derived_public_url_and_keeps_an_explicit_one(tmp_path: Path) -> None:
    def check(toml: str) -> str:
        path = tmp_path / "decode.toml"
        path.write_text(toml)
        argv = ["serve", "--config", str(path), "--port", "9100", "--check"]
        done = subprocess.run(
            [sys.executable, "-m", "kvhandoff.service.cli", *argv],
            cwd=REPO,
            env={**os.environ, "XDG_STATE_HOME": str(tmp_path)},
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert done.returncode == 0, done.stderr
        return done.stdout

    derived = check(CONFIG_TOML.replace("port = 0", 'port = 8200\nhost = "10.0.0.7"'))
    assert "port 9100, public_url http://10.0.0.7:9100)" in derived
    named = CONFIG_TOML.replace("port = 0", 'port = 8200\npublic_url = "http://decode:8200"')
    assert "port 9100, public_url http://decode:8200)" in check(named)  # the operator's: kept


async def test_contradicting_timeouts_are_logged_at_start_up(caplog: Any) -> None:
    """A call timeout below the heartbeats' silence bound failed live vLLM handoffs (stop 38):
    the service starts, and says so once, naming both keys."""
    ok = make_config(**{"server.port": 0})
    bad = make_config(**{"server.port": 0, "handoff.peer_timeout_s": 15.0})
    for config, warned in ((ok, False), (bad, True)):
        caplog.clear()
        async with serve(config):
            pass
        lines = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
        advice = [line for line in lines if "peers.request_timeout_s" in line]
        assert len(advice) == int(warned), lines
        if warned:
            assert "5 s is below handoff.peer_timeout_s 15 s" in advice[0]


def test_a_service_process_collects_its_young_objects_less_often() -> None:
    """`kvhandoff serve` raises the collector's thresholds (a handoff's objects die young
    instead of being promoted and walked by full collections); the defaults are CPython's."""
    import gc

    from kvhandoff.service.serve import GC_THRESHOLDS, tune_collector

    before = gc.get_threshold()
    try:
        tune_collector()
        assert gc.get_threshold() == GC_THRESHOLDS and GC_THRESHOLDS[0] > before[0]
    finally:
        gc.set_threshold(*before)
