"""`kvhandoff serve`: run one prefill or decode service from a TOML config.

`run(args)` is the only place that reads `os.environ` (for `load_config`'s overrides). `serve()`
is the in-process entry point (tests, embedding, `kvhandoff demo`): an async context manager that
starts the app on a TCP port and, on exit, stops it and runs every cleanup context.
`install_service` is the whole service of the configured role as one extension: the role's
runtime (`kvhandoff.service.runtime.roles`, built by one function per role) and every route module,
which only declare routes and hooks, so the order they are installed in does not matter.
"""

from __future__ import annotations

import argparse
import asyncio
import errno
import gc
import logging
import os
import signal
import socket
import sys
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass

import msgspec
import uvloop
from aiohttp import web

from kvhandoff.service.api.batches import install_batches
from kvhandoff.service.api.dashboard import install_dashboard
from kvhandoff.service.api.events import install_events
from kvhandoff.service.api.handoffs import install_handoffs
from kvhandoff.service.api.metrics import install_metrics
from kvhandoff.service.api.validate import install_validate
from kvhandoff.service.api.webhooks import install_webhooks
from kvhandoff.service.config import (
    Config,
    ConfigError,
    advisories,
    backend_of,
    load_config,
)
from kvhandoff.service.http.app import LOCAL_TARGET, AccessLogger, Extension, create_app
from kvhandoff.service.http.server import ProblemAppRunner
from kvhandoff.service.runtime.roles import install_runtime
from kvhandoff.service.runtime.stages import Buffers

log = logging.getLogger("kvhandoff.service")

#: How long shutdown waits for in-flight requests (SSE streams included) before closing them.
SHUTDOWN_TIMEOUT_S = 5.0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", "-c", required=True, metavar="FILE", help="TOML config file")
    parser.add_argument("--role", choices=["prefill", "decode"], help="overrides role")
    parser.add_argument("--host", help="overrides server.host")
    parser.add_argument("--port", type=int, help="overrides server.port")
    parser.add_argument("--token", help="overrides server.token (prefer KVHANDOFF_SERVER__TOKEN)")
    parser.add_argument(
        "--log-level",
        choices=["debug", "info", "warning", "error"],
        help="overrides server.log_level",
    )
    parser.add_argument(
        "--check",
        action="store_true",
        help="load and validate the config (file, KVHANDOFF_* variables, flags), then exit: "
        "0 when it is valid, 2 (one line naming the key) when not",
    )


def cli_overrides(args: argparse.Namespace) -> dict[str, object]:
    flags = {
        "role": args.role,
        "server.host": args.host,
        "server.port": args.port,
        "server.token": args.token,
        "server.log_level": args.log_level,
    }
    return {key: value for key, value in flags.items() if value is not None}


def run(args: argparse.Namespace) -> int:
    try:
        config = load_config(args.config, os.environ, cli_overrides(args))
    except ConfigError as exc:
        # One line, so a deploy check or a container log shows the whole reason (a TOML parse
        # error quotes the file's lines).
        print(f"kvhandoff serve: {' '.join(str(exc).split())}", file=sys.stderr)
        return 2
    if args.check:
        stages = ", ".join(str(s.pp_rank) for s in config.stages)
        print(
            f"kvhandoff serve: {args.config}: valid ({config.role}, stages {stages} of "
            f"{config.pp_size}, port {config.server.port}, public_url {config.server.public_url})"
        )
        for advice in advisories(config):
            print(f"kvhandoff serve: warning: {advice}")
        return 0
    setup_logging(config.server.log_level)
    tune_collector()
    try:
        return uvloop.run(_serve_until_signalled(config))
    except ConfigError as exc:  # found only at start-up: a state_dir in use, a missing pool
        print(f"kvhandoff serve: {' '.join(str(exc).split())}", file=sys.stderr)
        return 2
    except OSError as exc:
        if exc.errno != errno.EADDRINUSE:
            raise
        server = config.server
        print(
            f"kvhandoff serve: server.port: {server.host}:{server.port} is in use by another "
            "process (set server.port or --port)",
            file=sys.stderr,
        )
        return 2


