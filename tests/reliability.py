"""Regenerate RELIABILITY.md: abuse a real deployment, count what was tried and what held.

`python -m tests.reliability --out RELIABILITY.md` (what `make reliability` runs) starts a decode
service and a PP=2 prefill (one process per stage, real Mooncake over TCP, shm pools the script
reads as the engines would), then, round after round:

- forges peer messages as a router or an engine holding its own credential would (destinations,
  arrivals, stage failures, replays, stale messages, senders claiming to be someone else, a
  router's token on every peer route) and checks each is refused with the expected status;
- sends bad input by category (issue 10 §3) and checks each is a 4xx problem naming it;
- runs real handoffs between the attempts and checks every byte landed where it should;
- after every attempt, checks the decode pool byte for byte: nothing outside a leased
  destination may change;
- runs schemathesis over both services' OpenAPI documents;
- kills (SIGKILL) and stops (SIGSTOP) a prefill process in the middle of handoffs, each on its
  own deployment, and checks every handoff still reaches a terminal state the router can read
  and no byte lands outside its destination.

Every number in the file comes from the run that wrote it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import msgspec
import numpy as np

from kvhandoff.pipelines.messages import LayoutInfo
from kvhandoff.service.http.peer_signing import Signer
from kvhandoff.service.testing.deployment import LocalDeployment
from tests.integration.handoff_checks import (
    SENTINEL,
    Moved,
    create,
    decode_bytes,
    fill_sources,
    finished,
    landed,
    ready,
    reset_decode,
    rows,
)
from tests.integration.test_fuzz import run_schemathesis
from tests.integration.test_trust import delivered, forged_destination, layout_of

ROUTER, ENGINE, PEER = "rel-router", "rel-engine", "rel-peer"
ENV = {
    "KVHANDOFF_AUTH__ROUTER": ROUTER,
    "KVHANDOFF_AUTH__ENGINE": ENGINE,
    "KVHANDOFF_AUTH__PEER": PEER,
}
MODEL = {"scale": 64, "page_size": 16, "num_layers": 16}
JSON = {"Content-Type": "application/json"}
ROOT = Path(__file__).resolve().parents[1]


@dataclass
class Tally:
    """One kind of attempt: how often it was tried, how often everything held, what came back."""

    category: str
    what: str
    expected: str
    tried: int = 0
    held: int = 0
    statuses: Counter[int] = field(default_factory=Counter)
    notes: list[str] = field(default_factory=list)

    def record(self, ok: bool, status: int | None = None, note: str = "") -> None:
        self.tried += 1
        self.held += ok
        if status is not None:
            self.statuses[status] += 1
        if not ok and note and len(self.notes) < 3:
            self.notes.append(note)


class Campaign:
    def __init__(self) -> None:
        self.tallies: dict[tuple[str, str], Tally] = {}
        self.handoffs = Counter[tuple[str, str]]()  # (when, terminal state)
        self.pool_checks = 0
        self.pool_violations: list[str] = []
        self.fuzz: list[tuple[str, int, int]] = []  # (service, cases, failures)

    def tally(self, category: str, what: str, expected: str) -> Tally:
        key = (category, what)
        if key not in self.tallies:
            self.tallies[key] = Tally(category, what, expected)
        return self.tallies[key]

    def check_pool(self, dep: LocalDeployment, before: bytes, context: str) -> bool:
        self.pool_checks += 1
        if decode_bytes(dep) == before:
            return True
        self.pool_violations.append(context)
        return False


# ---------------------------------------------------------------------------------------------
# HTTP helpers


@dataclass
class Parties:
    router: aiohttp.ClientSession
    engine: aiohttp.ClientSession
    anonymous: aiohttp.ClientSession


async def send(
    http: aiohttp.ClientSession,
    method: str,
    url: str,
    raw: bytes = b"",
    headers: dict[str, str] | None = None,
) -> tuple[int, str, Any]:
    async with http.request(method, url, data=raw or None, headers=headers) as resp:
        text = await resp.read()
        try:
            body = json.loads(text) if text else None
        except ValueError:
            body = None
        return resp.status, resp.content_type, body


async def signed(
    http: aiohttp.ClientSession,
    base: str,
    path: str,
    body: Any,
    *,
    secret: str = PEER,
    sender: str,
    clock: Callable[[], float] = time.time,
) -> tuple[int, str, Any]:
    raw = json.dumps(body).encode()
    headers = {
        **JSON,
        **Signer(secret, sender, clock=clock).headers("POST", path, raw, recipient=base),
    }
    return await send(http, "POST", base + path, raw, headers)


def item_status(result: tuple[int, str, Any]) -> int:
    """A batch route answers 200 with one outcome per item: the item's status is what counts."""
    status, _, body = result
    if status == 200 and isinstance(body, list) and body:
        return int(body[0]["status"])
    return status


