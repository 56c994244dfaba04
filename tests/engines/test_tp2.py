"""Equal TP 2: a prefill of TP 2 into a decode of TP 2 answers the single server's tokens (each
prefill rank's handoff lands in its own decode rank).

Its two servers are four scheduler processes: they run alone, after every other case, once the
session's other servers are stopped (`alone`), and start together. The reference is the TP 1
single server's tokens, asked before it stops (prompts whose greedy continuation has no
near-tie answer the same tokens whatever the TP size sums the heads in).
"""

from __future__ import annotations

import pytest

from tests.engines.client import Pair
from tests.engines.conftest import Reference, Servers
from tests.engines.test_pd import pd_tokens

pytestmark = pytest.mark.alone


@pytest.fixture(scope="module")
def pair_tp2(servers: Servers, reference: Reference, mixed_prompts: list[list[int]]) -> Pair:
    reference.of(mixed_prompts)
    servers.stop_all()
    decode, prefill = servers.up("decode-tp2", "prefill-tp2")
    return Pair(prefill.url, prefill.bootstrap_port, decode.url)


def test_equal_tp2_answers_the_single_server_s_tokens(
    pair_tp2: Pair, reference: Reference, mixed_prompts: list[list[int]]
) -> None:
    assert pd_tokens(pair_tp2, mixed_prompts) == reference.of(mixed_prompts)
