"""A client that drives SGLang servers as SGLang's router does, and the prompts it sends.

A PD request is one `/generate` body sent to the prefill and to the decode at once, with the
same `bootstrap_host`, `bootstrap_port` (the prefill's bootstrap server) and `bootstrap_room`;
the decode's answer is the request's. Prompts are token ids (`--skip-tokenizer-init`), decoding
is greedy with `ignore_eos`, so a PD pair that moved every byte right answers the single
server's tokens exactly.
"""

from __future__ import annotations

import asyncio
import itertools
import random
from dataclasses import dataclass
from typing import Any

import aiohttp

from tests.engines.model import VOCAB, min_margin

NEW_TOKENS = 16
#: How long the client keeps an idle connection to a server for reuse: under SGLang's own
#: keep-alive (uvicorn's, `SGLANG_TIMEOUT_KEEP_ALIVE`, 5 s). With aiohttp's default (15 s), a
#: request sent on a connection the server was closing that moment was lost (`Server
#: disconnected`, the server never saw it) and its other half waited for its deadline.
KEEPALIVE_S = 2.0


def connector() -> aiohttp.TCPConnector:
    """The client side of every engine-server session: no pool limit, idle connections dropped
    before the server drops them (`KEEPALIVE_S`)."""
    return aiohttp.TCPConnector(limit=0, keepalive_timeout=KEEPALIVE_S)


#: Bootstrap rooms whose first committed page the decode's fault hook corrupts
#: (`tests/engines/faults`); `next_room` never hands one out.
CORRUPT_ROOMS = range(1 << 60, (1 << 60) + (1 << 20))
#: Bootstrap rooms whose every landed segment the decode's fault hook holds for `SLOW_COMMIT_S`
#: before committing it, so a request's transfer is still under way when a test disconnects its
#: client or kills its prefill (`next_slow_room`).
SLOW_ROOMS = range(1 << 61, (1 << 61) + (1 << 20))
#: Below the prefill's peer request timeout (5 s), which the held segment notice must not reach.
SLOW_COMMIT_S = 3.0
_rooms = itertools.count(random.Random().randrange(1 << 40) << 8)
_slow_rooms = itertools.count(SLOW_ROOMS.start + random.Random().randrange(1 << 19))


def next_room() -> int:
    """A bootstrap room no request of this session used (SGLang keys transfers by it)."""
    return next(_rooms)


def next_slow_room() -> int:
    """A fresh room in `SLOW_ROOMS`."""
    return next(_slow_rooms)


def handoff_id(room: int) -> str:
    """The decode's handoff of a room (the SGLang backend's id, prefill TP rank 0)."""
    return f"sglang-{room}-tp0"


#: First tokens no prompt of `prompts` has (the ids below avoid the model's special ids): the
#: negative control's prompts start with these, so the corrupted KV the decode's radix cache
#: keeps of them is never the prefix of another request.
MARKERS = range(3, 10)


#: Greedy steps whose top two logits are closer than this are ties that float rounding decides
#: (`model.min_margin`): prompts with one are not used.
MIN_MARGIN = 1e-2


def prompts(
    n: int, *, seed: int, min_len: int = 8, max_len: int = 60, prefix: list[int] | None = None
) -> list[list[int]]:
    """`n` distinct prompts of random token ids (after `prefix`) whose greedy continuation has
    no near-tie, so a single server and a PD pair that moved every byte right answer the same
    tokens whatever their batch shapes."""
    rng = random.Random(seed)
    out: list[list[int]] = []
    while len(out) < n:
        tail = [
            rng.randrange(MARKERS.stop, VOCAB) for _ in range(rng.randrange(min_len, max_len + 1))
        ]
        prompt = [*(prefix or []), *tail]
        if min_margin(prompt, NEW_TOKENS) >= MIN_MARGIN:
            out.append(prompt)
    return out


def body(input_ids: list[int], **extra: Any) -> dict[str, Any]:
    return {
        "input_ids": input_ids,
        "sampling_params": {"temperature": 0, "max_new_tokens": NEW_TOKENS, "ignore_eos": True},
        **extra,
    }


class Failed(Exception):
    """A request the server answered with an error (HTTP status and its body)."""

    def __init__(self, status: int, text: str) -> None:
        super().__init__(f"HTTP {status}: {text}")
        self.status = status
        self.text = text


async def _post(
    session: aiohttp.ClientSession, url: str, payload: dict[str, Any], timeout_s: float
) -> dict[str, Any]:
    async with session.post(
        f"{url}/generate", json=payload, timeout=aiohttp.ClientTimeout(total=timeout_s)
    ) as r:
        text = await r.text()
        if r.status != 200:
            raise Failed(r.status, text)
        out: dict[str, Any] = await r.json(content_type=None)
        finish = out.get("meta_info", {}).get("finish_reason") or {}
        if finish.get("type") == "abort":
            raise Failed(r.status, text)
        return out


async def single(
    session: aiohttp.ClientSession, url: str, input_ids: list[int], timeout_s: float = 300.0
) -> list[int]:
    """A plain server's output token ids for one prompt."""
    return list((await _post(session, url, body(input_ids), timeout_s))["output_ids"])


@dataclass(frozen=True)
class Pair:
    """A prefill (its URL and bootstrap port) and the decode it sends to."""

    prefill: str
    bootstrap_port: int
    decode: str


def bootstrap(pair: Pair, room: int | None = None) -> dict[str, Any]:
    """The fields the router adds to both sides' body (a fresh room unless given)."""
    return {
        "bootstrap_host": "127.0.0.1",
        "bootstrap_port": pair.bootstrap_port,
        "bootstrap_room": next_room() if room is None else room,
    }


async def pd(
    session: aiohttp.ClientSession,
    pair: Pair,
    input_ids: list[int],
    *,
    room: int | None = None,
    timeout_s: float = 300.0,
    decode_only: bool = False,
    prefill_may_fail: bool = False,
) -> list[int]:
    """The PD pair's output token ids for one prompt, sent as the router sends it. Raises
    Failed naming the side whose answer was an error (the decode's first). `decode_only`: the
    prefill never hears of the request (its handoff can only reach its deadline);
    `prefill_may_fail`: the decode's answer is taken whatever the prefill's was (a test that
    kills the prefill)."""
    payload = body(input_ids, **bootstrap(pair, room))
    sides = [] if decode_only else [_post(session, pair.prefill, payload, timeout_s)]
    *prefills, decode = await asyncio.gather(
        *sides,
        _post(session, pair.decode, payload, timeout_s),
        return_exceptions=True,
    )
    prefill = prefills[0] if prefills else None
    if isinstance(decode, BaseException):
        raise decode
    if isinstance(prefill, BaseException) and not prefill_may_fail:
        raise prefill
    return list(decode["output_ids"])
