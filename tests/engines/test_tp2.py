"""Equal TP 2: a prefill of TP 2 into a decode of TP 2 answers the single server's tokens (each
prefill rank's handoff lands in its own decode rank).

Opt-in (`KVHANDOFF_ENGINE_TP2=1`, `make test-engines-tp2`), not in `make test`: its two
servers are four scheduler processes more on a 2-core machine, and their start-up alone
exceeds this suite's time bound there (docs/guides/sglang/support.md has the measured times).
"""

from __future__ import annotations

import os

import pytest

from tests.engines.client import Pair
from tests.engines.conftest import Reference, Servers
from tests.engines.test_pd import pd_tokens

pytestmark = pytest.mark.skipif(
    os.environ.get("KVHANDOFF_ENGINE_TP2") != "1",
    reason="TP 2 servers are opt-in: KVHANDOFF_ENGINE_TP2=1 (make test-engines-tp2)",
)


@pytest.fixture(scope="module")
def pair_tp2(servers: Servers) -> Pair:
    decode = servers.start("decode-tp2")
    prefill = servers.start("prefill-tp2")
    return Pair(prefill.url, prefill.bootstrap_port, decode.url)


def test_equal_tp2_answers_the_single_server_s_tokens(
    pair_tp2: Pair, reference: Reference, mixed_prompts: list[list[int]]
) -> None:
    assert pd_tokens(pair_tp2, mixed_prompts) == reference.of(mixed_prompts)
