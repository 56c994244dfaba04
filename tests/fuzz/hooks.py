"""Schemathesis hooks for fuzzing a live deployment (loaded through SCHEMATHESIS_HOOKS).

Generated data stays what hypothesis makes of the OpenAPI document, with one adjustment that
keeps the run about this service rather than the network around it: a well-formed peer URL in
a body is pointed at the deployment's own services (from KVHANDOFF_FUZZ_PREFILL / _DECODE), since
a random host answers nothing (a 502, correctly). (The long poll's wait is fixed short in
schemathesis.toml.)
"""

from __future__ import annotations

import os
import re
from typing import Any

import schemathesis

_URL = re.compile(r"^https?://")
PREFILL = [u for u in os.environ.get("KVHANDOFF_FUZZ_PREFILL", "").split(",") if u]
DECODE = os.environ.get("KVHANDOFF_FUZZ_DECODE", "")


def _real(urls: Any) -> Any:
    if isinstance(urls, list) and urls and all(isinstance(u, str) and _URL.match(u) for u in urls):
        return list(PREFILL)
    return urls


@schemathesis.hook
def map_body(ctx: Any, body: Any) -> Any:
    if isinstance(body, dict):
        for key in ("prefill", "prefill_urls"):
            if key in body:
                body[key] = _real(body[key])
        url = body.get("decode_url")
        if isinstance(url, str) and _URL.match(url) and DECODE:
            body["decode_url"] = DECODE
    return body
