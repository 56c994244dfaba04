"""What the decode's own kvhandoff service says about its handoffs: its API and its records.

The decode's worker runs an embedded kvhandoff service on a free port, which the decode's fault
hook has the connector log (`faults/`: `kvhandoff decode service of worker pp0 tp0 at <url>`).
The failure cases read each handoff there (`GET /v1/handoffs/{id}`, the router-facing API,
open in the tests' configuration), and the pages each one leased from the worker's state file
(`Records`, shared with the SGLang engine tests: the view does not list pages).
"""

from __future__ import annotations

import json
import re
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvhandoff.service.integrations.vllm.metadata import rank_handoff_id
from tests.engines.handoffs import TERMINAL, Records
from tests.vllm.servers import Server

_SERVICE = re.compile(r"kvhandoff decode service of worker pp0 tp0 at (\S+)")


def decode_api(decode: Server) -> str:
    """The decode worker's kvhandoff service URL, from the server's log."""
    match = _SERVICE.search(decode.log.read_text(errors="replace"))
    if match is None:
        raise decode.fail("logged no kvhandoff decode service URL")
    return match.group(1)


def decode_records(kvhandoff_toml: Path) -> Records:
    """The decode worker's handoff records (`<server.state_dir>/vllm-decode-pp0-tp0`)."""
    return Records(kvhandoff_toml.parent / "state" / "vllm-decode-pp0-tp0")


def handoff_of(params: dict[str, Any]) -> str:
    """The decode's handoff for the params a prefill answered (TP rank 0)."""
    return rank_handoff_id(params["kvhandoff"]["id"], 0)


def view(api: str, hid: str) -> dict[str, Any] | None:
    """The decode's view of handoff `hid`, or None while it has none."""
    try:
        with urllib.request.urlopen(f"{api}/v1/handoffs/{hid}", timeout=60) as r:
            out: dict[str, Any] = json.loads(r.read())
            return out
    except urllib.error.HTTPError as exc:
        if exc.code == 404:
            return None
        raise


def wait_view(
    api: str, hid: str, until: Callable[[dict[str, Any]], bool], timeout_s: float
) -> dict[str, Any]:
    """Polls handoff `hid` until `until(view)`; AssertionError with the last view after
    `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    last = None
    while time.monotonic() < deadline:
        last = view(api, hid)
        if last is not None and until(last):
            return last
        time.sleep(0.1)
    raise AssertionError(f"handoff {hid} after {timeout_s:.0f} s: {last}")


def moving(v: dict[str, Any]) -> bool:
    """A segment of it is committed, more to come (or it ended: the caller says which)."""
    committed = any(e["type"] == "stage.segment_committed" for e in v.get("timeline", []))
    return committed or v["state"] in TERMINAL
