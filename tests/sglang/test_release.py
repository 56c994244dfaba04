"""The boundary rule against SGLang's own code: a decode request that fails while its bytes are
on their way gets its pages back from SGLang's `DecodeTransferQueue` (`pop_transferred`, then
`resolve_deferred_releases`, as its scheduler runs them) only once kvhandoff released them, so
the next request given those pages by SGLang's allocator keeps its bytes. A prefill of two PP
stages and a decode, each in its own process, real Mooncake over TCP (`test_backend.deploy`);
the decode drives SGLang's queue (`transfer_queue.py`)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
from sglang.srt.disaggregation.base.conn import KVPoll

from service.integrations.sglang.layouts import Unsupported
from service.integrations.sglang.refusals import refuse_early_release
from tests.sglang.test_backend import Deployment, deploy, logged

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    with deploy(tmp_path_factory.mktemp("release"), [(0, {}), (1, {})], [{}], 2) as d:
        yield d


def fail_while_sending(d: Deployment, room: int, fail: str) -> dict[str, Any]:
    """Both stages signal room's pages first (they wait for the destination), then the decode
    asks for the handoff and SGLang aborts the request: at once (`at_once`: its create still
    queued) or once the handoff exists and its bytes are landing (`transferring`)."""
    src = list(range(1, 9))
    for p in d.prefill:
        p.ask(
            {"op": "request", "room": room, "pages": src, "aux": 1, "chunks": [4, 4]}
            | {"timeout_s": 15.0}
        )
    for p in d.prefill:
        logged(p, d.tmp, f"signalled sglang-{room}-tp0 last=True")
    d.decode.ask({"op": "boundary", "room": room, "pages": src, "aux": 2, "fail": fail})
    decode = d.decode.answer()
    prefill = [p.answer() for p in d.prefill]
    d.prefill[1].ask({"op": "clear", "room": room, "failed": True})
    assert d.prefill[1].answer()["cleared"] == room
    assert prefill[0]["final"] == KVPoll.Failed, prefill  # the decode's abort reached them
    return decode


@pytest.mark.parametrize("fail", ["at_once", "transferring"])
def test_sglang_reuses_a_failed_request_s_pages_only_after_kvhandoff_released_them(
    pair: Deployment, fail: str
) -> None:
    decode = fail_while_sending(pair, 7801 if fail == "at_once" else 7802, fail)
    # SGLang's allocator gave the next request the failed one's pages (the pool was full).
    assert sorted(decode["reused"]) == sorted(decode["pages"]), decode
    assert decode["released_s"] is not None, json.dumps(decode)  # kvhandoff released it
    # ... only after kvhandoff released them, and no write of the failed handoff landed there.
    assert decode["freed_s"] >= decode["released_s"], decode
    assert decode["intact"], decode
    assert decode["held"] == 0, decode  # nothing left in SGLang's deferred releases


def test_a_release_timeout_shorter_than_kvhandoff_s_longest_hold_is_refused_by_name(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    handoff = SimpleNamespace(default_deadline_s=30.0, max_grace_s=60.0)
    timeout = "SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE_TIMEOUT"
    monkeypatch.setenv(timeout, "89.5")
    with pytest.raises(Unsupported, match=f"{timeout} = 89.5 s .* = 90 s"):
        refuse_early_release(handoff)
    monkeypatch.setenv(timeout, "90")
    refuse_early_release(handoff)  # SGLang's clock starts later (at Failed): enough
    monkeypatch.setenv("SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE", "0")
    with pytest.raises(Unsupported, match="DEFERRED_DECODE_KV_RELEASE=0"):
        refuse_early_release(handoff)
