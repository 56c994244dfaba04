"""The `ascend` protocol's requirements, checked before an engine starts or memory is registered.

Mooncake's Ascend transports (the HCCL one and Ascend Direct) document four facts, none of which
the engine reports clearly when missed (a glog line, an HCCL code, a hang until a timeout):

- the local hostname is `ip:port:npu_<physical id>` (the NPU's physical id, as `/etc/hccn.conf`
  and `npu-smi` number it, not the logical one ASCEND_RT_VISIBLE_DEVICES renumbers); peers still
  reach the engine at `ip:<rpc port>`;
- registered memory starts on a 2 MiB boundary (the device's page tables): torch and shm pools
  are allocated so (`kvhandoff.transport.config.alignment_for`); an engine's own buffers, registered
  as they are in direct mode, are checked (`misaligned`);
- `/etc/hccn.conf` exists (the engine reads the NPU's NIC address from it at start-up; in a
  container it must be mounted);
- the transports' own timeouts come from `ASCEND_CONNECT_TIMEOUT` and `ASCEND_TRANSFER_TIMEOUT`
  (whole milliseconds, 3000 each by default): kvhandoff sets them from its config
  (`MooncakeConfig.ascend_*_timeout_s`, in `MooncakeConfig.engine_env`), never the other way.

Callers: `kvhandoff.service.config` (the settings, at load) and
`kvhandoff.service.runtime.transport` (the host, at start-up) name the setting in a ConfigError;
`kvhandoff.transport.mooncake` checks both again for callers without the service, and the alignment
at `register`. Not yet run on Ascend hardware.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path

from kvhandoff.transport.config import ASCEND_ALIGN_BYTES, MooncakeConfig
from kvhandoff.transport.regions import Region

#: `ip:port:npu_<physical id>`: an IPv4 address or host name (Mooncake's Ascend transports take
#: no IPv6), a port, the NPU.
HOSTNAME = re.compile(r"^(?P<host>[^:\s]+):(?P<port>\d{1,5}):npu_(?P<npu>\d+)$")
#: Where the engine reads the NPU's network configuration (a fixed path in the engine).
HCCN_CONF = Path("/etc/hccn.conf")


def settings_problems(config: MooncakeConfig) -> list[tuple[str, str]]:
    """(key, why) for each setting of `config` the `ascend` protocol cannot start with (none
    for other protocols, except a hostname in the ascend form, which only ascend reads)."""
    problems: list[tuple[str, str]] = []
    m = HOSTNAME.match(config.hostname)
    if config.protocol != "ascend":
        if ":npu_" in config.hostname:
            problems.append(
                (
                    "hostname",
                    f"{config.hostname!r} names an NPU, which only protocol 'ascend' reads "
                    f"(protocol is {config.protocol!r}); give the IP alone",
                )
            )
        return problems
    if m is None:
        problems.append(
            (
                "hostname",
                f"{config.hostname!r} is not ip:port:npu_<physical id>, the form protocol "
                "'ascend' needs (e.g. '10.0.0.5:12345:npu_2'; an IPv4 address, no IPv6)",
            )
        )
    elif int(m["port"]) > 65535:
        problems.append(("hostname", f"port {m['port']} of {config.hostname!r} is above 65535"))
    return problems


def host_problem(hccn_conf: Path = HCCN_CONF) -> str | None:
    """Why this host cannot start an Ascend transport, or None."""
    try:
        with hccn_conf.open("rb") as f:
            f.read(1)
    except OSError as exc:
        return (
            f"protocol 'ascend' needs {hccn_conf} (the NPU's network configuration, which the "
            f"engine reads at start-up; in a container, mount the host's): {exc.strerror}"
        )
    return None


def misaligned(regions: Sequence[Region]) -> Region | None:
    """The first region not starting on a 2 MiB boundary, which the Ascend transports cannot
    register; None when all do."""
    return next((r for r in regions if r.addr % ASCEND_ALIGN_BYTES), None)


def physical_npu(logical: int, visible: str | None) -> int:
    """The physical id of the NPU a process numbers `logical`, under ASCEND_RT_VISIBLE_DEVICES
    `visible` (a comma list of physical ids; unset or empty: the ids are the same). ValueError
    naming the list when it has no such entry."""
    if not visible or not visible.strip():
        return logical
    ids = [part.strip() for part in visible.split(",")]
    if logical < 0 or logical >= len(ids) or not ids[logical].isdigit():
        raise ValueError(
            f"NPU {logical} is not in ASCEND_RT_VISIBLE_DEVICES={visible!r} (a comma list of "
            "physical NPU ids)"
        )
    return int(ids[logical])
