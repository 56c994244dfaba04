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

Under `transport.protocol = "ascend"` every rank's engine needs its own hostname,
`ip:port:npu_<physical id>`, while one file serves all ranks: the file gives `ip:port` and each
rank adds its NPU (`gpu_id`, mapped to its physical id by ASCEND_RT_VISIBLE_DEVICES).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from kvhandoff.service.config import Config, ConfigError, load_config
from kvhandoff.transport.ascend import HOSTNAME, physical_npu
from kvhandoff.transport.config import MooncakeConfig

CONFIG_ENV = "SGLANG_KVHANDOFF_CONFIG"


def rank_config(
    env: Mapping[str, str],
    *,
    role: str,
    stage: dict[str, Any],
    rank_name: str,
    npu: int | None = None,
) -> Config:
    """The configuration of one rank's embedded service: the file, then this rank's role, stage
    table, a free port and its own state directory (`<server.state_dir>/<rank_name>`); under
    protocol `ascend`, the hostname of the rank's NPU (`npu`: SGLang's `gpu_id` on `--device
    npu`; `ascend_hostname`)."""
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
    overrides["server.state_dir"] = str(state_dir)
    if isinstance(base.transport, MooncakeConfig) and base.transport.protocol == "ascend":
        overrides["transport.hostname"] = ascend_hostname(base.transport.hostname, npu, env)
        overrides["transport.npu"] = npu  # current where the rank's engine starts
    return load_config(path, env, overrides)


def ascend_hostname(hostname: str, npu: int | None, env: Mapping[str, str]) -> str:
    """`hostname` (the file's `ip:port`) with `:npu_<physical id>` of logical NPU `npu` added.
    A hostname that names an NPU already is kept if it is this one (a single rank). ConfigError
    naming `transport.hostname` otherwise, or when the rank is not on an NPU."""
    if npu is None:
        raise ConfigError(
            "transport.protocol",
            "'ascend' moves NPU memory: start SGLang with --device npu, or use tcp or rdma",
        )
    try:
        physical = physical_npu(npu, env.get("ASCEND_RT_VISIBLE_DEVICES"))
    except ValueError as exc:
        raise ConfigError("transport.hostname", str(exc)) from None
    full = HOSTNAME.match(hostname)
    if full is not None:
        if int(full["npu"]) != physical:
            raise ConfigError(
                "transport.hostname",
                f"{hostname!r} names npu_{full['npu']}, but this rank runs on NPU {npu} "
                f"(physical id {physical}); give ip:port and each rank adds its own NPU",
            )
        return hostname
    if HOSTNAME.match(f"{hostname}:npu_{physical}") is None:
        raise ConfigError(
            "transport.hostname",
            f"{hostname!r} is not ip:port, to which each rank adds :npu_<physical id> under "
            "protocol 'ascend' (e.g. '10.0.0.5:15000')",
        )
    return f"{hostname}:npu_{physical}"


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
