"""A PD pair of real SGLang servers over kvhandoff answers a single server's greedy tokens.

Every case compares the decode's output token ids with the single server's for the same
prompts (`Reference`), so a byte moved to the wrong layer, page or request shows as a token.
The negative control shows that comparison fails when committed KV is corrupted.
"""

from __future__ import annotations

import asyncio

import aiohttp

from tests.engines.client import CORRUPT_ROOMS, MARKERS, Pair, pd, prompts
from tests.engines.conftest import CHUNK_TOKENS, Reference, run


def pd_tokens(pair: Pair, batch: list[list[int]]) -> list[list[int]]:
    """The pair's tokens for every prompt, all in flight at once."""

    async def go(session: aiohttp.ClientSession) -> list[list[int]]:
        return list(await asyncio.gather(*(pd(session, pair, p) for p in batch)))

    return run(go)


def test_pp1_prefill_with_chunks_answers_the_single_server_s_tokens(
    pair: Pair, reference: Reference, mixed_prompts: list[list[int]]
) -> None:
    assert any(len(p) > CHUNK_TOKENS for p in mixed_prompts)  # some are chunked
    assert any(len(p) <= CHUNK_TOKENS for p in mixed_prompts)  # some are not
    assert pd_tokens(pair, mixed_prompts) == reference.of(mixed_prompts)


def test_a_corrupted_page_changes_the_tokens(pair: Pair, reference: Reference) -> None:
    """The negative control: the decode's fault hook flips every committed KV page of these rooms
    (and no other), so the comparison every other case relies on must fail here. Fresh
    prompts (a prefix the decode's radix cache holds would not be sent at all), each starting
    with a marker no other prompt has (the radix cache keeps the corrupted page, and would
    hand it to a later request sharing the prefix)."""
    plain = prompts(3, seed=2, min_len=8, max_len=3 * CHUNK_TOKENS)
    batch = [[m, *p] for m, p in zip(MARKERS, plain)]
    expected = reference.of(batch)

    async def go(session: aiohttp.ClientSession) -> list[list[int]]:
        rooms = [CORRUPT_ROOMS.start + i for i in range(len(batch))]
        return list(
            await asyncio.gather(*(pd(session, pair, p, room=r) for p, r in zip(batch, rooms)))
        )

    corrupted = run(go)
    assert all(c != e for c, e in zip(corrupted, expected, strict=True)), corrupted


def test_pp2_prefill_to_pp1_decode_pairs_layers_by_global_id(
    pair_pp2: Pair, reference: Reference, mixed_prompts: list[list[int]]
) -> None:
    assert pd_tokens(pair_pp2, mixed_prompts) == reference.of(mixed_prompts)


def test_the_decode_radix_cache_receives_only_the_pages_after_a_held_prefix(
    pair: Pair, pair_pp2: Pair, reference: Reference
) -> None:
    """Prompts sharing a long prefix, one at a time, so the decode holds the prefix of the
    first when the next arrive (through both prefills: the PP 2 one's stages start mid-prefix
    too)."""
    prefix = prompts(1, seed=7, min_len=3 * CHUNK_TOKENS, max_len=3 * CHUNK_TOKENS)[0]
    batch = prompts(4, seed=8, min_len=5, max_len=20, prefix=prefix)
    expected = reference.of(batch)
    for i, (p, e) in enumerate(zip(batch, expected, strict=True)):
        assert pd_tokens(pair if i % 2 == 0 else pair_pp2, [p]) == [e], i


def test_32_requests_in_flight_at_once_each_answer_the_single_server_s_tokens(
    pair: Pair, reference: Reference
) -> None:
    """Concurrent load: 32 requests sent together (chunked and not), all in the decode's pool
    at once (`DECODE_TOKENS`)."""
    batch = prompts(32, seed=3, min_len=8, max_len=3 * CHUNK_TOKENS)
    assert pd_tokens(pair, batch) == reference.of(batch)
