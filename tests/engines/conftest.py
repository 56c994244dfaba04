"""Real SGLang servers over kvhandoff on CPU: the model, the servers, the reference tokens.

Each server configuration is a session fixture, started once (sequentially: the servers share
a 2-core machine) when a test first needs it and stopped at the session's end. One decode
serves every prefill (SGLang's decode finds each request's prefill by its bootstrap
address): a PP 1 prefill with chunked prefill, and a PP 2 prefill (their command lines:
`servers.SERVERS`). The decode has the radix cache on and the fault hook on its PYTHONPATH
(active only for the rooms it names). A failure case kills the PP 1 prefill and starts it again
on its own ports (`Servers.restart`); the session's summary prints each server's start-up time.
"""

from __future__ import annotations

import asyncio
import os
import sys
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import aiohttp
import pytest

from tests.engines.client import Pair, prompts, single
from tests.engines.handoffs import Records, service_urls
from tests.engines.model import write_model
from tests.engines.servers import (
    CHUNK_TOKENS,
    SERVERS,
    Server,
    kvhandoff_env,
    write_kvhandoff_config,
)

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "sglang" / "stubs"))
os.environ["HF_HUB_OFFLINE"] = "1"

import sglang  # noqa: F401  -- fails the run (not skips it) outside `make sglang-env`

FAULTS = Path(__file__).resolve().parent / "faults"
T = TypeVar("T")


def run(coro_fn: Callable[[aiohttp.ClientSession], Awaitable[T]]) -> T:
    """Run `coro_fn(session)` on a fresh loop and client session."""

    async def main() -> T:
        connector = aiohttp.TCPConnector(limit=0)
        async with aiohttp.ClientSession(connector=connector) as session:
            return await coro_fn(session)

    return asyncio.run(main())


@pytest.fixture(scope="session")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("engines")


@pytest.fixture(scope="session")
def model(workdir: Path) -> Path:
    return write_model(workdir / "model")


@pytest.fixture(scope="session")
def kvhandoff_config(workdir: Path) -> Path:
    return write_kvhandoff_config(workdir)


#: Every server the session started, for the start-up times its summary reports.
STARTED: list[Server] = []


def pytest_terminal_summary(terminalreporter: Any) -> None:
    for server in STARTED:
        times = ", ".join(f"{t:.0f} s" for t in server.start_s) or "never healthy"
        terminalreporter.write_line(f"engine server {server.name}: healthy after {times}")


class Servers:
    """Starts the session's servers one at a time and stops them all at its end."""

    def __init__(self, workdir: Path, model: Path, config: Path) -> None:
        self.workdir, self.model, self.config = workdir, model, config
        self.started: list[Server] = []

    def start(self, name: str, **kw: Any) -> Server:
        """Start the server `name` of `SERVERS` (its arguments and environment there)."""
        args, env = SERVERS[name]
        env = {**kvhandoff_env(self.config), **env, **kw.pop("env", {})}
        server = Server(name, self.model, self.workdir, args, env=env, **kw)
        self.started.append(server)
        STARTED.append(server)
        server.start()
        server.wait_healthy()
        return server

    def restart(self, server: Server) -> None:
        """Start a killed server again on its own ports (its clients' addresses hold)."""
        server.start()
        server.wait_healthy()

    def stop_all(self) -> None:
        for server in reversed(self.started):
            server.stop()


@pytest.fixture(scope="session")
def servers(workdir: Path, model: Path, kvhandoff_config: Path) -> Iterator[Servers]:
    s = Servers(workdir, model, kvhandoff_config)
    try:
        yield s
    finally:
        s.stop_all()


@pytest.fixture(scope="session")
def single_server(servers: Servers) -> Server:
    """The reference: one plain server, no disaggregation."""
    return servers.start("single")


@pytest.fixture(scope="session")
def decode(servers: Servers) -> Server:
    return servers.start("decode", extra_path=[FAULTS])


@pytest.fixture(scope="session")
def decode_api(decode: Server) -> str:
    """The decode rank's kvhandoff service (its API and metrics)."""
    return service_urls(decode, "decode")[0]


@pytest.fixture(scope="session")
def decode_records(decode: Server, workdir: Path) -> Records:
    """The decode rank's handoff records (its state directory below the file's `state_dir`)."""
    return Records(workdir / "state" / "sglang-decode-dp0-pp0-tp0")


@pytest.fixture(scope="session")
def prefill(servers: Servers) -> Server:
    return servers.start("prefill")


@pytest.fixture(scope="session")
def prefill_pp2(servers: Servers) -> Server:
    return servers.start("prefill-pp2")


@pytest.fixture(scope="session")
def pair(prefill: Server, decode: Server) -> Pair:
    return Pair(prefill.url, prefill.bootstrap_port, decode.url)


@pytest.fixture(scope="session")
def pair_pp2(prefill_pp2: Server, decode: Server) -> Pair:
    return Pair(prefill_pp2.url, prefill_pp2.bootstrap_port, decode.url)


class Reference:
    """The single server's tokens per prompt, asked once per prompt."""

    def __init__(self, server: Server) -> None:
        self.server = server
        self.tokens: dict[tuple[int, ...], list[int]] = {}

    def of(self, batch: list[list[int]]) -> list[list[int]]:
        missing = [p for p in batch if tuple(p) not in self.tokens]
        if missing:

            async def ask(session: aiohttp.ClientSession) -> list[list[int]]:
                return list(
                    await asyncio.gather(*(single(session, self.server.url, p) for p in missing))
                )

            for p, out in zip(missing, run(ask), strict=True):
                self.tokens[tuple(p)] = out
        return [self.tokens[tuple(p)] for p in batch]


@pytest.fixture(scope="session")
def reference(single_server: Server) -> Reference:
    return Reference(single_server)


@pytest.fixture(scope="session")
def mixed_prompts() -> list[list[int]]:
    """Prompts below and above the chunk size (so the PP 1 prefill chunks some)."""
    return prompts(6, seed=1, min_len=8, max_len=3 * CHUNK_TOKENS)
