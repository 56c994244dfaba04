"""The backend's settings per rank: under protocol `ascend` each rank's engine gets the hostname
of its own NPU (`ascend_hostname`), from the one file all ranks read."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvhandoff.service.config import ConfigError
from kvhandoff.service.integrations.sglang.settings import CONFIG_ENV, ascend_hostname, rank_config

STAGE = {"pp_rank": 0, "pp_size": 1, "num_pages": 16}


def settings_file(tmp_path: Path, transport: str) -> dict[str, str]:
    path = tmp_path / "kvhandoff.toml"
    path.write_text(
        f'[server]\nstate_dir = "{tmp_path / "state"}"\n[auth]\npeer = "p-secret-0123456789"\n'
        f"[transport]\n{transport}\n"
    )
    return {CONFIG_ENV: str(path)}


def test_each_rank_adds_its_physical_npu_to_the_file_s_ip_and_port(tmp_path: Path) -> None:
    env = settings_file(tmp_path, 'protocol = "ascend"\nhostname = "10.0.0.5:15000"')
    env["ASCEND_RT_VISIBLE_DEVICES"] = "4,5,6,7"
    ranks = [
        rank_config(env, role="decode", stage=STAGE, rank_name=f"r{i}", npu=i).transport
        for i in range(4)
    ]
    assert [r.hostname for r in ranks] == [f"10.0.0.5:15000:npu_{p}" for p in (4, 5, 6, 7)]
    assert [r.npu for r in ranks] == [0, 1, 2, 3]  # current where each rank's engine starts
    other = settings_file(tmp_path, 'protocol = "tcp"\nhostname = "10.0.0.5"')
    tcp = rank_config(other, role="decode", stage=STAGE, rank_name="r0", npu=None)
    assert tcp.transport.hostname == "10.0.0.5"  # only ascend names an NPU
    assert tcp.transport.npu is None


@pytest.mark.parametrize(
    ("hostname", "npu", "visible", "field", "named"),
    [
        ("10.0.0.5", 0, None, "transport.hostname", "'10.0.0.5' is not ip:port, to which"),
        ("10.0.0.5:1:npu_3", 0, "2,3", "transport.hostname", "names npu_3, but this rank runs"),
        ("10.0.0.5:1", 2, "4,5", "transport.hostname", "NPU 2 is not in ASCEND_RT_VISIBLE_DEV"),
        ("10.0.0.5:1", None, None, "transport.protocol", "start SGLang with --device npu"),
    ],
)
def test_a_hostname_a_rank_cannot_complete_is_named(
    hostname: str, npu: int | None, visible: str | None, field: str, named: str
) -> None:
    env = {"ASCEND_RT_VISIBLE_DEVICES": visible} if visible is not None else {}
    with pytest.raises(ConfigError) as err:
        ascend_hostname(hostname, npu, env)
    assert err.value.context["field"] == field and named in err.value.message


def test_a_full_hostname_of_this_rank_s_npu_is_kept() -> None:
    env = {"ASCEND_RT_VISIBLE_DEVICES": "2,3"}
    assert ascend_hostname("10.0.0.5:1:npu_3", 1, env) == "10.0.0.5:1:npu_3"
