"""The vLLM connector's settings (`kv_connector_extra_config`) and each worker's kvhandoff
configuration built from them: what is refused by name, and what each worker gets."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from kvhandoff.service.config import ConfigError
from kvhandoff.service.integrations.vllm.settings import connector_settings, rank_config

STAGE = {"pp_rank": 0, "pp_size": 1, "num_pages": 8}


def toml(tmp_path: Path, body: str) -> str:
    path = tmp_path / "kvhandoff.toml"
    path.write_text(f'[server]\nstate_dir = "{tmp_path / "state"}"\n{body}')
    return str(path)


def test_an_unknown_extra_key_is_refused_by_name() -> None:
    with pytest.raises(ConfigError, match="kv_connector_extra_config") as err:
        connector_settings({"config": "x.toml", "deadline": 3})
    assert "deadline" in str(err.value)


def test_a_worker_gets_its_role_stage_free_port_and_own_state_dir(tmp_path: Path) -> None:
    settings = connector_settings(
        {
            "config": toml(tmp_path, '[auth]\npeer = "0123456789abcdef0123"\n'),
            "settings": {"handoff.default_deadline_s": 7},
        }
    )
    config = rank_config(settings, {}, role="decode", stage=STAGE, rank_name="vllm-decode-tp1")
    assert config.role == "decode" and config.server.port == 0
    assert config.handoff.default_deadline_s == 7
    assert [s.num_pages for s in config.stages] == [8]
    assert Path(config.server.state_dir) == tmp_path / "state" / "vllm-decode-tp1"


def test_the_peer_secret_is_required(tmp_path: Path) -> None:
    settings = connector_settings({"config": toml(tmp_path, "")})
    with pytest.raises(ConfigError, match=r"auth\.peer"):
        rank_config(settings, {}, role="prefill", stage=STAGE, rank_name="r")


@pytest.mark.parametrize("key", ["role", "stages", "model.layers"])
def test_the_role_and_layout_are_vllms(tmp_path: Path, key: str) -> None:
    settings = connector_settings(
        {"config": toml(tmp_path, '[auth]\npeer = "0123456789abcdef0123"\n'),
         "settings": {key: 1}}
    )  # fmt: skip
    with pytest.raises(ConfigError, match=re.escape(f"settings.{key}")):
        rank_config(settings, {}, role="prefill", stage=STAGE, rank_name="r")
