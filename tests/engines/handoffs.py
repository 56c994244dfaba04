"""What kvhandoff itself says about a server's handoffs: its HTTP API and its decode records.

Each scheduler rank of a server runs an embedded kvhandoff service on a free port, which it
logs at start-up (`kvhandoff <role> serving at <url>`); the failure tests read a decode's
handoffs there (`GET /v1/handoffs/{id}`, the list, `/metrics`) — the router-facing API, open
in the tests' configuration — and a prefill's handoffs in flight from its `/metrics`. The pages
a handoff leased are not in its view: `Records` reads them from the decode's own state file
(`<state_dir>/<rank>/decode.sqlite3`, read-only), which is how the page-reuse case sees that a
request was given pages a failed one had.
"""

from __future__ import annotations

import asyncio
import json
import re
import sqlite3
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp

from tests.engines.client import handoff_id
from tests.engines.servers import Server

_SERVING = re.compile(r"kvhandoff (decode|prefill) serving at (\S+)")
TERMINAL = frozenset({"completed", "failed", "aborted"})
#: Each API call's bound, connecting included: a service thread inside a busy engine process on
#: a loaded 2-core machine was seen taking over 30 s (aiohttp's default) to accept.
API_TIMEOUT = aiohttp.ClientTimeout(total=120)


def service_urls(server: Server, role: str) -> list[str]:
    """The kvhandoff service URLs of the server's ranks of `role`, from its latest start."""
    text = server.log.read_text(errors="replace")
    latest = text.rsplit("\n=== ", 1)[-1]  # `Server.start` marks each start in the log
    urls = [m.group(2) for m in _SERVING.finditer(latest) if m.group(1) == role]
    if not urls:
        raise AssertionError(f"{server.name} logged no kvhandoff {role} service:\n{server.tail()}")
    return urls


async def view(session: aiohttp.ClientSession, url: str, room: int) -> dict[str, Any] | None:
    """The decode's view of the room's handoff, or None while it has none."""
    async with session.get(f"{url}/v1/handoffs/{handoff_id(room)}", timeout=API_TIMEOUT) as r:
        if r.status == 404:
            return None
        r.raise_for_status()
        out: dict[str, Any] = await r.json()
        return out


async def wait_view(
    session: aiohttp.ClientSession,
    url: str,
    room: int,
    until: Callable[[dict[str, Any]], bool],
    timeout_s: float,
) -> dict[str, Any]:
    """Polls the room's handoff until `until(view)`; AssertionError with the last view after
    `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    last = None
    while time.monotonic() < deadline:
        last = await view(session, url, room)
        if last is not None and until(last):
            return last
        await asyncio.sleep(0.1)
    raise AssertionError(f"handoff {handoff_id(room)} after {timeout_s:.0f} s: {last}")


def cut_off(state: str, code: str | None) -> bool:
    """How a request whose client went away ends: aborted by the decode's engine, or failed by
    the prefill's engine aborting its side first (`engine_aborted`): SGLang notices the gone
    client on each side on its own."""
    return state == "aborted" or (state == "failed" and code == "engine_aborted")


def ended(v: dict[str, Any]) -> bool:
    """Terminal and its pages given back: no lease left."""
    return v["state"] in TERMINAL and bool(v["released"])


async def views(session: aiohttp.ClientSession, url: str) -> list[dict[str, Any]]:
    """Every handoff the decode answers for, in creation order."""
    out: list[dict[str, Any]] = []
    cursor = 0
    while True:
        params = {"limit": "1000", "cursor": str(cursor)}
        async with session.get(f"{url}/v1/handoffs", params=params, timeout=API_TIMEOUT) as r:
            r.raise_for_status()
            page = await r.json()
        out += page["items"]
        if page["next_cursor"] is None:
            return out
        cursor = page["next_cursor"]


async def in_flight(session: aiohttp.ClientSession, url: str) -> float:
    """`kvhandoff_handoffs_in_flight` from the service's /metrics (decode: not terminal;
    prefill: holding a destination and not ended)."""
    async with session.get(f"{url}/metrics", timeout=API_TIMEOUT) as r:
        r.raise_for_status()
        text = await r.text()
    for line in text.splitlines():
        if line.startswith("kvhandoff_handoffs_in_flight "):
            return float(line.split()[1])
    raise AssertionError(f"{url}/metrics has no kvhandoff_handoffs_in_flight")


async def settled(session: aiohttp.ClientSession, urls: list[str], timeout_s: float) -> None:
    """Waits until none of the services has a handoff in flight."""
    deadline = time.monotonic() + timeout_s
    while True:
        counts = [await in_flight(session, u) for u in urls]
        if not any(counts):
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"handoffs still in flight after {timeout_s:.0f} s: {counts}")
        await asyncio.sleep(0.5)


@dataclass(frozen=True)
class Record:
    id: str
    state: str
    dst_pages: frozenset[int]
    created_at: float
    released_at: float | None
    error_code: str | None


class Records:
    """The decode rank's handoff records, read from its state file (read-only)."""

    def __init__(self, state_dir: Path) -> None:
        self.path = state_dir / "decode.sqlite3"

    def all(self) -> dict[str, Record]:
        conn = sqlite3.connect(f"file:{self.path}?mode=ro", uri=True, timeout=10)
        try:
            rows = conn.execute(
                "SELECT id, state, dst_pages, created_at, view FROM handoffs"
            ).fetchall()
        finally:
            conn.close()
        out = {}
        for hid, state, pages, created_at, raw_view in rows:
            v = json.loads(raw_view) if raw_view else {}
            code = (v.get("error") or {}).get("code")
            out[hid] = Record(
                hid, state, frozenset(json.loads(pages)), created_at, v.get("released_at"), code
            )
        return out
