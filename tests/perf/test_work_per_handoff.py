"""The work-per-handoff gate: counts what one handoff costs on the hot path and fails when a change
adds to it.

A throughput benchmark in CI is noise on a shared machine; these counts are not. A decode
service and its prefill services (one per PP stage) run in this process on one event loop, with
the real Mooncake engine over TCP on loopback, records in SQLite and signed peer messages; a
driver plays the router and the engines (create, stage ready, read the outcome) one handoff at
a time. After `WARMUP` handoffs (connections, layouts, pairings, caches), each of `MEASURED`
handoffs is counted from a settled start to a settled end (no engine call in flight, no service
callback for a while), and the table holds the mean per handoff:

- `sqlite.statements.<side>`, `sqlite.commits.<side>`: statements SQLite ran (its trace
  callback) and the transactions among them that wrote: each `COMMIT`, and each write outside
  `BEGIN ... COMMIT` (the records' connection is in autocommit mode: such a write is a
  transaction, and a WAL commit, of its own);
- `http.<from>-><to> <METHOD> <route>` and `http.requests.<side>`: client requests a service
  made (aiohttp's client, and the webhook sender's own), by peer and route (ids as `{id}`,
  numbers as `{n}`); the driver's own are not counted, the services' work to answer them is;
- `encode.calls.<side>`, `encode.bytes.<side>`: JSON encodes (every module-level
  `msgspec.json.Encoder` of the service's modules, `msgspec.json.encode`, `json.dumps`);
- `mooncake.engine_calls.<side>`, `mooncake.batches.<side>`: engine calls and batches, from each
  transport's own stats;
- `loop.callbacks.<side>`: event-loop callbacks run (`asyncio.Handle._run`: task steps, future
  callbacks, I/O and timer callbacks); `threads` are those the engine's worker threads post.

A count belongs to the side whose context it ran in: each service is started in its own
`contextvars` context, which its tasks, server connections and callbacks inherit.

What keeps the counts deterministic: one handoff at a time (nothing coalesces by chance), and
with PP > 1 one stage at a time, each stage's arrival settled before the next stage is signalled
(the decode's records commit in groups, one per turn of its loop: concurrent arrivals would share
a commit, and an encode of the progress, or not, by timing; one at a time, every arrival has a
group of its own, the worst case, every run); every service on one loop (a sender's writes are
all in the socket before the receiver reads); each handoff settled before the next (its release
and confirmations are its own); the outcome asked for by long poll right after the last stage is
signalled, as a router does (the transfer takes a worker thread's round trip and a peer request,
so the poll always waits); and no timer inside the window: heartbeats and the WAL checkpoint
chore are moved out of reach (they are per second, not per handoff; their cost is not what this
gate watches). Not counted: syscalls (no deterministic in-process count; `strace -c` on a bench
run shows them).

Budgets live in `work_budgets.toml` beside this file. `pytest tests/perf -s` prints the table;
the failure message carries it too; `pytest tests/perf --write-work-budgets` rewrites the
budgets from the counts measured (after a change that removes work).
"""

from __future__ import annotations

import asyncio
import asyncio.events
import contextvars
import itertools
import json
import math
import re
import shutil
import sqlite3
import sys
import tempfile
import threading
import time
import tomllib
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import msgspec
import pytest
from yarl import URL

import kvhandoff.service.runtime.persistence
from kvhandoff.service.config import Config, load_config
from kvhandoff.service.records.handoffs import HandoffRecords
from kvhandoff.service.runtime.transport import TRANSPORT
from kvhandoff.service.serve import Server, install_service, serve
from kvhandoff.service.webhooks.sender import Sender
from tests.receivers import WebhookReceiver

pytest.importorskip("mooncake.engine")

BUDGETS = Path(__file__).with_name("work_budgets.toml")
WARMUP = 10
MEASURED = 20
#: A settled service: this many sleeps of `SETTLE_SLEEP_S` in a row without one of its callbacks.
SETTLE_QUIET = 3
SETTLE_SLEEP_S = 0.005
#: Bounds only a failing test: a handoff or a settle taking this long is a hang.
WAIT_S = 30.0
#: Timers moved out of the measured windows (they tick per second, not per handoff).
QUIET_S = 3600.0

ROUTER, ENGINE, PEER = "gate-router-token", "gate-engine-token", "gate-peer-secret"

#: Statements that write: outside `BEGIN ... COMMIT` each is a transaction of its own (the
#: records' connection is in autocommit mode), so each is a commit.
WRITES = frozenset({"INSERT", "UPDATE", "DELETE", "REPLACE", "CREATE", "DROP", "ALTER"})

