"""Peer request signatures and their answers: what verifies, what is refused, relays and replays
(kvhandoff.service.http.peer_signing)."""

from __future__ import annotations

import re

import pytest

from kvhandoff.service.http.peer_signing import (
    ANSWER_SIGNATURE_HEADER,
    NONCE_HEADER,
    RECIPIENT_HEADER,
    RECIPIENT_INCARNATION_HEADER,
    RESPONDER_HEADER,
    RESPONDER_INCARNATION_HEADER,
    SENDER_HEADER,
    SIGNATURE_HEADER,
    TIMESTAMP_HEADER,
    AnswerRejected,
    AnswerSigner,
    SignatureRejected,
    Signer,
    Verifier,
)
from tests.fakes import Clock

SENDER = "http://127.0.0.1:8201"
HERE = "http://127.0.0.1:8100"  # the verifying service
ELSEWHERE = "http://127.0.0.1:8101"  # another service holding the same peer secret
LIFE = "life-1"


@pytest.fixture
def clock() -> Clock:
    return Clock(1_000_000.0)


def verifier(
    clock: Clock, secrets: tuple[str, ...] = ("k1",), capacity: int = 100, url: str = HERE
) -> Verifier:
    return Verifier(
        secrets, url=url, incarnation=LIFE, max_skew_s=30, capacity=capacity, clock=clock
    )


def signed(
    clock: Clock,
    secret: str = "k1",
    body: bytes = b"[]",
    *,
    sender: str = SENDER,
    recipient: str = HERE,
    incarnation: str = "",
) -> dict[str, str | None]:
    signer = Signer(secret, sender, clock=clock)
    return dict(
        signer.headers(
            "POST",
            "/v1/peer/arrivals",
            body,
            recipient=recipient,
            recipient_incarnation=incarnation,
        )
    )


def test_a_signed_request_verifies_and_names_its_sender(clock: Clock) -> None:
    assert verifier(clock).verify("POST", "/v1/peer/arrivals", signed(clock), b"[]") == SENDER


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        (lambda h: {**h, SENDER_HEADER: "http://127.0.0.1:9999"}, "does not verify"),
        (lambda h: {**h, RECIPIENT_HEADER: ELSEWHERE}, "does not verify"),
        (lambda h: {**h, RECIPIENT_INCARNATION_HEADER: LIFE}, "does not verify"),
        (lambda h: {**h, TIMESTAMP_HEADER: str(float(h[TIMESTAMP_HEADER]) + 1)}, "does not"),
        (lambda h: {**h, NONCE_HEADER: "other"}, "does not verify"),
        (lambda h: {**h, SIGNATURE_HEADER: "v1=" + "0" * 64}, "does not verify"),
        (lambda h: {**h, SIGNATURE_HEADER: "v2=" + h[SIGNATURE_HEADER][3:]}, "must be v1="),
        (lambda h: {**h, SIGNATURE_HEADER: "v1=\u00e9" + h[SIGNATURE_HEADER][4:]}, "must be v1="),
        (lambda h: {**h, SIGNATURE_HEADER: None}, "missing KVHandoff-Signature"),
        (lambda h: {**h, TIMESTAMP_HEADER: "nan"}, "at most 30 s"),
        (lambda h: {**h, TIMESTAMP_HEADER: "soon"}, "not a number"),
        (lambda h: {**h, NONCE_HEADER: "n" * 65}, "1..64 characters"),
    ],
)
def test_any_change_to_a_signed_request_is_refused(clock: Clock, change, reason: str) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(SignatureRejected, match=reason) as info:
        verifier(clock).verify("POST", "/v1/peer/arrivals", change(signed(clock)), b"[]")
    assert not info.value.replayed


@pytest.mark.parametrize(
    ("method", "path", "body"),
    [
        ("GET", "/v1/peer/arrivals", b"[]"),
        ("POST", "/v1/peer/stage-failures", b"[]"),
        ("POST", "/v1/peer/arrivals", b"[{}]"),
    ],
)
def test_a_signature_covers_method_path_and_body(
    clock: Clock, method: str, path: str, body: bytes
) -> None:
    with pytest.raises(SignatureRejected, match="does not verify"):
        verifier(clock).verify(method, path, signed(clock), body)


def test_another_secret_does_not_verify_but_a_previous_one_does(clock: Clock) -> None:
    with pytest.raises(SignatureRejected, match="does not verify"):
        verifier(clock).verify("POST", "/v1/peer/arrivals", signed(clock, "router"), b"[]")
    rotating = verifier(clock, ("k2", "k1"))  # k2 current, k1 still accepted during rotation
    for secret in ("k1", "k2"):
        assert rotating.verify("POST", "/v1/peer/arrivals", signed(clock, secret), b"[]")


@pytest.mark.parametrize("skew_s", [-30.5, 31, 3600])
def test_a_timestamp_outside_the_window_is_refused(clock: Clock, skew_s: float) -> None:
    headers = signed(Clock(clock.now + skew_s))
    with pytest.raises(SignatureRejected, match="from this service's clock"):
        verifier(clock).verify("POST", "/v1/peer/arrivals", headers, b"[]")


def test_a_replay_is_refused(clock: Clock) -> None:
    v = verifier(clock)
    headers = signed(clock)
    v.verify("POST", "/v1/peer/arrivals", headers, b"[]")
    clock.now += 10
    with pytest.raises(SignatureRejected, match="already received") as info:
        v.verify("POST", "/v1/peer/arrivals", headers, b"[]")
    assert info.value.replayed


