"""The servers' environment: a caller's `KVHANDOFF_*` variable never reaches a server (kvhandoff
reads each as a config override; `KVHANDOFF_ENGINE_TP2=1` once killed every TP 2 rank at
start-up with "unknown key 'engine_tp2'"), while the server table's own overrides do."""

from __future__ import annotations

from pathlib import Path

from tests.engines.servers import SERVERS, Server


def test_a_server_drops_the_caller_s_kvhandoff_variables_and_keeps_its_own(
    tmp_path: Path,
) -> None:
    args, env = SERVERS["decode-tp2"]
    server = Server("decode-tp2", tmp_path, tmp_path, args, env=env)
    inherited = {"PATH": "/usr/bin", "KVHANDOFF_ENGINE_TP2": "1", "KVHANDOFF_AUTH__PEER": "x"}
    out = server.environment(inherited)
    assert not {k for k in out if k.startswith("KVHANDOFF_")} - set(env), out
    assert out["KVHANDOFF_SERVER__STATE_DIR"] == env["KVHANDOFF_SERVER__STATE_DIR"]
    assert out["PATH"] == "/usr/bin"
    assert out["SGLANG_CPU_OMP_THREADS_BIND"].count("|") == 1  # one core group per TP rank
