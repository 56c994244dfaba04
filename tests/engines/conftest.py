"""Real SGLang servers over kvhandoff on CPU: the model, the servers, the reference tokens.

Each server configuration is a session fixture, started once (sequentially: the servers share
a 2-core machine) when a test first needs it and stopped at the session's end. One decode
serves every prefill (SGLang's decode finds each request's prefill by its bootstrap
address): a PP 1 prefill with chunked prefill, and a PP 2 prefill. The decode has the radix
cache on and the negative control's fault hook on its PYTHONPATH (active only for the rooms
it names).
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
from tests.engines.model import write_model
from tests.engines.servers import DECODE, PD, Server

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "sglang" / "stubs"))
os.environ["HF_HUB_OFFLINE"] = "1"

import sglang  # noqa: F401  -- fails the run (not skips it) outside `make sglang-env`

FAULTS = Path(__file__).resolve().parent / "faults"
SECRET = "engine-tests-peer-secret"
#: Prompts longer than this are prefilled in chunks by the PP 1 prefill.
CHUNK_TOKENS = 32
#: The decode's KV pool in tokens: 32 requests of up to 96 tokens fit at once (a request the
#: decode cannot give pages waits in its queue while the prefill's handoff deadline runs);
#: pages of finished and failed requests are reused by the next ones.
DECODE_TOKENS = 4096
#: kvhandoff's deadline for a handoff (a decode-only request fails at it).
DEADLINE_S = 90.0
#: `handoff.max_grace_s`: how long past the deadline a release may take.
MAX_GRACE_S = 60.0
#: SGLang's deferred-release timeout for the decode: the longest kvhandoff may hold the pages.
RELEASE_S = DEADLINE_S + MAX_GRACE_S
RADIX = ["--disaggregation-decode-enable-radix-cache"]
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
    """The SGLang backend's kvhandoff settings (`SGLANG_KVHANDOFF_CONFIG`) for every server: a
    peer silent for 15 s is lost (a scheduler starved on a loaded 2-core machine went silent for
    3 s and failed live handoffs as unreachable)."""
    path = workdir / "kvhandoff.toml"
    path.write_text(
        f'[server]\nstate_dir = "{workdir / "state"}"\n[auth]\npeer = "{SECRET}"\n'
        "[transfer]\nlanding_bytes = 16777216\nwindow_bytes = 1048576\n"
        f"staging_bytes = 16777216\n[handoff]\ndefault_deadline_s = {DEADLINE_S}\n"
        "heartbeat_interval_s = 1.0\npeer_timeout_s = 15.0\n"
        f"max_grace_s = {MAX_GRACE_S}\n"
    )
    return path


class Servers:
    """Starts the session's servers one at a time and stops them all at its end."""

    def __init__(self, workdir: Path, model: Path, config: Path) -> None:
        self.workdir, self.model, self.config = workdir, model, config
        self.started: list[Server] = []

    def start(self, name: str, args: list[str], **kw: Any) -> Server:
        env = {
            "SGLANG_KVHANDOFF_CONFIG": str(self.config),
            # SGLang holds a failed request's decode pages until kvhandoff released them or this
            # passes; a decode refuses to start where it is below deadline + max_grace_s.
            "SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE_TIMEOUT": str(int(RELEASE_S)),
            **kw.pop("env", {}),
        }
        server = Server(name, self.model, self.workdir, args, env=env, **kw)
        self.started.append(server)
        server.start()
        server.wait_healthy()
        return server

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
    return servers.start("single", ["--max-total-tokens", "4096"])


@pytest.fixture(scope="session")
def decode(servers: Servers) -> Server:
    return servers.start(
        "decode",
        [
            *PD,
            *DECODE,
            "--disaggregation-decode-enable-radix-cache",
            "--max-total-tokens",
            str(DECODE_TOKENS),
        ],
        extra_path=[FAULTS],
    )


def prefill_args(*extra: str) -> list[str]:
    return [*PD, "--disaggregation-mode", "prefill", "--max-total-tokens", "4096", *extra]


#: The PP 1 prefill: chunked (SGLang's early send of a computed prefix creates a CUDA event,
#: which its CPU scheduler cannot: off, chunks are still sent one by one).
CHUNKED = {
    "args": prefill_args("--chunked-prefill-size", str(CHUNK_TOKENS)),
    "env": {"SGLANG_DISAGG_PREFILL_EARLY_SEND_CACHED_PREFIX": "0"},
}


@pytest.fixture(scope="session")
def prefill(servers: Servers) -> Server:
    return servers.start("prefill", CHUNKED["args"], env=dict(CHUNKED["env"]))


@pytest.fixture(scope="session")
def prefill_pp2(servers: Servers) -> Server:
    return servers.start("prefill-pp2", prefill_args("--pp-size", "2"))


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