def test_the_cache_is_bounded_and_never_lets_an_evicted_nonce_replay(clock: Clock) -> None:
    v = verifier(clock, capacity=4)
    sent = []
    for _ in range(10):
        clock.now += 0.01
        sent.append(signed(clock))
        v.verify("POST", "/v1/peer/arrivals", sent[-1], b"[]")
    assert len(v) <= 4
    for headers in sent:  # evicted or remembered: none is accepted twice
        with pytest.raises(SignatureRejected) as info:
            v.verify("POST", "/v1/peer/arrivals", headers, b"[]")
        assert info.value.replayed
    clock.now += 0.01
    assert v.verify("POST", "/v1/peer/arrivals", signed(clock), b"[]") == SENDER  # new: fine


def test_expired_nonces_are_forgotten(clock: Clock) -> None:
    v = verifier(clock)
    for _ in range(50):
        v.verify("POST", "/v1/peer/arrivals", signed(clock), b"[]")
    clock.now += 31  # all of them are now outside the window: refused by timestamp anyway
    v.verify("POST", "/v1/peer/arrivals", signed(clock), b"[]")
    assert len(v) == 1


def test_a_request_signed_for_another_service_is_refused_there(clock: Clock) -> None:
    """The relay of issue 18: a request the sender signed for one service (an attacker's
    listener) is refused by every other service holding the same secret."""
    headers = signed(clock, recipient=ELSEWHERE)
    with pytest.raises(
        SignatureRejected, match=re.escape("signed for http://127.0.0.1:8101")
    ) as info:
        verifier(clock).verify("POST", "/v1/peer/arrivals", headers, b"[]")
    assert not info.value.replayed and not info.value.stale
    # ... and the same request verifies where it was meant to go
    assert verifier(clock, url=ELSEWHERE).verify("POST", "/v1/peer/arrivals", headers, b"[]")


def test_the_recipient_is_compared_in_its_canonical_form(clock: Clock) -> None:
    headers = signed(clock, recipient="HTTP://127.0.0.1:8100/")
    assert verifier(clock).verify("POST", "/v1/peer/arrivals", headers, b"[]") == SENDER


def test_a_request_for_another_life_is_stale_and_this_life_verifies(clock: Clock) -> None:
    v = verifier(clock)
    with pytest.raises(SignatureRejected, match="incarnation old-life") as info:
        v.verify("POST", "/v1/peer/arrivals", signed(clock, incarnation="old-life"), b"[]")
    assert info.value.stale
    assert v.verify("POST", "/v1/peer/arrivals", signed(clock, incarnation=LIFE), b"[]")


def test_a_full_cache_does_not_refuse_a_peer_whose_clock_is_behind(clock: Clock) -> None:
    """Issue 18 B: once the cache is full, its floor must not refuse every message of a peer
    whose clock runs a few seconds behind the others' (only that sender's own evicted ones)."""
    v = verifier(clock, capacity=4)
    behind = Clock(clock.now - 5)
    for _ in range(20):  # a busy peer with a true clock fills the cache and evicts
        clock.now += 0.01
        behind.now += 0.01
        v.verify("POST", "/v1/peer/arrivals", signed(clock), b"[]")
        slow = signed(behind, sender="http://127.0.0.1:8202")
        assert v.verify("POST", "/v1/peer/arrivals", slow, b"[]") == "http://127.0.0.1:8202"
    with pytest.raises(SignatureRejected) as info:  # its own replays are still refused
        v.verify("POST", "/v1/peer/arrivals", slow, b"[]")
    assert info.value.replayed


def answer(nonce: str, status: int = 200, body: bytes = b"{}", url: str = HERE) -> dict[str, str]:
    return AnswerSigner("k1", url, LIFE).headers(nonce, status, body)


def test_an_answer_verifies_only_from_the_addressed_service_for_that_request() -> None:
    signer = Signer(("k2", "k1"), SENDER)
    assert signer.check_answer("n1", HERE + "/", 200, answer("n1"), b"{}") == LIFE
    refused = {
        "another request": ("n2", HERE, 200, answer("n1"), b"{}"),
        "another status": ("n1", HERE, 204, answer("n1"), b"{}"),
        "another body": ("n1", HERE, 200, answer("n1"), b'{"live":[]}'),
        "another service": ("n1", HERE, 200, answer("n1", url=ELSEWHERE), b"{}"),
        "another life": (
            "n1",
            HERE,
            200,
            {**answer("n1"), RESPONDER_INCARNATION_HEADER: "life-2"},
            b"{}",
        ),
        "renamed": (
            "n1",
            HERE,
            200,
            {**answer("n1", url=ELSEWHERE), RESPONDER_HEADER: HERE},
            b"{}",
        ),
        "unsigned": ("n1", HERE, 200, {}, b"{}"),
        "not hex": ("n1", HERE, 200, {**answer("n1"), ANSWER_SIGNATURE_HEADER: "v1=\u00e9"}, b"{}"),
    }
    for what, args in refused.items():
        with pytest.raises(AnswerRejected):
            signer.check_answer(*args)
            pytest.fail(what)
    with pytest.raises(AnswerRejected, match="does not verify"):
        Signer("router", SENDER).check_answer("n1", HERE, 200, answer("n1"), b"{}")
