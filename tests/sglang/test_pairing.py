"""Which layouts a decode rank pairs with, the excusal a prefill rank takes, and what a decode
refuses at start-up."""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from types import SimpleNamespace

import pytest

from kvhandoff.service.integrations.sglang import excusal
from kvhandoff.service.integrations.sglang.layouts import Unsupported
from kvhandoff.service.integrations.sglang.refusals import (
    refuse_decode_prefix_reuse,
    refuse_rust_registry,
    tp_pairing_refusal,
)

SECRET = b"peer-secret"
URL = "http://10.0.0.7:43001"


def refusal(prefill: int, decode: int, **kw: bool) -> str | None:
    shape = {"mla": True, "hybrid_mla": False, "state": False, **kw}
    return tp_pairing_refusal(prefill, decode, **shape)


@pytest.mark.parametrize(
    ("prefill", "decode"), [(1, 1), (2, 2), (2, 1), (8, 2), (4, 1), (1, 2), (2, 8), (1, 4)]
)
def test_equal_tp_and_mla_tp_of_k_times_the_other_side_s_pair(prefill: int, decode: int) -> None:
    assert refusal(prefill, decode) is None


def test_equal_tp_pairs_any_model() -> None:
    assert refusal(4, 4, mla=False, state=True) is None
    assert refusal(2, 2, hybrid_mla=True) is None


@pytest.mark.parametrize(
    ("prefill", "decode", "shape", "named"),
    [
        (2, 1, {"mla": False}, "for MLA models only"),
        (2, 1, {"hybrid_mla": True}, "for MLA models only"),
        (1, 2, {"mla": False}, "for MLA models only"),
        (3, 2, {}, "the prefill's attention TP is not a multiple"),
        (2, 3, {}, "the decode's attention TP is not a multiple"),
        (2, 1, {"state": True}, "without state components"),
        (1, 2, {"state": True}, "without state components"),
    ],
)
def test_other_unequal_tp_is_refused_naming_why_and_both_sizes(
    prefill: int, decode: int, shape: dict[str, bool], named: str
) -> None:
    why = refusal(prefill, decode, **shape)
    assert why is not None and named in why, why
    assert f"prefill attention TP {prefill}, decode {decode}" in why, why


def test_an_excusal_is_read_for_its_room_by_the_rank_it_names() -> None:
    assert excusal.read((SECRET,), excusal.excusal(SECRET, 71, URL), URL) == (71, None)


@pytest.mark.parametrize(
    ("frames", "why"),
    [  # made when the test runs: a signature is fresh only for `MAX_SKEW_S`
        (lambda: excusal.excusal(b"another-secret", 71, URL), "bad signature"),
        (lambda: excusal.excusal(SECRET, 71, "http://10.0.0.8:43001"), "signed for the rank at"),
        (lambda: [excusal.TAG, b"71", URL.encode()], "not an excusal"),
        (lambda: [b"BOOTSTRAP", b"71", b"1.2.3.4", b"9"], "not an excusal"),
        (lambda: [excusal.TAG, b"seventy", URL.encode(), b"t=1,v1=00"], "malformed"),
    ],
)
def test_anything_else_is_refused_saying_why(frames: Callable[[], list[bytes]], why: str) -> None:
    room, said = excusal.read((SECRET,), frames(), URL)
    assert room is None and said is not None and why in said, said


def test_during_a_secret_rotation_an_excusal_signed_with_either_secret_is_taken() -> None:
    new, old = b"new-peer-secret", SECRET
    for signer in (new, old):
        assert excusal.read((new, old), excusal.excusal(signer, 9, URL), URL) == (9, None)
    assert "bad signature" in str(excusal.read((new,), excusal.excusal(old, 9, URL), URL)[1])


def test_a_stale_or_retargeted_excusal_is_refused() -> None:
    stale = excusal.excusal(SECRET, 71, URL)
    body = f"71\n{URL}".encode()
    stale[3] = excusal.sign(
        SECRET, excusal.METHOD, excusal.PATH, body, now=time.time() - 600
    ).encode()
    assert "away from this server's clock" in str(excusal.read((SECRET,), stale, URL)[1])
    never = excusal.excusal(SECRET, 71, URL)
    # Signed with the secret for the time "nan", which no skew would ever exceed.
    never[3] = excusal.sign(SECRET, excusal.METHOD, excusal.PATH, body, now=math.nan).encode()
    assert "bad timestamp" in str(excusal.read((SECRET,), never, URL)[1])
    moved = excusal.excusal(SECRET, 71, URL)
    moved[1] = b"72"  # the same signature for another room
    assert "bad signature" in str(excusal.read((SECRET,), moved, URL)[1])


def test_a_decode_radix_cache_is_refused_only_beside_sglang_s_kv_checksum() -> None:
    # SGLang's checksum would digest the whole request on the prefill (which never learns the
    # decode's prefix) and the suffix on the decode: every cache hit would fail.
    from sglang.srt.server_args import ServerArgs

    cache, checksum = (
        "disaggregation_decode_enable_radix_cache",
        "disaggregation_enable_kv_checksum",
    )
    assert {cache, checksum} <= set(ServerArgs.__struct_fields__)  # SGLang's own fields
    both = SimpleNamespace(**{cache: True, checksum: True})
    with pytest.raises(Unsupported, match="--disaggregation-enable-kv-checksum with"):
        refuse_decode_prefix_reuse(both, prefill=False)
    refuse_decode_prefix_reuse(SimpleNamespace(**{cache: True, checksum: False}), prefill=False)
    refuse_decode_prefix_reuse(SimpleNamespace(**{cache: False, checksum: True}), prefill=False)
    refuse_decode_prefix_reuse(both, prefill=True)  # the radix cache is a decode flag


def test_the_rust_registry_with_dp_attention_is_refused_at_start_up_by_name(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("SGLANG_RUST_SERVER", "1")
    with pytest.raises(Unsupported, match="SGLANG_RUST_SERVER with DP attention"):
        refuse_rust_registry(prefill=True, attn_dp_size=2)
    refuse_rust_registry(prefill=True, attn_dp_size=1)  # registers with kvhandoff's server
    refuse_rust_registry(prefill=False, attn_dp_size=2)  # a decode registers nothing
    monkeypatch.setenv("SGLANG_RUST_SERVER", "0")
    refuse_rust_registry(prefill=True, attn_dp_size=2)