#: The cyclic garbage collector's thresholds in a service process (CPython's are 700, 10, 10).
#: A handoff in flight lives across thousands of allocations (its tasks, frames, messages):
#: at 700 its objects are promoted to the oldest generation, die there, and count towards a
#: full collection, which walks every live object (the held handoffs, every module's). A
#: young generation of 20,000 collects them while young. One-page handoffs at concurrency 64
#: (docs/performance): the decode spent about 11% of its CPU collecting at the default, under
#: 2% with these. Not set in embedded services: the engine's process keeps its own policy.
GC_THRESHOLDS = (20_000, 20, 10)


def tune_collector() -> None:
    """Set `GC_THRESHOLDS` for this service process (`kvhandoff serve` only)."""
    gc.set_threshold(*GC_THRESHOLDS)


def setup_logging(level: str) -> None:
    logging.basicConfig(
        level=level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )


def install_service(app: web.Application, buffers: Buffers | None = None) -> None:
    """The whole service of `app[CONFIG].role` (an `Extension`; `buffers`: an embedding
    engine's own, per pp_rank). The route modules install in any order: each declares its
    routes, and what needs the running runtime waits for it (`kvhandoff.service.runtime.roles`)."""
    install_runtime(app, buffers)
    install_validate(app)
    install_handoffs(app)
    install_batches(app)
    install_events(app)
    install_metrics(app)
    install_dashboard(app)
    install_webhooks(app)


def service_with(buffers: Buffers | None) -> Extension:
    """`install_service` over an embedding engine's `buffers`."""

    def install(app: web.Application) -> None:
        install_service(app, buffers)

    return install


async def _serve_until_signalled(config: Config) -> int:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    async with serve(config, [install_service]):
        _freeze_start_up()
        await stop.wait()
        log.info("signal received, shutting down")
    return 0


def _freeze_start_up() -> None:
    """Move what start-up built (modules, the app, the runtime: live for the process's life)
    out of the collector's reach, so a full collection walks only what requests created. Under
    load a full collection came every few seconds and walked ~200k start-up objects, ~100 ms of
    the event loop each (40-60 us per handoff). Only here, in a process of its own: an engine
    embedding the service keeps its own objects collectable."""
    gc.collect()
    gc.freeze()
    log.info("%d start-up objects frozen out of garbage collection", gc.get_freeze_count())


@dataclass(frozen=True, slots=True)
class Server:
    """A running service: its app, its effective config (real port) and its public URL."""

    app: web.Application
    config: Config

    @property
    def url(self) -> str:
        return self.config.server.public_url


@asynccontextmanager
async def serve(
    config: Config,
    extensions: Sequence[Extension] = (),
    *,
    shutdown_timeout_s: float = SHUTDOWN_TIMEOUT_S,
) -> AsyncIterator[Server]:
    """Start the service on `server.host:server.port` (port 0: any free port, and the config the
    app sees carries the real port and URL); stop it, cleanup contexts included, on exit."""
    sock = None
    if config.server.port == 0:
        # Bind first so the app is created with its real URL (peers and webhooks need it).
        sock = socket.create_server((config.server.host, 0))
        config = _with_port(config, sock.getsockname()[1])
    app = create_app(config, extensions=extensions)
    runner = ProblemAppRunner(
        app,
        access_log_class=AccessLogger,
        access_log=logging.getLogger("kvhandoff.access"),
        handle_signals=False,
        shutdown_timeout=shutdown_timeout_s,
    )
    try:
        # Runs the cleanup contexts' start halves; if one fails, aiohttp closes those already
        # started (the transport, the peer client) and the `finally` below frees the socket.
        await runner.setup()
        site: web.BaseSite = (
            web.SockSite(runner, sock)
            if sock is not None
            else web.TCPSite(runner, config.server.host, config.server.port)
        )
        await site.start()
        log.info(
            "kvhandoff %s serving at %s (listening on %s:%d, transport %s, target %s)",
            config.role,
            config.server.public_url,
            config.server.host,
            config.server.port,
            backend_of(config.transport),
            app.get(LOCAL_TARGET, "-"),
        )
        for advice in advisories(config):
            log.warning("config: %s", advice)
        yield Server(app, config)
    finally:
        await runner.cleanup()
        if sock is not None:
            sock.close()


def _with_port(config: Config, port: int) -> Config:
    server = config.server
    derived = server.public_url == f"http://{server.host}:{server.port}"
    fields = {**msgspec.to_builtins(server), "port": port}
    if derived:
        fields["public_url"] = ""  # re-derived by ServerConfig.__post_init__ (replace() skips it)
    return msgspec.structs.replace(config, server=msgspec.convert(fields, type(server)))
