from __future__ import annotations

from pathlib import Path

import pytest

from kvhandoff.pipelines.models import ModelSpec
from kvhandoff.service.config import Config, ConfigError, backend_of, load_config
from kvhandoff.transport.config import MooncakeConfig
from kvhandoff.transport.local import LocalConfig

from .conftest import MINIMAL, make_config

REPO = Path(__file__).resolve().parents[3]

PREFILL_TOML = """
role = "prefill"
[server]
port = 8100
[model]
preset = "hybrid-mha"
num_layers = 8
scale = 64
[[stages]]
pp_rank = 0
pp_size = 2
num_pages = 8
num_slots = 2
[[stages]]
pp_rank = 1
pp_size = 2
num_pages = 8
num_slots = 2
"""


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "kvhandoff.toml"
    path.write_text(text)
    return path


@pytest.mark.parametrize("name", ["prefill.toml", "decode.toml"])
def test_example_files_load(name: str) -> None:
    config = load_config(REPO / "docker" / name)
    assert config.role == name.removesuffix(".toml")
    assert config.model_spec().name == "hybrid-npu-mla"
    assert config.layer_partition().pp_size == (4 if config.role == "prefill" else 1)


def test_prefill_example_hosts_four_stages() -> None:
    config = load_config(REPO / "docker" / "prefill.toml")
    assert [s.pp_rank for s in config.stages] == [0, 1, 2, 3]
    assert config.layer_partition().bounds == (0, 12, 24, 36, 48)


def test_defaults_and_derived_values(tmp_path: Path) -> None:
    config = load_config(write(tmp_path, PREFILL_TOML), {"HOME": "/home/u"})
    assert config.server.host == "127.0.0.1"
    assert config.server.public_url == "http://127.0.0.1:8100"
    assert config.server.max_body_bytes == 8 << 20
    assert config.server.state_dir == "/home/u/.local/state/kvhandoff"
    assert config.server.token is None
    assert isinstance(config.transport, MooncakeConfig)
    assert backend_of(config.transport) == "mooncake"
    assert config.transport.metadata == "P2PHANDSHAKE"
    assert config.transport.max_blocks_per_batch == 2048
    assert config.handoff.default_deadline_s == 30.0
    assert config.handoff.sse_buffer == 4096
    assert config.pp_size == 2


def test_state_dir_prefers_xdg_and_expands_home() -> None:
    assert make_config().server.state_dir.endswith(".kvhandoff-state")  # no HOME given
    xdg = load_config(None, {"XDG_STATE_HOME": "/s", "HOME": "/h"}, MINIMAL)
    assert xdg.server.state_dir == "/s/kvhandoff"
    tilde = load_config(None, {"HOME": "/h"}, {**MINIMAL, "server.state_dir": "~/kv"})
    assert tilde.server.state_dir == "/h/kv"


def test_precedence_cli_over_env_over_file(tmp_path: Path) -> None:
    path = write(tmp_path, PREFILL_TOML)
    env = {"KVHANDOFF_SERVER__PORT": "8200", "KVHANDOFF_SERVER__HOST": "10.0.0.1"}
    assert load_config(path).server.port == 8100
    from_env = load_config(path, env)
    assert (from_env.server.port, from_env.server.host) == (8200, "10.0.0.1")
    from_cli = load_config(path, env, {"server.port": 8300})
    assert (from_cli.server.port, from_cli.server.host) == (8300, "10.0.0.1")
    assert from_cli.server.public_url == "http://10.0.0.1:8300"


def test_env_values_are_typed_and_json_for_tables(tmp_path: Path) -> None:
    env = {
        "KVHANDOFF_HANDOFF__VERIFY": "true",
        "KVHANDOFF_HANDOFF__DEFAULT_DEADLINE_S": "2.5",
        "KVHANDOFF_SERVER__TOKEN": "s3cret",
        "KVHANDOFF_TRANSPORT__TCP_ENV": '{"MC_TCP_SLICE_SIZE": "65536"}',
        "KVHANDOFF_PEERS__PREFILL": '["http://p:1"]',
        "UNRELATED": "ignored",
    }
    config = load_config(write(tmp_path, PREFILL_TOML), env)
    assert config.handoff.verify is True
    assert config.handoff.default_deadline_s == 2.5
    assert config.server.token == "s3cret"
    assert config.transport.tcp_env == {"MC_TCP_SLICE_SIZE": "65536"}
    assert config.peers.prefill == ["http://p:1"]


