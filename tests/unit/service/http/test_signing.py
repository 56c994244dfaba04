"""Peer request signatures: what verifies, what is refused, and replays (service.http.signing)."""

from __future__ import annotations

import pytest

from service.http.signing import (
    NONCE_HEADER,
    SENDER_HEADER,
    SIGNATURE_HEADER,
    TIMESTAMP_HEADER,
    SignatureRejected,
    Signer,
    Verifier,
)

SENDER = "http://127.0.0.1:8201"


class Clock:
    def __init__(self, now: float = 1_000_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> Clock:
    return Clock()


def verifier(clock: Clock, secrets: tuple[str, ...] = ("k1",), capacity: int = 100) -> Verifier:
    return Verifier(secrets, max_skew_s=30, capacity=capacity, clock=clock)


def signed(clock: Clock, secret: str = "k1", body: bytes = b"[]") -> dict[str, str | None]:
    return dict(Signer(secret, SENDER, clock=clock).headers("POST", "/v1/peer/arrivals", body))


def test_a_signed_request_verifies_and_names_its_sender(clock: Clock) -> None:
    assert verifier(clock).verify("POST", "/v1/peer/arrivals", signed(clock), b"[]") == SENDER


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        (lambda h: {**h, SENDER_HEADER: "http://127.0.0.1:9999"}, "does not verify"),
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
