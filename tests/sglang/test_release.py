"""The boundary rule against SGLang's own code: a decode request that fails while its bytes are
on their way gets its pages back from SGLang's `DecodeTransferQueue` (`pop_transferred`, then
`resolve_deferred_releases`, as its scheduler runs them) only once kvhandoff released them, so
the next request given those pages by SGLang's allocator keeps its bytes. A prefill of two PP
stages and a decode, each in its own process, real Mooncake over TCP (`test_backend.deploy`),
in both transfer modes; the decode drives SGLang's queue (`transfer_queue.py`)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
from sglang.srt.disaggregation.base.conn import KVPoll

from kvhandoff.service.integrations.sglang.layouts import Unsupported
from kvhandoff.service.integrations.sglang.refusals import refuse_early_release
from tests.sglang.test_backend import Deployment, deploy, logged

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module", params=["landed", "direct"])
def pair(
    tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest
) -> Iterator[Deployment]:
    tmp = tmp_path_factory.mktemp(f"release-{request.param}")
    with deploy(tmp, [(0, {}), (1, {})], [{}], 2, mode=request.param) as d:
        yield d


#: How long the prefill processes are stopped from the failure on: SGLang sees the request
#: Failed at once; kvhandoff's release waits for them where it must (their abort ack).
PAUSE_S = 1.0


def fail_while_sending(d: Deployment, room: int, fail: str) -> dict[str, Any]:
    """Both stages signal room's pages first (they wait for the destination), then the decode
    asks for the handoff and SGLang aborts the request: at once (`at_once`: its create still
    queued) or once the handoff exists and its bytes are landing (`transferring`). The prefill
    processes stop at the failure for `PAUSE_S`."""
    src = list(range(1, 9))
    for p in d.prefill:
        p.ask(
            {"op": "request", "room": room, "pages": src, "aux": 1, "chunks": [4, 4]}
            | {"timeout_s": 15.0}
        )
    for p in d.prefill:
        logged(p, d.tmp, f"signalled sglang-{room}-tp0 last=True")
    pause = {"pids": [p.popen.pid for p in d.prefill], "s": PAUSE_S}
    d.decode.ask(
        {"op": "boundary", "room": room, "pages": src, "aux": 2, "fail": fail, "pause": pause}
    )
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
    assert decode["failed_seen_s"] is not None, decode
    if pair.mode == "direct" or fail == "at_once":
        # The premise: SGLang saw the request Failed while kvhandoff still held its pages,
        # waiting for the stopped prefills (direct mode: their writes reach the pages; a create
        # still queued: it waits for them), so a queue that freed the pages at Failed, without
        # asking `is_abort_release_safe`, would have freed them before the release.
        assert decode["released_s"] > decode["failed_seen_s"] + PAUSE_S / 2, decode
    # Landed mode releases a transferring handoff once no commit of it runs (its prefills
    # write only landing windows): there the release rule guards a running commit only.
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