def test_role_from_env_top_level() -> None:
    config = load_config(
        None, {"KVHANDOFF_ROLE": "prefill"}, {k: v for k, v in MINIMAL.items() if k != "role"}
    )
    assert config.role == "prefill"


def test_explicit_model_spec_table(tmp_path: Path) -> None:
    text = """
role = "decode"
[model.spec]
name = "tiny"
num_layers = 2
full_attention_layers = [0, 1]
attention = "mha"
kv_groups = [{ name = "k", bytes_per_token = 8 }, { name = "v", bytes_per_token = 8 }]
[[stages]]
num_pages = 4
"""
    spec = load_config(write(tmp_path, text)).model_spec()
    assert isinstance(spec, ModelSpec)
    assert (spec.name, spec.num_layers) == ("tiny", 2)


ERRORS = [
    # (TOML, expected field, fragment of the message)
    ('role = "decode"\nport = 1', "port", "unknown key"),
    ("[server]\nprot = 1", "server.prot", "unknown key"),
    ("[server]\nport = 70000", "server.port", "<= 65535"),
    ('[server]\nport = "x"', "server.port", "Expected `int`"),
    ('role = "both"', "role", "'prefill', 'decode'"),
    ("[[stages]]\nnum_pages = 0", "stages[0].num_pages", ">= 1"),
    (
        "[[stages]]\nnum_pages = 1\n[[stages]]\npp_rank = 1\nnum_pages = 1\nbogus = 2",
        "stages[1].bogus",
        "unknown key",
    ),
    ('[transport]\nprotocol = "udp"', "transport.protocol", "'tcp', 'rdma', 'ascend'"),
    ('[transport]\ntcp_env = { FOO = "1" }', "transport", "MC_TCP_"),
    ('[model]\npreset = "nope"', "model.preset", "unknown preset"),
    ('[model]\npreset = "dense-mha"\nindexer = true', "model.indexer", "does not take"),
]


@pytest.mark.parametrize(("toml", "field", "fragment"), ERRORS)
def test_errors_name_the_key(tmp_path: Path, toml: str, field: str, fragment: str) -> None:
    # The snippet is the file; whatever required section it lacks comes from the minimal config.
    with pytest.raises(ConfigError) as info:
        load_config(write(tmp_path, toml), {}, _missing_from(toml, MINIMAL))
    assert info.value.context["field"] == field, str(info.value)
    assert fragment in str(info.value)
    assert str(info.value).startswith(f"{field}: ")


def _missing_from(toml: str, base: dict[str, object]) -> dict[str, object]:
    """The minimal config's top-level keys that the TOML snippet does not set itself."""
    sections = {"model": "[model", "stages": "[[stages", "role": "role ="}
    return {k: v for k, v in base.items() if sections[k] not in toml}


def test_stage_rank_not_below_pp_size(tmp_path: Path) -> None:
    text = PREFILL_TOML.replace("pp_rank = 1\npp_size = 2", "pp_rank = 2\npp_size = 2")
    with pytest.raises(ConfigError, match=r"^stages\[1\]\.pp_rank: 2 is not below pp_size 2$"):
        load_config(write(tmp_path, text))


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        ({"stages": [{"num_pages": 1, "pool": "cuda:0"}]}, "stages[0].pool"),
        ({"stages": [{"num_pages": 1, "pp_size": 2}]}, "stages"),  # decode: pp_size 1 only
        ({"stages": []}, "stages"),
        (
            {"role": "prefill", "stages": [{"num_pages": 1, "pp_size": 2}] * 2},
            "stages[1].pp_rank",  # rank 0 twice
        ),
        (
            {
                "role": "prefill",
                "stages": [{"num_pages": 1, "pp_size": 2}, {"num_pages": 1, "pp_size": 3}],
            },
            "stages[1].pp_size",
        ),
        (
            {"role": "prefill", "partition.counts": [1, 2], "stages": [{"num_pages": 1}]},
            "partition.counts",
        ),
        ({"model.preset": "hybrid-mha"}, "stages[0].num_slots"),  # state model needs slots
        ({"peers.prefill": ["prefill:8100"]}, "peers.prefill[0]"),
        ({"peers.watch_retry_max_s": 0.1}, "peers.watch_retry_max_s"),  # below the 0.5 s min
        ({"peers.max_tracked": 0}, "peers.max_tracked"),
        ({"model": {}}, "model.preset"),
    ],
)
def test_cross_key_errors(overrides: dict[str, object], field: str) -> None:
    with pytest.raises(ConfigError) as info:
        make_config(**overrides)
    assert info.value.context["field"] == field, str(info.value)