# ---------------------------------------------------------------------------------------------
# Forgeries


async def forgeries(dep: LocalDeployment, p: Parties, c: Campaign, round_: int) -> None:
    headers = Signer(PEER, dep.prefill_urls[0]).headers(
        "GET", "/v1/layout", b"", recipient=dep.decode_url
    )
    async with p.anonymous.get(dep.decode_url + "/v1/layout", headers=headers) as resp:
        layout = msgspec.json.decode(await resp.read(), type=LayoutInfo)
    hid = f"forged-{round_}"
    victim = f"victim-{round_}"
    m = Moved(src_pages=[1, 2, 3], dst_pages=[10, 11, 12], src_slot=0, dst_slot=3)
    base_page = 20 + 2 * (round_ % 10)
    real = Moved([5, 6], [base_page, base_page + 1], src_slot=1, dst_slot=round_ % 8)
    for r in range(dep.pp_size):
        await ready(p.engine, dep, hid, r, m)  # the engine's half is real; the destination is not
    assert (await create(p.router, dep, victim, real))[0] == 201
    before = decode_bytes(dep)

    async def attempt(
        category: str, what: str, expected: set[int], call: Awaitable[tuple[int, str, Any]]
    ) -> None:
        t = c.tally(category, what, "/".join(str(s) for s in sorted(expected)))
        result = await call
        status = item_status(result)
        ok = status in expected and c.check_pool(dep, before, f"{category}: {what}")
        t.record(ok, status, f"got {status}: {result[2]}")

    for r in range(dep.pp_size):
        # What a forger holding the peer secret can read, so every message is well-formed down
        # to the incarnations and only the checks that matter can refuse it.
        stage = await layout_of(p.anonymous, dep.url_of_stage(r), dep.decode_url, PEER)
        claims = {
            "sender_url": dep.url_of_stage(r),
            "sender_incarnation": stage.incarnation,
            "decode_incarnation": layout.incarnation,
        }
        dest = forged_destination(dep, hid, r, layout, stage, m)
        arrival = {"handoff_id": victim, "pp_rank": r, "bytes": 0, "blocks": 0, **claims}
        failure = {"handoff_id": victim, "pp_rank": r, "code": "x", "reason": "forged", **claims}
        other = next(u for u in dep.prefill_urls if u != dep.url_of_stage(r))
        for name, base, path, msg, impostor in (
            ("forged destination", dep.url_of_stage(r), "/v1/peer/destinations", dest, other),
            ("forged arrival (0 bytes)", dep.decode_url, "/v1/peer/arrivals", arrival, other),
            ("forged stage failure", dep.decode_url, "/v1/peer/stage-failures", failure, other),
        ):
            raw = json.dumps([msg]).encode()
            for who, session in (("router token", p.router), ("engine token", p.engine)):
                call = send(session, "POST", base + path, raw, JSON)
                await attempt(name, f"with the {who}", {403}, call)
            await attempt(
                name, "unsigned", {401}, send(p.anonymous, "POST", base + path, raw, JSON)
            )
            call = signed(p.anonymous, base, path, [msg], secret=ROUTER, sender=base)
            await attempt(name, "signed with the router's token as key", {401}, call)
            call = signed(p.anonymous, base, path, [msg], sender=impostor)
            await attempt(name, "signed by a peer claiming another service", {403}, call)
        # Signed by the stage's own service, but accounting for none of the stage's bytes.
        call = signed(
            p.anonymous, dep.decode_url, "/v1/peer/arrivals", [arrival], sender=dep.url_of_stage(r)
        )
        await attempt("forged arrival (0 bytes)", "signed by the stage's own service", {422}, call)

    beat = {
        "sender_url": dep.decode_url,
        "sender_incarnation": layout.incarnation,
        "role": "decode",
    }
    raw = json.dumps(beat).encode()
    path = "/v1/peer/heartbeats"
    url = dep.url_of_stage(0)
    once = {**JSON, **Signer(PEER, dep.decode_url).headers("POST", path, raw, recipient=url)}
    await send(p.anonymous, "POST", url + path, raw, once)
    replay = send(p.anonymous, "POST", url + path, raw, once)
    await attempt("replayed peer message", "the same signed request again", {409}, replay)
    stale = signed(
        p.anonymous, url, path, beat, sender=dep.decode_url, clock=lambda: time.time() - 120
    )
    await attempt("stale peer message", "signed 120 s ago", {401}, stale)
    for base, method, path in (
        (dep.decode_url, "GET", "/v1/layout"),
        (dep.decode_url, "POST", "/v1/peer/arrivals"),
        (dep.decode_url, "POST", "/v1/peer/stage-failures"),
        (dep.decode_url, "POST", "/v1/peer/heartbeats"),
        (dep.prefill_urls[0], "GET", "/v1/layout"),
        (dep.prefill_urls[0], "POST", "/v1/peer/destinations"),
        (dep.prefill_urls[0], "POST", "/v1/peer/aborts"),
    ):
        for who, session in (("router", p.router), ("engine", p.engine)):
            call = send(session, method, base + path, b"[]", JSON)
            await attempt(
                f"{who} credential on peer routes", "each of the 7 peer routes", {403}, call
            )
    await delivered(p.router, dep, victim)  # the prefill side knows who the victim's decode is
    for r in range(dep.pp_size):
        abort = {"handoff_id": victim, "reason": "forged", "decode_incarnation": layout.incarnation}
        raw = json.dumps(abort).encode()
        base, path = dep.url_of_stage(r), "/v1/peer/aborts"
        other = next(u for u in dep.prefill_urls if u != base)
        for who, session in (("router token", p.router), ("engine token", p.engine)):
            call = send(session, "POST", base + path, raw, JSON)
            await attempt("forged abort", f"with the {who}", {403}, call)
        await attempt(
            "forged abort", "unsigned", {401}, send(p.anonymous, "POST", base + path, raw, JSON)
        )
        # Ids are scoped by decode on the prefill: another service's signed abort names its own
        # handoff of that id, of which there is none, so it stops nothing (the victim completes
        # below, its bytes checked).
        call = signed(p.anonymous, base, path, json.loads(raw), sender=other)
        await attempt("forged abort", "signed by another service (stops nothing)", {200}, call)
    # The victim is intact: its real stages complete it, and its bytes land where they should.
    for r in range(dep.pp_size):
        await ready(p.engine, dep, victim, r, real)
    view = await finished(p.router, dep, victim)
    c.handoffs["between the attempts", view["state"]] += 1
    problems = landed(dep, [real]) if view["state"] == "completed" else ["not completed"]
    if problems:
        c.pool_violations.append(f"{victim}: {problems[:2]}")
    reset_decode(dep)


