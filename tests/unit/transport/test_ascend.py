"""Protocol `ascend`: its settings, host and memory requirements, checked before the engine sees
them (`kvhandoff.transport.ascend`), and its timeouts passed to the engine from the config."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from kvhandoff.transport.ascend import host_problem, misaligned, physical_npu, settings_problems
from kvhandoff.transport.config import ASCEND_ALIGN_BYTES, MooncakeConfig
from kvhandoff.transport.errors import TransportError
from kvhandoff.transport.mooncake_engine import start_engine
from kvhandoff.transport.regions import Region
from tests.fakes import FakeEngine
from tests.unit.transport.conftest import fake_transport


@pytest.mark.parametrize(
    "hostname", ["10.0.0.5:12345:npu_2", "0.0.0.0:15000:npu_15", "node-7:1:npu_0"]
)
def test_the_ascend_hostname_form_passes(hostname: str) -> None:
    assert settings_problems(MooncakeConfig(protocol="ascend", hostname=hostname)) == []


@pytest.mark.parametrize(
    ("protocol", "hostname", "named"),
    [
        ("ascend", "10.0.0.5", "'10.0.0.5' is not ip:port:npu_<physical id>"),
        ("ascend", "10.0.0.5:12345", "is not ip:port:npu_<physical id>"),
        ("ascend", "10.0.0.5:12345:npu_", "is not ip:port:npu_<physical id>"),
        ("ascend", "10.0.0.5:12345:2", "is not ip:port:npu_<physical id>"),
        ("ascend", "::1:12345:npu_2", "no IPv6"),
        ("ascend", "10.0.0.5:99999:npu_2", "port 99999 of '10.0.0.5:99999:npu_2' is above 65535"),
        ("tcp", "10.0.0.5:12345:npu_2", "names an NPU, which only protocol 'ascend' reads"),
        ("rdma", "10.0.0.5:1:npu_0", "(protocol is 'rdma')"),
    ],
)
def test_a_hostname_the_protocol_cannot_start_with_is_named(
    protocol: str, hostname: str, named: str
) -> None:
    config = MooncakeConfig(protocol=protocol, hostname=hostname)  # type: ignore[arg-type]
    [(key, why)] = settings_problems(config)
    assert key == "hostname" and named in why


def test_other_protocols_take_their_hostname_unchecked() -> None:
    assert settings_problems(MooncakeConfig(protocol="tcp", hostname="10.0.0.5")) == []


def test_the_host_needs_hccn_conf(tmp_path: Path) -> None:
    conf = tmp_path / "hccn.conf"
    assert "needs " + str(conf) in (host_problem(conf) or "")
    assert "No such file or directory" in (host_problem(conf) or "")
    conf.write_text("address_0=192.168.100.100\nnetmask_0=255.255.255.0\n")
    assert host_problem(conf) is None


def test_registered_memory_must_start_on_a_2_mib_boundary() -> None:
    aligned = [Region(ASCEND_ALIGN_BYTES, 4096), Region(7 * ASCEND_ALIGN_BYTES, 1)]
    assert misaligned(aligned) is None
    assert misaligned([*aligned, Region(ASCEND_ALIGN_BYTES + 4096, 64)]) == Region(
        ASCEND_ALIGN_BYTES + 4096, 64
    )


def test_an_ascend_transport_refuses_unaligned_memory_before_the_engine_sees_it() -> None:
    engine = FakeEngine()
    transport = fake_transport(engine, protocol="ascend", hostname="10.0.0.5:1:npu_0")
    # Regions at chosen offsets from a 2 MiB boundary inside host memory (never dereferenced).
    memory = np.zeros(3 * ASCEND_ALIGN_BYTES, dtype=np.uint8)
    base = -int(memory.ctypes.data) % ASCEND_ALIGN_BYTES + int(memory.ctypes.data)
    with pytest.raises(TransportError) as err:
        transport.register([Region(base, 4096), Region(base + ASCEND_ALIGN_BYTES + 64, 64)])
    assert "2 MiB-aligned addresses only" in str(err.value)
    assert f"{base + ASCEND_ALIGN_BYTES + 64:#x} (64 bytes)" in str(err.value)
    assert engine.registered == {}  # nothing reached the engine
    transport.register([Region(base, ASCEND_ALIGN_BYTES)])
    assert list(engine.registered) == [base]
    tcp = fake_transport(FakeEngine())  # other protocols register any address
    tcp.register([Region(base + 64, 64)])


def test_the_engine_is_not_started_with_settings_it_cannot_use() -> None:
    with pytest.raises(TransportError) as err:
        start_engine(MooncakeConfig(protocol="ascend", hostname="10.0.0.5"))
    assert "hostname: '10.0.0.5' is not ip:port:npu_<physical id>" in str(err.value)
    with pytest.raises(TransportError) as err:
        start_engine(MooncakeConfig(protocol="tcp", hostname="127.0.0.1:1:npu_0"))
    assert "hostname: '127.0.0.1:1:npu_0' names an NPU" in str(err.value)


def test_the_ascend_timeouts_reach_the_engine_in_whole_milliseconds_and_bound_a_call() -> None:
    tcp = MooncakeConfig(ascend_connect_timeout_s=9.0)
    assert not {"ASCEND_CONNECT_TIMEOUT", "ASCEND_TRANSFER_TIMEOUT"} & set(tcp.engine_env())
    default = MooncakeConfig(protocol="ascend", hostname="10.0.0.5:1:npu_0")
    env = default.engine_env()
    assert (env["ASCEND_CONNECT_TIMEOUT"], env["ASCEND_TRANSFER_TIMEOUT"]) == ("3000", "3000")
    assert env["MC_TRANSFER_TIMEOUT"] == "10"
    assert default.max_call_s == MooncakeConfig().max_call_s  # 3 + 3 s within the 10 s
    slow = MooncakeConfig(
        protocol="ascend",
        hostname="10.0.0.5:1:npu_0",
        ascend_connect_timeout_s=2.0001,  # rounded up: a bound is never shortened
        ascend_transfer_timeout_s=12.5,
        max_bytes_per_batch=1 << 20,
    )
    env = slow.engine_env()
    assert (env["ASCEND_CONNECT_TIMEOUT"], env["ASCEND_TRANSFER_TIMEOUT"]) == ("2001", "12500")
    assert slow.max_call_s == pytest.approx(0.5 + 2.0001 + 12.5 + (1 << 20) / 1e9)


@pytest.mark.parametrize(
    ("logical", "visible", "physical"),
    [(3, None, 3), (3, "", 3), (0, "4,5,6,7", 4), (2, " 4, 5 ,6 ", 6)],
)
def test_a_logical_npu_maps_to_its_physical_id(
    logical: int, visible: str | None, physical: int
) -> None:
    assert physical_npu(logical, visible) == physical


@pytest.mark.parametrize(("logical", "visible"), [(2, "4,5"), (0, "a,b"), (-1, "4")])
def test_an_npu_not_in_the_visible_list_is_named(logical: int, visible: str) -> None:
    with pytest.raises(ValueError, match=f"NPU {logical} is not in ASCEND_RT_VISIBLE_DEVICES"):
        physical_npu(logical, visible)