def test_transport_without_backend_is_mooncake(tmp_path: Path) -> None:
    # Files and environment overrides written before the backend union keep their meaning.
    toml = PREFILL_TOML + '[transport]\nprotocol = "rdma"\ndevice_name = "mlx5_0"\n'
    env = {"KVHANDOFF_TRANSPORT__TRANSFER_TIMEOUT_S": "4", "KVHANDOFF_TRANSPORT__NPU": "1"}
    config = load_config(write(tmp_path, toml), env)
    assert config.transport == MooncakeConfig(
        protocol="rdma", device_name="mlx5_0", transfer_timeout_s=4.0, npu=1
    )
    only_env = load_config(None, {"KVHANDOFF_TRANSPORT__PROTOCOL": "ascend"}, MINIMAL)
    assert isinstance(only_env.transport, MooncakeConfig)
    assert only_env.transport.protocol == "ascend"


def test_transport_backend_selects_its_struct(tmp_path: Path) -> None:
    toml = PREFILL_TOML + '[transport]\nbackend = "local"\nmax_blocks_per_batch = 64\n'
    config = load_config(write(tmp_path, toml))
    assert config.transport == LocalConfig(max_blocks_per_batch=64)
    assert backend_of(config.transport) == "local"
    assert config.prefill_settings().max_blocks_per_batch == 64
    env = {
        "KVHANDOFF_TRANSPORT__BACKEND": "local",
        "KVHANDOFF_TRANSPORT__MAX_BYTES_PER_BATCH": "8192",
    }
    from_env = load_config(write(tmp_path, PREFILL_TOML), env)
    assert from_env.transport == LocalConfig(max_bytes_per_batch=8192)
    # The file's backend is replaced by the environment's, keys and all.
    back = load_config(write(tmp_path, toml), {"KVHANDOFF_TRANSPORT__BACKEND": "mooncake"})
    assert back.transport == MooncakeConfig(max_blocks_per_batch=64)


@pytest.mark.parametrize(
    ("transport", "field", "message"),
    [
        (
            {"backend": "local", "protocol": "tcp"},
            "transport.protocol",
            "transport.protocol: not a setting of backend 'local' (only of mooncake)",
        ),
        (
            {"backend": "local", "bogus": 1},
            "transport.bogus",
            "transport.bogus: unknown key (backend 'local')",
        ),
        (
            {"backend": "nvlink"},
            "transport.backend",
            "transport.backend: 'nvlink' is not a transport backend; one of 'mooncake', 'local'",
        ),
        (
            {"max_blocks_per_batch": 0},
            "transport.max_blocks_per_batch",
            "transport.max_blocks_per_batch: Expected `int` >= 1 (backend 'mooncake')",
        ),
        (
            {"max_inflight_bytes_per_peer": 100},
            "transport.max_inflight_bytes_per_peer",
            "transport.max_inflight_bytes_per_peer: Expected `int` >= 4096 (backend 'mooncake')",
        ),
        (
            {"backend": "local", "max_bytes_per_batch": "lots"},
            "transport.max_bytes_per_batch",
            "transport.max_bytes_per_batch: Expected `int`, got `str` (backend 'local')",
        ),
    ],
)
def test_transport_errors_name_the_key_and_the_backend(
    transport: dict[str, object], field: str, message: str
) -> None:
    with pytest.raises(ConfigError) as info:
        make_config(transport=transport)
    assert info.value.context["field"] == field
    assert str(info.value) == message


def test_transport_env_keys_are_checked_against_every_backend() -> None:
    with pytest.raises(ConfigError) as info:
        load_config(None, {"KVHANDOFF_TRANSPORT__HOSTNAM": "x"}, MINIMAL)
    assert info.value.context["field"] == "KVHANDOFF_TRANSPORT__HOSTNAM"
    with pytest.raises(ConfigError, match="not a setting of backend 'local'"):
        load_config(
            None,
            {"KVHANDOFF_TRANSPORT__BACKEND": "local", "KVHANDOFF_TRANSPORT__HOSTNAME": "h"},
            MINIMAL,
        )


