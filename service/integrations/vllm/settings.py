"""The connector's settings: vLLM's `kv_connector_extra_config`, and each worker's kvhandoff
configuration built from it.

vLLM constructs the connector with its own config only, so what a kvhandoff service needs
besides its layout comes through `kv_connector_extra_config` (read here, once per connector):
`config`, the path of a kvhandoff TOML file (`[auth]` with the peer secret, `[transport]`,
`[transfer]`, `[handoff]`, `[server]`: `host` reachable by the peers, `state_dir` the parent
of each worker's own, locked, state directory), and `settings`, dotted overrides of it
(`{"handoff.default_deadline_s": 10}`). `KVHANDOFF_*` variables override the file as they do
for `kvhandoff serve`. Never `role`, `[model]` or `[[stages]]`: each worker's service takes
those from vLLM (its kv_role, its KV caches).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import msgspec

from kvhandoff.service.config import Config, ConfigError, load_config


class ConnectorSettings(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """`kv_connector_extra_config`, checked: an unknown key is refused by name."""

    config: str | None = None  # the kvhandoff TOML file
    settings: dict[str, Any] = {}  # dotted overrides of it


def connector_settings(extra: Mapping[str, Any] | None) -> ConnectorSettings:
    """The extra config as settings; ConfigError naming the key that does not fit."""
    try:
        return msgspec.convert(dict(extra or {}), ConnectorSettings)
    except msgspec.ValidationError as exc:
        raise ConfigError("kv_connector_extra_config", str(exc)) from None


def rank_config(
    settings: ConnectorSettings,
    env: Mapping[str, str],
    *,
    role: str,
    stage: dict[str, Any],
    rank_name: str,
) -> Config:
    """One worker's service configuration: the file and its overrides, then this worker's
    role, stage table, a free port and its own state directory
    (`<server.state_dir>/<rank_name>`)."""
    for key in settings.settings:
        if key.split(".")[0] in ("role", "model", "stages"):
            raise ConfigError(
                f"kv_connector_extra_config.settings.{key}",
                "the kvhandoff connector takes the role and layout from vLLM",
            )
    overrides: dict[str, Any] = {
        **settings.settings,
        "role": role,
        "stages": [stage],
        "server.port": 0,
    }
    base = load_config(settings.config, env, overrides)
    if base.model is not None:
        raise ConfigError("model", f"{settings.config}: the vLLM connector takes it from vLLM")
    if not base.secrets("peer"):
        raise ConfigError(
            "auth.peer",
            "required by the kvhandoff vLLM connector (kv_connector_extra_config.config = "
            f"{settings.config}): it authenticates the peer protocol",
        )
    overrides["server.state_dir"] = str(Path(base.server.state_dir) / rank_name)
    return load_config(settings.config, env, overrides)


def transfer_mode(settings: ConnectorSettings, env: Mapping[str, str]) -> str:
    """`transfer.mode` of every worker's service ("landed" or "direct"), resolved as
    `rank_config` resolves it (the mode does not depend on the role or the rank)."""
    stage = {"pp_rank": 0, "pp_size": 1, "num_pages": 1}
    config = rank_config(settings, env, role="decode", stage=stage, rank_name="mode")
    return config.transfer.mode
