from __future__ import annotations

import pytest

from service.http.app import LOCAL_TARGET, READINESS
from service.runtime.transport import TRANSPORT, install_transport
from service.serve import serve
from tests.unit.service.conftest import ClientFactory, make_config
from transport.errors import TransportError
from transport.local import LocalTransport


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


async def test_not_ready_before_start() -> None:
    from service.http.app import create_app

    app = create_app(make_config(), extensions=[install_transport])
    assert await app[READINESS].failing() == ["transport"]


@pytest.mark.integration
async def test_mooncake_transport_starts_on_loopback() -> None:
    pytest.importorskip("mooncake.engine")
    config = make_config(**{"transport.backend": "mooncake", "server.port": 0})
    async with serve(config, [install_transport]) as server:
        assert server.app[LOCAL_TARGET].startswith("127.0.0.1:")
        assert await server.app[READINESS].failing() == []