SIDE: contextvars.ContextVar[str] = contextvars.ContextVar("kvhandoff_gate_side", default="")
DRIVER = "driver"


@dataclass(frozen=True)
class Case:
    name: str
    pp_size: int
    model: dict[str, Any]
    #: A webhook endpoint registered for every handoff event (the outbox and its deliveries).
    webhooks: bool = False


#: `pp1` is `kvhandoff bench handoff --cases small` one at a time; `pp4` the same over PP=4
#: stages, one prefill service each; `pp1-webhooks` is `pp1` with a router's webhook endpoint.
CASES = [
    Case("pp1", 1, {"preset": "dense-mha", "scale": 64, "num_layers": 4}),
    Case("pp4", 4, {"preset": "dense-mha", "scale": 64, "num_layers": 8}),
    Case("pp1-webhooks", 1, {"preset": "dense-mha", "scale": 64, "num_layers": 4}, webhooks=True),
]
NUM_PAGES = 64


# -- counting ------------------------------------------------------------------------------------


class Tally:
    """Counts by key, from any thread; keys of the driver are dropped."""

    def __init__(self) -> None:
        self.counts: Counter[str] = Counter()
        self._lock = threading.Lock()

    def add(self, key: str, n: int = 1, side: str | None = None) -> None:
        who = SIDE.get() if side is None else side
        if who == DRIVER:
            return
        with self._lock:
            self.counts[key.replace("{side}", who or "threads")] += n

    def snapshot(self) -> Counter[str]:
        with self._lock:
            return Counter(self.counts)


class CountingEncoder:
    """A `msgspec.json.Encoder` that tallies its encodes (the type cannot be patched)."""

    def __init__(self, inner: msgspec.json.Encoder, tally: Tally) -> None:
        self._inner = inner
        self._tally = tally

    def encode(self, obj: Any) -> bytes:
        out = self._inner.encode(obj)
        self._tally.add("encode.calls.{side}")
        self._tally.add("encode.bytes.{side}", len(out))
        return out

    def encode_into(self, obj: Any, buffer: bytearray, offset: int = 0) -> None:
        start = len(buffer) if offset < 0 else offset  # -1: append
        self._inner.encode_into(obj, buffer, offset)
        self._tally.add("encode.calls.{side}")
        self._tally.add("encode.bytes.{side}", len(buffer) - start)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


class Routes:
    """Names a request by where it goes: `<peer> <METHOD> <path>` (ids `{id}`, numbers `{n}`)."""

    def __init__(self) -> None:
        self.peers: dict[int | None, str] = {}

    def name(self, method: str, url: URL) -> str:
        parts = [
            "{id}" if re.fullmatch(r"gate\d+", p) else "{n}" if p.isdigit() else p
            for p in url.path.split("/")
        ]
        return f"{self.peers.get(url.port, 'elsewhere')} {method.upper()} {'/'.join(parts)}"


def module_encoders() -> list[tuple[Any, str, msgspec.json.Encoder]]:
    """Every `msgspec.json.Encoder` held by a module of this project (not yet wrapped)."""
    found = []
    for name, module in list(sys.modules.items()):
        if module is None or not name.startswith("kvhandoff."):
            continue
        for attr, value in list(vars(module).items()):
            if isinstance(value, msgspec.json.Encoder):
                found.append((module, attr, value))
    return found


