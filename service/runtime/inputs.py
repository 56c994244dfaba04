"""Checks on router and engine input that the body types cannot express, shared by every door.

Called by the admission of a create (`kvhandoff.service.runtime.admission`, HTTP and embedded
alike), by `kvhandoff.service.api.validate` and by the engine route, after a body decoded: peer URLs
the service is about to call (a bad one must be the caller's 422 naming the field, not this
service's 502 from a failed connection), page numbers beyond what any pool can index (named as
the client sent them, before numpy would wrap them), and path parameters. Each raises
`InvalidInput` naming the field and changes nothing.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

import msgspec
from yarl import URL

from kvhandoff.pipelines.errors import InvalidInput
from kvhandoff.pipelines.urls import canonical_url

#: The largest page index any pool can hold: page lists become int64 arrays.
MAX_PAGE = 2**63 - 1

_encoder = msgspec.json.Encoder()
_INT = re.compile(r"-?[0-9]{1,20}", re.ASCII)
_NUMBER = re.compile(r"-?[0-9]{1,20}(\.[0-9]{0,20})?([eE][-+]?[0-9]{1,3})?", re.ASCII)
_ASCII_INT = re.compile(r"[0-9]{1,9}", re.ASCII)
_HOST = re.compile(r"^[A-Za-z0-9._:-]+$")  # a name, IPv4, or IPv6 (yarl strips the brackets)


def peer_url(url: str, field: str) -> str:
    """`url` in canonical form (`kvhandoff.pipelines.urls`: as services' `public_url` are compared)
    if it can name a kvhandoff service: http(s), a host, a port in 1..65535, no credentials,
    query or fragment; InvalidInput naming `field` otherwise."""
    try:
        parsed = URL(url)
        port = parsed.explicit_port
    except (ValueError, TypeError) as exc:
        raise InvalidInput(f"{field}: {url!r} is not a URL ({exc})", field=field) from None
    problem = None
    if parsed.scheme not in ("http", "https"):
        problem = "is not an http(s) URL"
    elif not parsed.raw_host or not _HOST.match(parsed.raw_host):
        problem = "has no valid host"
    elif port is not None and not 1 <= port <= 65535:
        problem = f"has port {port}, not in 1..65535"
    elif parsed.user is not None or parsed.password is not None:
        problem = "carries credentials"
    elif parsed.raw_query_string or parsed.raw_fragment:
        problem = "has a query or fragment"
    elif any(c.isspace() or ord(c) < 0x20 for c in url):
        problem = "contains whitespace or control characters"
    if problem:
        raise InvalidInput(f"{field}: {url!r} {problem}", field=field)
    return canonical_url(url)


def peer_urls(urls: Sequence[str], field: str) -> list[str]:
    return [peer_url(url, f"{field}[{i}]") for i, url in enumerate(urls)]


def pages(values: Sequence[int], field: str) -> None:
    """Refuse a page index no pool can have, naming the value as sent (not as int64 wraps it)."""
    for i, value in enumerate(values):
        if value > MAX_PAGE:
            raise InvalidInput(
                f"{field}[{i}] = {value} is beyond the largest page index {MAX_PAGE}",
                field=f"{field}[{i}]",
            )


def slot(value: int | None, field: str) -> None:
    if value is not None and value > MAX_PAGE:
        raise InvalidInput(
            f"{field} = {value} is beyond the largest slot index {MAX_PAGE}", field=field
        )


def slots(single: int | None, by_component: Mapping[str, int], aux: int | None, side: str) -> None:
    """`slot` for every index of one side: `<side>_slot`, `<side>_slots.<component>`,
    `<side>_aux`."""
    slot(single, f"{side}_slot")
    for component, value in by_component.items():
        slot(value, f"{side}_slots.{component}")
    slot(aux, f"{side}_aux")


def metadata(value: dict[str, Any], limit_bytes: int, field: str) -> None:
    """Refuse a `metadata` object whose JSON exceeds `limit_bytes`: it is echoed in every event,
    record and webhook of its handoff, and held in the decode's history."""
    size = len(_encoder.encode(value))
    if size > limit_bytes:
        raise InvalidInput(
            f"{field} is {size} bytes as JSON; at most {limit_bytes} (handoff.max_metadata_bytes)",
            field=field,
            max_bytes=limit_bytes,
        )


def ascii_int(raw: str, field: str) -> int:
    """A path segment of ASCII digits (no superscript, circled or fullwidth digits) as an int."""
    if not _ASCII_INT.fullmatch(raw):
        raise InvalidInput(f"{field} {raw!r} is not a non-negative integer", field=field)
    return int(raw)


def query_number(
    query: Mapping[str, str], name: str, default: float, lo: float, hi: float, kind: type = int
) -> float:
    """Query parameter `name` as an int (or a float with `kind=float`) within [lo, hi]; its
    `default` when absent. ASCII digits only: int() and float() also take fullwidth digits,
    "1_0" or " 1"."""
    raw = query.get(name)
    if raw is None:
        return default
    try:
        if not (_INT if kind is int else _NUMBER).fullmatch(raw):
            raise ValueError(raw)
        value = kind(raw)
    except ValueError:
        raise InvalidInput(
            f"{name}={raw!r} is not a{'n integer' if kind is int else ' number'}", field=name
        ) from None
    if not lo <= value <= hi:
        raise InvalidInput(f"{name}={raw} is not within [{lo:g}, {hi:g}]", field=name)
    return value  # type: ignore[no-any-return]