# ---------------------------------------------------------------------------------------------
# Bad input


def _nested(depth: int) -> str:
    return "[" * depth + "]" * depth


PARSER_ERRORS = {
    "request line over 8 KiB": b"GET /" + b"a" * 9000 + b" HTTP/1.1\r\nHost: x\r\n\r\n",
    "header over 8 KiB": b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-A: " + b"b" * 9000 + b"\r\n\r\n",
    "bad chunk size": b"POST /v1/handoffs HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked"
    b"\r\n\r\nzz\r\n{}\r\n0\r\n\r\n",
    "HTTP/9.9": b"GET /healthz HTTP/9.9\r\nHost: x\r\n\r\n",
    "Content-Length with Transfer-Encoding": b"POST /v1/handoffs HTTP/1.1\r\nHost: x\r\n"
    b"Content-Length: 2\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
}


async def raw_exchange(url: str, payload: bytes) -> tuple[int, str]:
    host, port = url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(payload)
    await writer.drain()
    data = await asyncio.wait_for(reader.read(), 10)
    writer.close()
    head = data.partition(b"\r\n\r\n")[0].decode("latin-1").split("\r\n")
    headers = {k.lower(): v.strip() for k, _, v in (line.partition(":") for line in head[1:])}
    return int(head[0].split()[1]), headers.get("content-type", "").split(";")[0]


