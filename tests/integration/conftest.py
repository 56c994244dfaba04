"""Fixtures for integration tests that run the services as real processes."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import aiohttp
import pytest

from kvhandoff.service.testing.deployment import LocalDeployment

DeploymentFactory = Callable[..., LocalDeployment]

#: Small pools: these tests check behaviour, not capacity.
SMALL: dict[str, Any] = {
    "model": {"scale": 64, "page_size": 16, "num_layers": 16},
    "num_pages": 64,
    "num_slots": 8,
}


@pytest.fixture
def deployment() -> Iterator[DeploymentFactory]:
    """`deployment(**kwargs)` → a started `LocalDeployment` (small pools unless overridden),
    closed after the test whatever happened."""
    started: list[LocalDeployment] = []

    def factory(**kwargs: Any) -> LocalDeployment:
        dep = LocalDeployment(**{**SMALL, **kwargs})
        started.append(dep)
        return dep.start()

    yield factory
    for dep in started:
        dep.close()


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    """A client session for the test's requests to the services."""
    async with aiohttp.ClientSession() as session:
        yield session
