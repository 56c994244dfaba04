from __future__ import annotations

from pathlib import Path

import pytest

from kvhandoff.service.config import ConfigError, transport_backends
from kvhandoff.service.http.app import LOCAL_TARGET, READINESS
from kvhandoff.service.runtime.transport import (
    OPENERS,
    TRANSPORT,
    check_ascend,
    install_transport,
    open_transport,
    with_stage_npu,
)
from kvhandoff.service.serve import serve
from kvhandoff.transport.errors import TransportError
from kvhandoff.transport.local import LocalTransport
from tests.unit.service.conftest import ClientFactory, make_config


async def test_local_transport_lives_with_the_app(make_client: ClientFactory) -> None:
    config = make_config(**{"transport.backend": "local"})
    client = await make_client(config, [install_transport])
    app = client.app
    assert app is not None
    transport = app[TRANSPORT]
    assert isinstance(transport, LocalTransport)
    assert app[LOCAL_TARGET] == transport.local_target
    response = await client.get("/readyz")
    assert (response.status, (await response.json())["checks"]) == (200, ["transport"])
    await client.close()
    with pytest.raises(TransportError, match="closed"):  # closed with the app
        transport.register([])


def test_every_transport_backend_has_one_opener() -> None:
    # A backend added to the config union without its line in OPENERS would fail at start-up.
    assert set(OPENERS) == set(transport_backends().values())
    assert set(transport_backends()) == {"mooncake", "local"}


def test_local_opener_takes_the_local_caps() -> None:
    config = make_config(**{"transport.backend": "local", "transport.max_bytes_per_batch": 8192})
    transport = open_transport(config.transport)
    try:
        assert isinstance(transport, LocalTransport)
        assert transport.max_call_s == config.transport.max_call_s
        assert with_stage_npu(config) is config.transport  # no NPU to pick without Mooncake
    finally:
        transport.close()


async def test_not_ready_before_start() -> None:
    from kvhandoff.service.http.app import create_app

    app = create_app(make_config(), extensions=[install_transport])
    assert await app[READINESS].failing() == ["transport"]


@pytest.mark.integration
async def test_mooncake_transport_starts_on_loopback() -> None:
    pytest.importorskip("mooncake.engine")
    config = make_config(**{"transport.backend": "mooncake", "server.port": 0})
    async with serve(config, [install_transport]) as server:
        assert server.app[LOCAL_TARGET].startswith("127.0.0.1:")
        assert await server.app[READINESS].failing() == []


@pytest.mark.parametrize(
    ("settings", "field", "named"),
    [
        ({"transport.hostname": "10.0.0.5:15000"}, "transport.hostname", "ip:port:npu_"),
        ({"transport.hostname": "10.0.0.5:1:npu_0"}, "transport.protocol", "needs "),
    ],
)
def test_an_ascend_transport_that_cannot_start_is_a_config_error_naming_the_key(
    tmp_path: Path, settings: dict[str, str], field: str, named: str
) -> None:
    config = make_config(**{"transport.protocol": "ascend", **settings})
    with pytest.raises(ConfigError) as err:
        check_ascend(config.transport, tmp_path / "hccn.conf")  # a host without it
    assert err.value.context["field"] == field and named in err.value.message
    (tmp_path / "hccn.conf").write_text("address_0=192.168.100.100\n")
    if field == "transport.protocol":
        check_ascend(config.transport, tmp_path / "hccn.conf")  # the same config, starts


async def test_the_service_does_not_start_an_ascend_engine_it_cannot_start(
    make_client: ClientFactory,
) -> None:
    config = make_config(**{"transport.protocol": "ascend", "transport.hostname": "10.0.0.5"})
    with pytest.raises(ConfigError, match=r"^transport\.hostname: '10\.0\.0\.5' is not"):
        await make_client(config, [install_transport])


def test_the_ascend_timeouts_are_settings_of_their_own() -> None:
    config = make_config(**{"transport.ascend_transfer_timeout_s": 12.5})
    assert config.transport.ascend_transfer_timeout_s == 12.5
    with pytest.raises(ConfigError) as err:
        make_config(**{"transport.ascend_connect_timeout_s": 0})
    assert err.value.context["field"] == "transport.ascend_connect_timeout_s"


@pytest.mark.parametrize(
    ("settings", "npu"),
    [
        ({"transport.protocol": "ascend", "stages": [{"num_pages": 4, "pool": "torch:npu:3"}]}, 3),
        ({"transport.protocol": "ascend", "stages": [{"num_pages": 4, "pool": "torch:npu"}]}, 0),
        (
            {
                "transport.protocol": "ascend",
                "transport.npu": 1,
                "stages": [{"num_pages": 4, "pool": "torch:npu:3"}],
            },
            1,
        ),
        ({"transport.protocol": "ascend"}, None),  # host pools: the engine's own choice
        ({"stages": [{"num_pages": 4, "pool": "torch:npu:3"}]}, None),  # tcp sets no NPU
    ],
)
def test_an_ascend_engine_starts_on_the_npu_of_its_stage_pools(
    settings: dict[str, object], npu: int | None
) -> None:
    assert with_stage_npu(make_config(**settings)).npu == npu