def test_missing_required_keys_are_named() -> None:
    with pytest.raises(ConfigError, match=r"^role: required key is missing$"):
        load_config(None, {}, {"model.preset": "dense-mha", "stages": [{"num_pages": 1}]})


def test_unknown_env_variable_is_named() -> None:
    with pytest.raises(ConfigError) as info:
        load_config(None, {"KVHANDOFF_SERVER__PROT": "1"}, MINIMAL)
    assert info.value.context["field"] == "KVHANDOFF_SERVER__PROT"
    with pytest.raises(ConfigError, match="is a section"):
        load_config(None, {"KVHANDOFF_SERVER": "1"}, MINIMAL)


def test_bad_toml_and_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(write(tmp_path, "role = "))
    with pytest.raises(ConfigError, match="cannot read config file"):
        load_config(tmp_path / "absent.toml")


def test_config_is_frozen() -> None:
    config = make_config()
    assert isinstance(config, Config)
    with pytest.raises(AttributeError):
        config.role = "prefill"  # type: ignore[misc]


def test_auth_secrets_from_toml_and_env(tmp_path: Path) -> None:
    path = tmp_path / "c.toml"
    path.write_text(
        'role = "decode"\n[model]\npreset = "dense-mha"\n[[stages]]\nnum_pages = 4\n'
        '[auth]\nrouter = ["r-new", "r-old"]\nengine = "e"\n'
    )
    env = {"KVHANDOFF_AUTH__PEER": '["p2", "p1"]', "KVHANDOFF_AUTH__MAX_SKEW_S": "5"}
    config = load_config(path, env)
    assert config.secrets("router") == ("r-new", "r-old")
    assert config.secrets("engine") == ("e",)  # a single string is a list of one
    assert config.secrets("peer") == ("p2", "p1")
    assert config.auth.max_skew_s == 5.0
    assert load_config(path, {"KVHANDOFF_AUTH__PEER": "p"}).secrets("peer") == ("p",)


def test_server_token_is_the_default_of_every_unset_role() -> None:
    assert make_config().secrets("router") == ()
    config = make_config(**{"server.token": "t", "auth.engine": "e"})
    assert [config.secrets(r) for r in ("router", "engine", "peer")] == [("t",), ("e",), ("t",)]


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        ({"auth.router": "same", "auth.peer": "same"}, "auth.peer"),
        ({"auth.router": ["a", "b"], "auth.engine": ["c", "b"]}, "auth.engine"),
        ({"server.token": "t", "auth.router": "t"}, "auth.router"),
        ({"auth.router": []}, "auth.router"),
        ({"auth.peer": [""]}, "auth.peer[0]"),
    ],
)
def test_no_secret_serves_two_roles(overrides: dict[str, object], field: str) -> None:
    with pytest.raises(ConfigError) as info:
        make_config(**overrides)
    assert info.value.context["field"] == field


def test_webhook_and_record_keys_are_checked_naming_the_key() -> None:
    config = make_config(**{"webhooks.allow_hosts": ["a.example"], "records.max_records": 5})
    assert config.webhooks.allow_hosts == ["a.example"] and config.records.max_records == 5
    assert config.webhooks.callback_types == ["handoff."] and config.records.persist
    with pytest.raises(ConfigError, match=r"^webhooks.callback_secret: must be whsec_"):
        make_config(**{"webhooks.callback_secret": "hunter2"})
    with pytest.raises(ConfigError, match=r"^webhooks.concurrency"):
        make_config(**{"webhooks.concurrency": 0})
    env = load_config(None, {"KVHANDOFF_RECORDS__PERSIST": "false"}, MINIMAL)
    assert env.records.persist is False


def test_urls_are_kept_in_their_canonical_form() -> None:
    """Issue 18 B: every URL a service compares is in one form (kvhandoff.pipelines.urls)."""
    config = load_config(
        None,
        {},
        {
            **MINIMAL,
            "server.public_url": "HTTP://Decode.Example:80/",
            "peers.prefill": ["http://P0:8100/", "https://p1:443"],
        },
    )
    assert config.server.public_url == "http://decode.example"
    assert config.peers.prefill == ["http://p0:8100", "https://p1"]
