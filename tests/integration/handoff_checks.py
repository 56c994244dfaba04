"""Playing router and engines against a `LocalDeployment`, and checking what landed.

Source pages are filled with random bytes per test; the check compares, for every decode entry,
the rows of the destination pages with the rows of the source pages of the prefill entry with
the same (layer, group) or (layer, kind), and the untouched decode bytes with the sentinel.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import aiohttp
import numpy as np

from kvhandoff.service.testing.deployment import LocalDeployment

SENTINEL = 0xEE


def rows(view: np.ndarray, item_len: int) -> np.ndarray:
    return view[: (view.shape[0] // item_len) * item_len].reshape(-1, item_len)


def fill_sources(dep: LocalDeployment, seed: int) -> None:
    rng = np.random.default_rng(seed)
    for r in range(dep.pp_size):
        pool = dep.stage_pool(r)
        for i in range(len(pool.regions)):
            view = pool.view(i)
            view[:] = rng.integers(0, 256, view.shape[0], dtype=np.uint8)


def reset_decode(dep: LocalDeployment) -> None:
    for i in range(len(dep.decode_pool.regions)):
        dep.decode_pool.view(i)[:] = SENTINEL


def decode_bytes(dep: LocalDeployment) -> bytes:
    pool = dep.decode_pool
    return b"".join(pool.view(i).tobytes() for i in range(len(pool.regions)))


@dataclass(frozen=True)
class Moved:
    """One request's placement on both sides."""

    src_pages: list[int]
    dst_pages: list[int]
    src_slot: int | None
    dst_slot: int | None


def landed(
    dep: LocalDeployment, moves: Iterable[Moved], layers: set[int] | None = None
) -> list[str]:
    """Every mismatch between what `moves` should have put in the decode pool and what is there
    (restricted to `layers` when given); untouched pages and slots must hold the sentinel."""
    moves = list(moves)
    problems = []
    dec_layout, dec_pool = dep.decode_layout, dep.decode_pool
    sources: dict[tuple[str, int, Any], tuple[int, int]] = {}  # key -> (rank, region)
    for r, layout in dep.stage_layouts.items():
        for i, e in enumerate(layout.kv):
            sources[("kv", e.layer_id, e.group)] = (r, i)
        for j, s in enumerate(layout.state):
            sources[("state", s.layer_id, s.kind)] = (r, len(layout.kv) + j)
    entries = [("kv", e.layer_id, e.group, e.item_len) for e in dec_layout.kv] + [
        ("state", s.layer_id, s.kind, s.item_len) for s in dec_layout.state
    ]
    for index, (kind, layer, which, item_len) in enumerate(entries):
        if layers is not None and layer not in layers:
            continue
        rank, src_index = sources[(kind, layer, which)]
        got = rows(dec_pool.view(index), item_len)
        src = rows(dep.stage_pool(rank).view(src_index), item_len)
        touched = np.zeros(got.shape[0], dtype=bool)
        for m in moves:
            if kind == "kv":
                want, at = src[m.src_pages], m.dst_pages
            else:
                assert m.src_slot is not None and m.dst_slot is not None
                want, at = src[[m.src_slot]], [m.dst_slot]
            if not np.array_equal(got[at], want):
                problems.append(f"{kind} layer {layer} {which}: wrong bytes at {at}")
            touched[at] = True
        if not (got[~touched] == SENTINEL).all():
            problems.append(f"{kind} layer {layer} {which}: bytes outside the destination changed")
    return problems


async def create(
    http: aiohttp.ClientSession, dep: LocalDeployment, hid: str, m: Moved, **extra: Any
) -> tuple[int, dict[str, Any]]:
    body = {"id": hid, "prefill": dep.prefill_urls, "dst_pages": m.dst_pages, **extra}
    if m.dst_slot is not None:
        body["dst_slot"] = m.dst_slot
    async with http.post(f"{dep.decode_url}/v1/handoffs", json=body) as resp:
        return resp.status, await resp.json(content_type=None)


async def ready(
    http: aiohttp.ClientSession,
    dep: LocalDeployment,
    hid: str,
    rank: int,
    m: Moved,
    layers: list[int] | None = None,
) -> tuple[int, dict[str, Any]]:
    body: dict[str, Any] = {"src_pages": m.src_pages}
    if m.src_slot is not None:
        body["src_slot"] = m.src_slot
    if layers is not None:
        body["layers"] = layers
    url = f"{dep.url_of_stage(rank)}/v1/handoffs/{hid}/stages/{rank}/ready"
    async with http.post(url, json=body) as resp:
        return resp.status, await resp.json(content_type=None)


async def complete(http: aiohttp.ClientSession, dep: LocalDeployment, hid: str, m: Moved) -> None:
    """Create handoff `hid` and signal every stage ready (each accepted)."""
    assert (await create(http, dep, hid, m))[0] == 201
    for r in range(dep.pp_size):
        assert (await ready(http, dep, hid, r, m))[0] == 202


async def finished(
    http: aiohttp.ClientSession, dep: LocalDeployment, hid: str, timeout_s: float = 30.0
) -> dict[str, Any]:
    """The handoff's view once terminal (long poll; fails the test after `timeout_s`)."""
    url = f"{dep.decode_url}/v1/handoffs/{hid}?wait_s={timeout_s}"
    async with http.get(url) as resp:
        view: dict[str, Any] = await resp.json()
    assert view["state"] in ("completed", "failed", "aborted"), view
    return view
