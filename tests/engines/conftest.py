"""Real SGLang servers over kvhandoff on CPU: the model, the servers, the reference tokens.

Each server configuration is started once, when a test first needs it (a pair's prefill and
decode together), and stopped at the session's end. One decode serves
every prefill (SGLang's decode finds each request's prefill by its bootstrap address): a PP 1
prefill with chunked prefill, and a PP 2 prefill (their command lines: `servers.SERVERS`). The
decode has the radix cache on and the fault hook on its PYTHONPATH (active only for the rooms
it names). A failure case kills the PP 1 prefill and starts it again on its own ports
(`Servers.restart`). The TP 2 pair runs last and alone (`alone` tests: every other server is
stopped first, so at most one server set is up); the single server's tokens it is compared
with are asked before. The session's summary prints each server's start-up times.
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

from tests.engines.client import Pair, connector, prompts, single
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
#: Servers with the fault hook on their PYTHONPATH (active only for the rooms it names).
FAULT_HOOKED = frozenset({"decode"})
T = TypeVar("T")


def run(coro_fn: Callable[[aiohttp.ClientSession], Awaitable[T]]) -> T:
    """Run `coro_fn(session)` on a fresh loop and client session."""

    async def main() -> T:
        async with aiohttp.ClientSession(connector=connector()) as session:
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


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """`alone` tests last: they stop every server the others use."""
    items.sort(key=lambda item: item.get_closest_marker("alone") is not None)


class Servers:
    """The session's servers by name: started when a case first needs them (a pair's two
    together), stopped all at the session's end."""

    def __init__(self, workdir: Path, model: Path, config: Path) -> None:
        self.workdir, self.model, self.config = workdir, model, config
        self.by_name: dict[str, Server] = {}

    def launch(self, name: str) -> Server:
        """Start the server `name` of `SERVERS` (its arguments and environment there; the
        decode's fault hook) without waiting for it; again on its own ports if it was
        stopped."""
        server = self.by_name.get(name)
        if server is None:
            args, env = SERVERS[name]
            env = {**kvhandoff_env(self.config), **env}
            hooks = [FAULTS] if name in FAULT_HOOKED else []
            server = Server(name, self.model, self.workdir, args, env=env, extra_path=hooks)
            self.by_name[name] = server
            STARTED.append(server)
        if server.proc is None:
            server.start()
        return server

    def start(self, name: str) -> Server:
        """The server `name`, up and healthy."""
        (server,) = self.up(name)
        return server

    def up(self, *names: str) -> list[Server]:
        """The servers `names`, up and healthy: those not running start together (a start is
        mostly single-threaded imports and warm-up, so two overlap on two cores)."""
        started = [self.launch(name) for name in names]
        for server in started:
            server.wait_healthy()
        return started

    def restart(self, server: Server) -> None:
        """Start a killed server again on its own ports (its clients' addresses hold)."""
        server.start()
        server.wait_healthy()

    def stop_all(self) -> None:
        for server in reversed(self.by_name.values()):
            server.stop()


@pytest.fixture(scope="session")
def servers(workdir: Path, model: Path, kvhandoff_config: Path) -> Iterator[Servers]:
    s = Servers(workdir, model, kvhandoff_config)
    try:
        yield s
    finally:
        s.stop_all()


@pytest.fixture(scope="session")
def decode(servers: Servers) -> Server:
    return servers.start("decode")


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
def pair(servers: Servers) -> Pair:
    prefill, decode = servers.up("prefill", "decode")
    return Pair(prefill.url, prefill.bootstrap_port, decode.url)


@pytest.fixture(scope="session")
def pair_pp2(prefill_pp2: Server, decode: Server) -> Pair:
    return Pair(prefill_pp2.url, prefill_pp2.bootstrap_port, decode.url)


class Reference:
    """The single server's tokens per prompt, asked once per prompt (the server is started
    when a prompt is first missing)."""

    def __init__(self, servers: Servers) -> None:
        self.servers = servers
        self.tokens: dict[tuple[int, ...], list[int]] = {}

    def of(self, batch: list[list[int]]) -> list[list[int]]:
        missing = [p for p in batch if tuple(p) not in self.tokens]
        if missing:
            url = self.servers.start("single").url

            async def ask(session: aiohttp.ClientSession) -> list[list[int]]:
                return list(await asyncio.gather(*(single(session, url, p) for p in missing)))

            for p, out in zip(missing, run(ask), strict=True):
                self.tokens[tuple(p)] = out
        return [self.tokens[tuple(p)] for p in batch]


@pytest.fixture(scope="session")
def reference(servers: Servers) -> Reference:
    return Reference(servers)


@pytest.fixture(scope="session")
def mixed_prompts() -> list[list[int]]:
    """Prompts below and above the chunk size (so the PP 1 prefill chunks some)."""
    return prompts(6, seed=1, min_len=8, max_len=3 * CHUNK_TOKENS)
