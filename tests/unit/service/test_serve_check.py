"""`kvhandoff serve --check`: load and validate a config the way `serve` would, then exit.

Deployments run it on the configs they ship (tests/unit/test_k8s.py on the Kubernetes
ConfigMaps); what they rely on is the exit status and one line naming what is wrong.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvhandoff.service import serve
from kvhandoff.service.cli import main

REPO = Path(__file__).resolve().parents[3]
DECODE = str(REPO / "docker" / "decode.toml")


@pytest.fixture(autouse=True)
def _no_kvhandoff_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list(os.environ):
        if name.startswith("KVHANDOFF_"):
            monkeypatch.delenv(name)


@pytest.fixture
def never_serve(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: object) -> int:
        raise AssertionError("--check started the service")

    monkeypatch.setattr(serve.uvloop, "run", refuse)


def test_check_exits_0_on_a_valid_config_without_serving(
    never_serve: None, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["serve", "--check", "--config", DECODE]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out == [
        f"kvhandoff serve: {DECODE}: valid (decode, stages 0 of 1, port 8200, "
        "public_url http://decode:8200)"
    ]


def test_check_reads_the_environment_and_flags_as_serve_does(
    never_serve: None, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("KVHANDOFF_SERVER__PUBLIC_URL", "http://10.1.2.3:9000")
    assert main(["serve", "--check", "--config", DECODE, "--port", "9000"]) == 0
    assert "port 9000, public_url http://10.1.2.3:9000)" in capsys.readouterr().out
    monkeypatch.setenv("KVHANDOFF_SERVER__PROT", "1")
    assert main(["serve", "--check", "--config", DECODE]) == 2
    assert "KVHANDOFF_SERVER__PROT: unknown key 'server.prot'" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("edit", "reason"),
    [
        (("pp_rank = 0", "pp_rank = 3"), "stages: the decode role hosts exactly one stage"),
        (("[server]", "[server\nport = 1"), "is not valid TOML"),  # its message spans lines
        (('preset = "hybrid-npu-mla"', 'preset = "nope"'), "model.preset: unknown preset"),
    ],
)
def test_check_prints_one_line_and_exits_2_on_a_bad_config(
    never_serve: None,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    edit: tuple[str, str],
    reason: str,
) -> None:
    bad = tmp_path / "bad.toml"
    text = Path(DECODE).read_text()
    assert edit[0] in text
    bad.write_text(text.replace(*edit))
    assert main(["serve", "--check", "--config", str(bad)]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("kvhandoff serve: "), lines
    assert reason in lines[0]


def test_check_from_the_command_line(tmp_path: Path) -> None:
    """The installed entry point: status 2 and one stderr line, nothing started."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVHANDOFF_")}
    argv = [sys.executable, "-m", "kvhandoff.service.cli", "serve", "--check", "--config"]
    ok = subprocess.run([*argv, DECODE], env=env, capture_output=True, text=True, timeout=60)
    assert (ok.returncode, ok.stderr) == (0, ""), ok.stderr
    missing = str(tmp_path / "missing.toml")
    bad = subprocess.run([*argv, missing], env=env, capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2
    assert bad.stderr.splitlines() == [
        f"kvhandoff serve: cannot read config file {missing}: No such file or directory"
    ]


def test_check_warns_of_timeouts_that_contradict_each_other(
    never_serve: None, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Valid, so status 0, but a peer call would give up on a peer the heartbeats still count
    alive: one warning line naming both keys and the fix."""
    monkeypatch.setenv("KVHANDOFF_HANDOFF__PEER_TIMEOUT_S", "15")
    assert main(["serve", "--check", "--config", DECODE]) == 0
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 2 and out[1] == (
        "kvhandoff serve: warning: peers.request_timeout_s: 5 s is below "
        "handoff.peer_timeout_s 15 s: a call gives up on a peer the heartbeats still count "
        "alive and fails its handoffs (peer_timeout); set it at or above handoff.peer_timeout_s"
    )
    monkeypatch.setenv("KVHANDOFF_PEERS__REQUEST_TIMEOUT_S", "15")
    assert main(["serve", "--check", "--config", DECODE]) == 0
    assert len(capsys.readouterr().out.splitlines()) == 1