async def bad_inputs(dep: LocalDeployment, p: Parties, c: Campaign, round_: int) -> None:
    before = decode_bytes(dep)
    d, pf = dep.decode_url, dep.url_of_stage(0)

    async def attempt(
        category: str,
        what: str,
        expected: set[int],
        result: tuple[int, str, Any],
        field: str | None = None,
    ) -> None:
        t = c.tally(category, what, "/".join(str(s) for s in sorted(expected)))
        status, ctype, body = result
        ok = status in expected
        if status >= 400:
            ok = ok and ctype == "application/problem+json"
            if field is not None:
                ok = ok and isinstance(body, dict) and body.get("field") == field
        ok = ok and c.check_pool(dep, before, f"{category}: {what}")
        t.record(ok, status, f"{status} {ctype} {body}")

    def post(
        session: aiohttp.ClientSession, url: str, body: str, headers: dict[str, str] = JSON
    ) -> Awaitable[tuple[int, str, Any]]:
        return send(session, "POST", url, body.encode(), headers)

    cat = "deeply nested JSON"
    for depth in (1000, 5000):
        await attempt(
            cat,
            f"{depth} levels in metadata",
            {400},
            await post(
                p.router,
                d + "/v1/handoffs",
                f'{{"id": "n", "dst_pages": [1], "metadata": {{"x": {_nested(depth)}}}}}',
            ),
        )
        await attempt(
            cat,
            f"{depth} levels in stage-ready layers",
            {400},
            await post(
                p.engine,
                pf + "/v1/handoffs/n/stages/0/ready",
                f'{{"src_pages": [1], "layers": {_nested(depth)}}}',
            ),
        )
        failure = [
            {
                "handoff_id": "n",
                "pp_rank": 0,
                "code": "x",
                "reason": "r",
                "context": json.loads(_nested(depth // 10)),
            }
        ]
        raw = json.dumps(failure).replace("[]", _nested(depth))
        await attempt(
            cat,
            f"{depth} levels in a signed stage-failure context",
            {400},
            await send(
                p.anonymous,
                "POST",
                d + "/v1/peer/stage-failures",
                raw.encode(),
                {
                    **JSON,
                    **Signer(PEER, dep.url_of_stage(0)).headers(
                        "POST", "/v1/peer/stage-failures", raw.encode(), recipient=d
                    ),
                },
            ),
        )
    cat = "pp_rank not ASCII digits"
    for rank in ("\u00b2", "\u2460", "\uff10", "\u0663", "1 ", "-1", "0x1"):
        await attempt(
            cat,
            "superscript, circled, fullwidth, Arabic-Indic, space, sign, hex",
            {422},
            await post(p.engine, f"{pf}/v1/handoffs/r/stages/{rank}/ready", '{"src_pages": [1]}'),
            "pp_rank",
        )
    cat = "Authorization not UTF-8"
    bad = {"Authorization": b"Bearer \xff\xfe".decode("latin-1")}
    for url in (d + "/v1/handoffs", pf + "/v1/layout", pf + "/v1/handoffs/x/stages/0/ready"):
        method = "POST" if url.endswith("ready") else "GET"
        await attempt(
            cat,
            "router, peer and engine routes",
            {401},
            await send(p.anonymous, method, url, b"{}", {**JSON, **bad}),
        )
    cat = "malformed peer URL"
    for url in ("http://", "http://[::1", "http://127.0.0.1:99999", "http://a b:1"):
        body = json.dumps({"id": "u", "prefill": [url], "dst_pages": [1], "dst_slot": 0})
        await attempt(
            cat,
            "in prefill, prefill_urls, decode_url",
            {422},
            await post(p.router, d + "/v1/handoffs", body),
            "prefill[0]",
        )
        await attempt(
            cat,
            "in prefill, prefill_urls, decode_url",
            {422},
            await post(p.router, d + "/v1/validate", json.dumps({"prefill_urls": [url]})),
            "prefill_urls[0]",
        )
        await attempt(
            cat,
            "in prefill, prefill_urls, decode_url",
            {422},
            await post(
                p.router, d + "/v1/validate", json.dumps({"prefill_urls": [pf], "decode_url": url})
            ),
            "decode_url",
        )
    cat = "validate with 30,000 repeated URLs"
    start = time.monotonic()
    result = await post(p.router, d + "/v1/validate", json.dumps({"prefill_urls": [pf] * 30_000}))
    took = time.monotonic() - start
    await attempt(cat, "one fetch, answered", {200}, result)
    if round_ == 0:
        c.tally(cat, "one fetch, answered", "200").notes.append(f"answered in {took:.2f} s")
    await attempt(
        cat,
        "65 distinct URLs",
        {422},
        await post(
            p.router,
            d + "/v1/validate",
            json.dumps({"prefill_urls": [f"http://127.0.0.1:{1000 + i}" for i in range(65)]}),
        ),
        "prefill_urls",
    )
    cat = "integer beyond int64 in a page list"
    for value in (2**63, 2**64 - 1, 10**30):
        await attempt(
            cat,
            "dst_pages, src_pages",
            {422},
            await post(
                p.router,
                d + "/v1/handoffs",
                f'{{"id": "big", "prefill": ["{pf}"], "dst_pages": [{value}], "dst_slot": 0}}',
            ),
            "dst_pages[0]",
        )
        await attempt(
            cat,
            "dst_pages, src_pages",
            {422},
            await post(
                p.engine, pf + "/v1/handoffs/big/stages/0/ready", f'{{"src_pages": [{value}]}}'
            ),
            "src_pages[0]",
        )
    cat = "id . or .."
    for hid in (".", ".."):
        await attempt(
            cat,
            "as a handoff id",
            {422},
            await post(
                p.router,
                d + "/v1/handoffs",
                json.dumps({"id": hid, "dst_pages": [1], "dst_slot": 0}),
            ),
            "id",
        )
    cat = "repeated stage-ready, other src_slot"
    url = f"{pf}/v1/handoffs/slot-{round_}/stages/0/ready"
    await post(p.engine, url, '{"src_pages": [1], "src_slot": 1}')
    await attempt(
        cat,
        "second signal with another slot",
        {409},
        await post(p.engine, url, '{"src_pages": [1], "src_slot": 2}'),
        "src_slot",
    )
    cat = "body not application/json"
    for ctype in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data"):
        await attempt(
            cat,
            "text/plain, form, multipart",
            {415},
            await post(
                p.router,
                d + "/v1/handoffs",
                '{"id": "ct", "dst_pages": [1]}',
                {"Content-Type": ctype},
            ),
        )
    cat = "bearer scheme in any case"
    for scheme in ("bearer", "BEARER", "bEaReR"):
        await attempt(
            cat,
            "bearer, BEARER, bEaReR accepted",
            {200},
            await send(
                p.anonymous,
                "GET",
                d + "/v1/handoffs",
                headers={"Authorization": f"{scheme} {ROUTER}"},
            ),
        )
    cat = "aiohttp parser error"
    for name, payload in PARSER_ERRORS.items():
        status, ctype = await raw_exchange(d, payload)
        await attempt(
            cat,
            "long line/header, bad chunk, HTTP/9.9, CL+TE",
            {400, 413, 414, 431},
            (status, ctype, {"field": None}),
        )
        del name
    cat = "empty page lists"
    hid = f"state-only-{round_}"
    m = Moved(src_pages=[], dst_pages=[], src_slot=1, dst_slot=2)
    status, body = await create(p.router, dep, hid, m)
    for r in range(dep.pp_size):
        await ready(p.engine, dep, hid, r, m)
    view = await finished(p.router, dep, hid)
    c.handoffs["between the attempts", view["state"]] += 1
    t = c.tally(cat, "state-only handoff: only the slot moves", "201, completed")
    t.record(status == 201 and view["state"] == "completed" and landed(dep, [m]) == [], status)
    reset_decode(dep)


# ---------------------------------------------------------------------------------------------
# Kills and stops


def outside(dep: LocalDeployment, pages: Iterable[int], slots: Iterable[int]) -> list[str]:
    """Decode entries with a changed byte outside `pages` (KV) and `slots` (state)."""
    pages, slots = set(pages), set(slots)
    problems = []
    layout, pool = dep.decode_layout, dep.decode_pool
    entries = [(e.item_len, pages) for e in layout.kv] + [(s.item_len, slots) for s in layout.state]
    for i, (item_len, leased) in enumerate(entries):
        got = rows(pool.view(i), item_len)
        mask = np.ones(got.shape[0], dtype=bool)
        mask[sorted(leased)] = False
        if not (got[mask] == SENTINEL).all():
            problems.append(f"entry {i}")
    return problems


async def kill_or_stop(c: Campaign, sig: int, round_: int) -> None:
    label = "SIGKILL" if sig == signal.SIGKILL else "SIGSTOP"
    with LocalDeployment(
        preset="hybrid-npu-mla", model=MODEL, pp_size=2, num_pages=64, num_slots=8, env=ENV
    ) as dep:
        fill_sources(dep, seed=round_)
        reset_decode(dep)
        async with parties() as p:
            moves = [
                Moved(
                    src_pages=list(range(8 * i, 8 * i + 8)),
                    dst_pages=list(range(8 * i, 8 * i + 8)),
                    src_slot=i,
                    dst_slot=i,
                )
                for i in range(4)
            ]
            for i, m in enumerate(moves):
                assert (await create(p.router, dep, f"h{i}", m, deadline_s=4))[0] == 201
            for i, m in enumerate(moves):
                await ready(p.engine, dep, f"h{i}", 0, m)
            for i, m in enumerate(moves[:2]):
                await ready(p.engine, dep, f"h{i}", 1, m)
            proc = dep.kill(1, sig, wait_s=5.0 if sig == signal.SIGKILL else None)
            views = [await finished(p.router, dep, f"h{i}") for i in range(len(moves))]
            if sig == signal.SIGSTOP:
                assert proc.popen is not None
                proc.popen.send_signal(signal.SIGCONT)  # a writer that wakes after the failure
                await asyncio.sleep(1.0)
            for v in views:
                c.handoffs[f"under {label}", v["state"]] += 1
            t = c.tally(
                f"prefill process {label}ed mid-handoff",
                "4 handoffs, 2 stages ready on the lost one",
                "every handoff terminal; no byte outside its destination",
            )
            pages = [x for m in moves for x in m.dst_pages]
            leaked = outside(dep, pages, [m.dst_slot for m in moves if m.dst_slot is not None])
            exact = [  # a completed handoff's bytes are all there (others' pages aside)
                f
                for m, v in zip(moves, views, strict=True)
                if v["state"] == "completed"
                for f in landed(dep, [m])
                if "wrong bytes" in f
            ]
            terminal = all(v["state"] in ("completed", "failed", "aborted") for v in views)
            ok = terminal and not leaked and not exact
            t.record(ok, None, f"leaked {leaked}, wrong {exact}")
            if leaked or exact:
                c.pool_violations.append(f"{label}: {leaked or exact}")
            c.pool_checks += 1


# ---------------------------------------------------------------------------------------------
# Fuzz


def fuzz(dep: LocalDeployment, c: Campaign, examples: int) -> None:
    for name, url in (("decode", dep.decode_url), ("prefill", dep.prefill_urls[0])):
        with tempfile.TemporaryDirectory() as work:
            code, output = run_schemathesis(
                dep, url, Path(work), examples=examples, seed="20261201", token=ROUTER
            )
        summary = output.rsplit("Test cases:", 1)[-1]
        cases = int((re.search(r"(\d+) generated", summary) or [0, 0])[1])
        failed = sum(int(x) for x in re.findall(r"(\d+) (?:found|errored)", summary))
        c.fuzz.append((name, cases, failed if code == 0 else max(failed, 1)))


# ---------------------------------------------------------------------------------------------
# The run and the file


class parties:
    async def __aenter__(self) -> Parties:
        self._sessions = [
            aiohttp.ClientSession(headers={"Authorization": f"Bearer {ROUTER}"}),
            aiohttp.ClientSession(headers={"Authorization": f"Bearer {ENGINE}"}),
            aiohttp.ClientSession(),
        ]
        return Parties(*self._sessions)

    async def __aexit__(self, *exc: object) -> None:
        for s in self._sessions:
            await s.close()


async def run(rounds: int, kills: int, fuzz_examples: int) -> Campaign:
    c = Campaign()
    with LocalDeployment(
        preset="hybrid-npu-mla", model=MODEL, pp_size=2, num_pages=64, num_slots=8, env=ENV
    ) as dep:
        fill_sources(dep, seed=1)
        reset_decode(dep)
        async with parties() as p:
            for r in range(rounds):
                await forgeries(dep, p, c, r)
                await bad_inputs(dep, p, c, r)
        if fuzz_examples:
            await asyncio.to_thread(fuzz, dep, c, fuzz_examples)
        c.tally("services alive afterwards", "every process still running", "yes").record(
            all(proc.running for proc in dep.processes)
        )
    for r in range(kills):
        await kill_or_stop(c, signal.SIGKILL, r)
        await kill_or_stop(c, signal.SIGSTOP, r)
    return c


def render(c: Campaign, rounds: int, took_s: float) -> str:
    commit = (
        subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            check=False,
        ).stdout.strip()
        or "unknown"
    )
    tried = sum(t.tried for t in c.tallies.values())
    held = sum(t.held for t in c.tallies.values())
    lines = [
        "# Reliability",
        "",
        "Generated by `make reliability` (`python -m tests.reliability`); every number below comes",
        f"from that run (commit `{commit}`, {rounds} rounds, {took_s:.0f} s). A decode service",
        "and a PP=2 prefill run as separate processes (Mooncake over TCP on 127.0.0.1, shm pools",
        "read by the script as the engines would); the script plays router (router token),",
        "engine (engine token) and attacker. After every attempt the whole decode pool is",
        "compared byte for byte with its state before the attempt. Kills and stops each run on",
        "a fresh deployment: 4 handoffs, then the process hosting stage 1 is killed (SIGKILL) or",
        "stopped (SIGSTOP, resumed after the handoffs ended) while 2 of them may still be moving.",
        "",
        "## What held",
        "",
        f"- **{held} of {tried}** attempts ended as expected.",
        f"- **Decode pool**: {c.pool_checks} byte-for-byte checks, "
        f"{len(c.pool_violations)} bytes-out-of-place findings"
        + ("." if not c.pool_violations else f": {c.pool_violations[:3]}"),
        f"- **Handoffs**: {sum(c.handoffs.values())} real handoffs ("
        + "; ".join(
            f"{when}: "
            + ", ".join(f"{n} {state}" for (w, state), n in sorted(c.handoffs.items()) if w == when)
            for when in sorted({w for w, _ in c.handoffs})
        )
        + "). Every one reached a terminal state the router could read (nothing lost); each "
        "completed one landed byte-exact; a failed one wrote nothing outside its destination.",
    ]
    for name, cases, failed in c.fuzz:
        lines.append(
            f"- **Fuzz ({name})**: schemathesis, {cases} generated cases, every check but "
            "`use_after_free`, every operation but the two open-ended event streams (see "
            f"tests/fuzz/schemathesis.toml for why), {failed} failures."
        )
    lines += [
        "",
        "## What was tried",
        "",
        "| category | attempt | expected | tried | held | statuses seen |",
        "|---|---|---|---:|---:|---|",
    ]
    for t in c.tallies.values():
        seen = ", ".join(f"{s} x{n}" for s, n in sorted(t.statuses.items())) or "-"
        lines.append(f"| {t.category} | {t.what} | {t.expected} | {t.tried} | {t.held} | {seen} |")
    notes = [(t, n) for t in c.tallies.values() for n in t.notes]
    if notes:
        lines += ["", "## Notes", ""]
        lines += [f"- {t.category} / {t.what}: {n}" for t, n in notes]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="RELIABILITY.md")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--kills", type=int, default=2, help="kill and stop runs (each)")
    parser.add_argument("--fuzz-examples", type=int, default=30)
    args = parser.parse_args()
    start = time.monotonic()
    campaign = asyncio.run(run(args.rounds, args.kills, args.fuzz_examples))
    text = render(campaign, args.rounds, time.monotonic() - start)
    Path(args.out).write_text(text)
    print(text)
    failed = campaign.pool_violations or any(t.held != t.tried for t in campaign.tallies.values())
    sys.exit(1 if failed or any(f for _, _, f in campaign.fuzz) else 0)


if __name__ == "__main__":
    main()
