"""The backend's kvhandoff settings: one TOML file named by `SGLANG_KVHANDOFF_CONFIG`.

Read once per SGLang process (by the manager of each scheduler rank and by the bootstrap server)
through the service's own loader, so `KVHANDOFF_*` variables override it as they do for
`kvhandoff serve`. SGLang constructs our classes with its own arguments only, which is why the
file is named by the environment: this module is the one place the adapter reads it.

The file holds what a kvhandoff service needs besides its layout — `[auth]` (the peer secret
is required: it signs the peer protocol and the bootstrap registrations), `[transport]`,
`[transfer]`, `[handoff]`, `[server]` (`host` reachable by the peers; `state_dir` the parent of
each rank's own, locked, state directory) — and never `role`, `[model]` or `[[stages]]`: each
rank's service takes those from SGLang's `KVArgs`.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from service.config import Config, ConfigError, load_config

CONFIG_ENV = "SGLANG_KVHANDOFF_CONFIG"


def rank_config(
    env: Mapping[str, str], *, role: str, stage: dict[str, Any], rank_name: str
) -> Config:
    """The configuration of one rank's embedded service: the file, then this rank's role, stage
    table, a free port and its own state directory (`<server.state_dir>/<rank_name>`)."""
    path = env.get(CONFIG_ENV) or None
    overrides: dict[str, Any] = {"role": role, "stages": [stage], "server.port": 0}
    base = load_config(path, env, overrides)
    if base.model is not None:
        raise ConfigError("model", f"{path}: the SGLang backend takes the layout from SGLang")
    if not base.secrets("peer"):
        raise ConfigError(
            "auth.peer",
            f"required by the SGLang backend (set it in {CONFIG_ENV} = {path}): it "
            "authenticates the bootstrap registrations and the peer protocol",
        )
    state_dir = Path(base.server.state_dir) / rank_name
    return load_config(path, env, {**overrides, "server.state_dir": str(state_dir)})


def peer_secrets(env: Mapping[str, str]) -> tuple[bytes, ...]:
    """The peer secrets the bootstrap server takes registrations signed with (the current one
    first), from the same file."""
    path = env.get(CONFIG_ENV) or None
    base = load_config(path, env, {"role": "prefill", "stages": [{"num_pages": 1}]})
    secrets = base.secrets("peer")
    if not secrets:
        raise ConfigError(
            "auth.peer", f"required by the SGLang backend's bootstrap server ({CONFIG_ENV})"
        )
    return tuple(k.encode() for k in secrets)
