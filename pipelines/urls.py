"""One canonical form for a service's URL, used wherever two URLs are compared.

A peer is known by the URL it is configured with (`server.public_url`), the URL a router names
it by (a handoff's `prefill`), and the URL a signed message names as its sender or recipient.
These compare equal only in one form: scheme and host in lower case, no default port, no
trailing slash (`http://P:80/` and `http://p` are one service).
"""

from __future__ import annotations

from typing import Annotated

from msgspec import Meta
from yarl import URL

_DEFAULT_PORTS = {"http": 80, "https": 443}


#: A service's base URL as an input names it (a ready signal's `decode_url`).
ServiceUrl = Annotated[str, Meta(pattern=r"^https?://", max_length=2048)]


def canonical_url(url: str) -> str:
    """`url` in the one form peers compare; a string yarl cannot parse is only stripped of
    trailing slashes (it then matches nothing but itself)."""
    try:
        parsed = URL(url)
        port = parsed.explicit_port
    except (ValueError, TypeError):
        return url.rstrip("/")
    scheme = parsed.scheme.lower()
    host = parsed.raw_host
    if not scheme or host is None:
        return url.rstrip("/")
    host = host.lower()
    if ":" in host:  # IPv6: yarl drops the brackets
        host = f"[{host}]"
    netloc = host if port is None or port == _DEFAULT_PORTS.get(scheme) else f"{host}:{port}"
    return f"{scheme}://{netloc}{parsed.raw_path.rstrip('/')}"