def install_counters(monkeypatch: pytest.MonkeyPatch, tally: Tally, routes: Routes) -> None:
    """Patch the counting hooks in; `monkeypatch` takes them out after the test."""
    real_run = asyncio.events.Handle._run

    def run(handle: Any) -> None:
        # The self-pipe's reader wakes a sleeping loop for another thread's `call_soon_threadsafe`:
        # whether the loop was asleep then is timing, so it is not counted.
        if getattr(handle._callback, "__name__", "") != "_read_from_self":
            tally.add("loop.callbacks.{side}", side=handle._context.get(SIDE, ""))
        real_run(handle)

    monkeypatch.setattr(asyncio.events.Handle, "_run", run)

    real_connect = sqlite3.connect

    def connect(*args: Any, **kwargs: Any) -> sqlite3.Connection:
        conn = real_connect(*args, **kwargs)
        explicit = False  # inside BEGIN ... COMMIT

        def traced(sql: str) -> None:
            nonlocal explicit
            tally.add("sqlite.statements.{side}")
            verb = sql.lstrip().split(None, 1)[0].upper() if sql.strip() else ""
            if verb == "BEGIN":
                explicit = True
            elif verb in ("COMMIT", "END", "ROLLBACK"):
                explicit = False
                if verb != "ROLLBACK":
                    tally.add("sqlite.commits.{side}")
            elif verb in WRITES and not explicit:
                tally.add("sqlite.commits.{side}")  # autocommit: the statement is its own

        conn.set_trace_callback(traced)
        return conn

    monkeypatch.setattr(sqlite3, "connect", connect)

    real_request = aiohttp.ClientSession._request

    async def request(self: aiohttp.ClientSession, method: str, url: Any, **kwargs: Any) -> Any:
        tally.add(f"http.{{side}}->{routes.name(method, URL(str(url)))}")
        tally.add("http.requests.{side}")
        return await real_request(self, method, url, **kwargs)

    monkeypatch.setattr(aiohttp.ClientSession, "_request", request)

    # Webhooks go out through their own small HTTP client, not aiohttp's.
    real_post = Sender.post

    async def post(self: Sender, url: str, *args: Any, **kwargs: Any) -> Any:
        tally.add(f"http.{{side}}->{routes.name('POST', URL(url))}")
        tally.add("http.requests.{side}")
        return await real_post(self, url, *args, **kwargs)

    monkeypatch.setattr(Sender, "post", post)

    for module, attr, value in module_encoders():
        monkeypatch.setattr(module, attr, CountingEncoder(value, tally))

    def counted(fn: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            out = fn(*args, **kwargs)
            tally.add("encode.calls.{side}")
            tally.add("encode.bytes.{side}", len(out))
            return out

        return wrapper

    monkeypatch.setattr(msgspec.json, "encode", counted(msgspec.json.encode))
    monkeypatch.setattr(json, "dumps", counted(json.dumps))
    # The per-second timers, out of every window (see the module docstring).
    monkeypatch.setattr(kvhandoff.service.runtime.persistence, "CHECKPOINT_INTERVAL_S", QUIET_S)


# -- the deployment --------------------------------------------------------------------------


def config_for(role: str, state_dir: str, case: Case, ranks: list[int]) -> Config:
    stages = (
        [{"num_pages": NUM_PAGES}]
        if role == "decode"
        else [{"pp_rank": r, "pp_size": case.pp_size, "num_pages": NUM_PAGES} for r in ranks]
    )
    table = {
        "role": role,
        "server": {"port": 0, "state_dir": state_dir, "log_level": "warning"},
        "model": case.model,
        "stages": stages,
        "auth": {"router": ROUTER, "engine": ENGINE, "peer": PEER},
        "handoff": {"heartbeat_interval_s": QUIET_S, "peer_timeout_s": 2 * QUIET_S},
        # Small landing and staging memory, as the local deployment has.
        "transfer": {"landing_bytes": 32 << 20, "window_bytes": 4 << 20, "staging_bytes": 16 << 20},
        "webhooks": {"allow_private": True},
    }
    return load_config(None, {}, table)


def side_of(name: str) -> str:
    return "decode" if name == "decode" else "prefill"


@dataclass
class Service:
    name: str
    server: Server
    stop: asyncio.Event
    task: asyncio.Task[None]

    @property
    def url(self) -> str:
        return self.server.url


async def start_service(name: str, config: Config) -> Service:
    """`serve(config)` in a context of its own (`SIDE` = the side it counts for)."""
    side = side_of(name)
    ctx = contextvars.copy_context()
    ctx.run(SIDE.set, side)
    started: asyncio.Future[Server] = asyncio.get_running_loop().create_future()
    stop = asyncio.Event()

    async def run() -> None:
        try:
            async with serve(config, [install_service]) as server:
                started.set_result(server)
                await stop.wait()
        except BaseException as exc:
            if not started.done():
                started.set_exception(exc)
            raise

    task = asyncio.create_task(run(), context=ctx)
    server = await asyncio.wait_for(started, WAIT_S)
    return Service(name, server, stop, task)


@asynccontextmanager
async def deployment(case: Case) -> AsyncIterator[list[Service]]:
    """Prefill services (one per stage), then the decode; all stopped on exit."""
    state = tempfile.mkdtemp(prefix="kvh-gate-")
    services: list[Service] = []
    try:
        for r in range(case.pp_size):
            cfg = config_for("prefill", f"{state}/p{r}", case, [r])
            services.append(await start_service(f"prefill-{r}", cfg))
        services.append(await start_service("decode", config_for("decode", f"{state}/d", case, [])))
        yield services
    finally:
        for s in reversed(services):
            s.stop.set()
            await asyncio.wait_for(asyncio.gather(s.task, return_exceptions=True), WAIT_S)
        shutil.rmtree(state, ignore_errors=True)


# -- the driver --------------------------------------------------------------------------------

_ids = itertools.count()
_encoder = msgspec.json.Encoder()  # the driver's own: created here, never counted


class Driver:
    """The router and the engines: create, every stage ready, then the outcome (once terminal)."""

    def __init__(
        self,
        http: aiohttp.ClientSession,
        services: list[Service],
        settle: Callable[[], Awaitable[object]],
    ) -> None:
        self.http = http
        self.settle = settle
        self.decode = services[-1]
        self.prefills = services[:-1]
        self.ids: list[str] = []

    async def _post(self, url: str, body: Any, token: str) -> tuple[int, Any]:
        headers = {"Authorization": f"Bearer {token}", "Content-Type": "application/json"}
        async with self.http.post(url, data=_encoder.encode(body), headers=headers) as resp:
            return resp.status, await resp.json(content_type=None)

    async def register_webhook(self, url: str) -> None:
        body = {"url": url, "types": ["handoff."]}
        status, reply = await self._post(f"{self.decode.url}/v1/webhooks", body, ROUTER)
        assert status == 201, reply

    async def handoff(self, page: int) -> str:
        hid = f"gate{next(_ids):06d}"  # one width: encoded bytes must not depend on the count
        self.ids.append(hid)
        body = {"id": hid, "prefill": [p.url for p in self.prefills], "dst_pages": [page]}
        status, reply = await self._post(f"{self.decode.url}/v1/handoffs", body, ROUTER)
        assert status in (200, 201), reply
        for rank, p in enumerate(self.prefills):
            if rank:
                # The previous stage's segment has landed and its record write committed, so
                # this arrival is a group commit of its own (see `work_budgets.toml`).
                await self.settle()
            status, reply = await self._post(
                f"{p.url}/v1/handoffs/{hid}/stages/{rank}/ready", {"src_pages": [page]}, ENGINE
            )
            assert status == 202, reply
        headers = {"Authorization": f"Bearer {ROUTER}"}
        url = f"{self.decode.url}/v1/handoffs/{hid}"
        async with self.http.get(url, params={"wait_s": str(WAIT_S)}, headers=headers) as resp:
            view = await resp.json()
        assert view["state"] == "completed", view
        return hid


def engine_stats(services: list[Service]) -> Counter[str]:
    out: Counter[str] = Counter()
    for s in services:
        side = side_of(s.name)
        st = s.server.app[TRANSPORT].stats()
        out[f"mooncake.engine_calls.{side}"] += st.engine_calls
        out[f"mooncake.batches.{side}"] += st.batches_submitted
        out[f"mooncake.in_flight.{side}"] += st.batches_submitted - (
            st.batches_succeeded + st.batches_failed
        )
    return out


async def settled(tally: Tally, services: list[Service]) -> Counter[str]:
    """Counts once nothing is in flight: no engine batch unsettled and `SETTLE_QUIET` sleeps in a
    row without a service callback."""
    deadline = time.monotonic() + WAIT_S
    quiet, last = 0, None
    while quiet < SETTLE_QUIET:
        if time.monotonic() > deadline:
            raise AssertionError("the services did not settle")
        await asyncio.sleep(SETTLE_SLEEP_S)
        now = {k: v for k, v in tally.snapshot().items() if k.startswith("loop.")}
        busy = any(v for k, v in engine_stats(services).items() if ".in_flight." in k)
        quiet = quiet + 1 if now == last and not busy else 0
        last = now
    counts = tally.snapshot()
    counts.update({k: v for k, v in engine_stats(services).items() if ".in_flight." not in k})
    return counts


# -- the measurement -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Measured:
    warmup: int
    measured: int
    mean: dict[str, float]
    low: dict[str, int]
    high: dict[str, int]


async def measure(
    case: Case, monkeypatch: pytest.MonkeyPatch, *, warmup: int = WARMUP, measured: int = MEASURED
) -> Measured:
    SIDE.set(DRIVER)
    tally, routes = Tally(), Routes()
    install_counters(monkeypatch, tally, routes)
    per: list[Counter[str]] = []
    receiver = await WebhookReceiver().start()  # the driver's (its work is not counted)
    routes.peers[receiver.port] = "webhook"
    async with deployment(case) as services, aiohttp.ClientSession() as http:
        routes.peers.update({URL(s.url).port: side_of(s.name) for s in services})
        # A module imported only once a service started would hold an encoder nobody counts.
        missed = [f"{m.__name__}.{a}" for m, a, _ in module_encoders()]
        assert not missed, f"encoders the gate does not count: {missed}"
        driver = Driver(http, services, lambda: settled(tally, services))
        if case.webhooks:
            await driver.register_webhook(receiver.url)
        for i in range(warmup):
            await driver.handoff(i % NUM_PAGES)
        before = await settled(tally, services)
        for i in range(measured):
            await driver.handoff((warmup + i) % NUM_PAGES)
            after = await settled(tally, services)
            delta = after.copy()
            delta.subtract(before)
            per.append(+delta)
            before = after
    await receiver.stop()
    if case.webhooks:
        # Every event of every handoff was delivered (`handoff.` events only).
        assert {r.handoff_id for r in receiver.received} >= set(driver.ids), "deliveries missing"
    keys = sorted(set().union(*per))
    return Measured(
        warmup=warmup,
        measured=measured,
        mean={k: sum(c[k] for c in per) / len(per) for k in keys},
        low={k: min(c[k] for c in per) for k in keys},
        high={k: max(c[k] for c in per) for k in keys},
    )


def table(case: str, m: Measured, budgets: dict[str, float]) -> str:
    width = max((len(k) for k in m.mean), default=10)
    lines = [f"work per handoff, case {case} ({m.measured} handoffs after {m.warmup} warm-up)"]
    lines.append(f"  {'count':<{width}}  {'mean':>10}  {'min..max':>14}  {'budget':>10}")
    for k, v in m.mean.items():
        spread = f"{m.low[k]}..{m.high[k]}"
        budget = budgets.get(k)
        over = "" if budget is not None and v <= budget else "  <-- over budget"
        if budget is None:
            over = "  <-- no budget"
        shown = "-" if budget is None else f"{budget:g}"
        lines.append(f"  {k:<{width}}  {v:>10.2f}  {spread:>14}  {shown:>10}{over}")
    return "\n".join(lines)


def load_budgets() -> dict[str, dict[str, float]]:
    with BUDGETS.open("rb") as f:
        return tomllib.load(f)


def budget_for(key: str, m: Measured) -> int:
    """Today's count as a budget: exact for counts of things; bytes carry timestamps and
    durations whose digits vary from one handoff to the next, so they get 1% above the most
    seen."""
    if key.startswith("encode.bytes."):
        return math.ceil(m.high[key] * 1.01)
    return math.ceil(m.mean[key])


def write_budgets(case: str, m: Measured) -> None:
    """Replace `case`'s table in `work_budgets.toml` (keeping the header and other cases)."""
    text = BUDGETS.read_text()
    header = text[: text.index("\n[")] if "\n[" in text else text.rstrip("\n")
    tables = load_budgets()
    tables[case] = {k: budget_for(k, m) for k in m.mean}
    body = "".join(
        f"\n[{name}]\n" + "".join(f"{json.dumps(k)} = {v:g}\n" for k, v in rows.items())
        for name, rows in sorted(tables.items())
    )
    BUDGETS.write_text(header.rstrip("\n") + "\n" + body)


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
async def test_work_per_handoff_is_within_its_budget(
    case: Case, monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest
) -> None:
    m = await measure(case, monkeypatch)
    if request.config.getoption("--write-work-budgets", default=False):
        write_budgets(case.name, m)
    budgets = load_budgets().get(case.name, {})
    report = table(case.name, m, budgets)
    print("\n" + report)
    over = [k for k, v in m.mean.items() if k not in budgets or v > budgets[k]]
    assert not over, f"more work per handoff than budgeted ({', '.join(over)}):\n{report}"


async def test_the_gate_sees_one_more_statement_per_handoff(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The gate can fail: one more write per accepted handoff (here: a test's, beside the
    record of the create) shows as exactly one more statement per handoff, and nothing else
    changes."""
    case = CASES[0]
    baseline = await measure(case, monkeypatch, warmup=3, measured=3)
    monkeypatch.undo()
    accepted = HandoffRecords.accepted

    def one_more(self: HandoffRecords, tx: sqlite3.Connection, *args: Any, **kw: Any) -> None:
        accepted(self, tx, *args, **kw)
        tx.execute("UPDATE meta SET value = value WHERE key = 'gate'")

    monkeypatch.setattr(HandoffRecords, "accepted", one_more)
    more = await measure(case, monkeypatch, warmup=3, measured=3)
    added = {k: more.mean.get(k, 0) - v for k, v in baseline.mean.items()}
    changed = {k: d for k, d in added.items() if d and not k.startswith("encode.bytes.")}
    # The extra write joins the record's group commit: one statement more, no commit more.
    assert changed == {"sqlite.statements.decode": 1}
