"""Standard Webhooks signatures, checked against the `standardwebhooks` package both ways."""

from __future__ import annotations

import datetime
import time

import pytest
from standardwebhooks.webhooks import Webhook, WebhookVerificationError

from kvhandoff.service.client import SignatureError, verify_webhook
from kvhandoff.service.webhooks.signatures import new_secret, secret_key, sign

#: ASCII digits to Arabic-Indic ones: `int()` reads them as the same number.
ARABIC = str.maketrans("0123456789", "\u0660\u0661\u0662\u0663\u0664\u0665\u0666\u0667\u0668\u0669")
BODY = b'{"type":"handoff.completed","timestamp":"2026-01-01T00:00:00Z","data":{"x":1}}'


def headers(secret: str, msg_id: str = "msg_1", at: int | None = None) -> dict[str, str]:
    at = int(time.time()) if at is None else at
    return {
        "webhook-id": msg_id,
        "webhook-timestamp": str(at),
        "webhook-signature": sign(secret_key(secret), msg_id, at, BODY),
    }


def test_our_signature_verifies_with_standardwebhooks() -> None:
    secret = new_secret()
    assert Webhook(secret).verify(BODY, headers(secret))["data"] == {"x": 1}


def test_a_standardwebhooks_signature_verifies_with_ours() -> None:
    secret = new_secret()
    now = datetime.datetime.now(datetime.UTC)
    signature = Webhook(secret).sign("msg_9", now, BODY.decode())
    got = {
        "Webhook-Id": "msg_9",  # header names are case-insensitive
        "Webhook-Timestamp": str(int(now.timestamp())),
        "Webhook-Signature": f"v1,bm90IHRoaXMgb25l {signature}",  # a rotated secret's first
    }
    assert verify_webhook(got, BODY, secret)["type"] == "handoff.completed"


@pytest.mark.parametrize(
    ("change", "why"),
    [
        (lambda h, b: (h, b.replace(b"1", b"2")), "no v1 signature matches"),
        (lambda h, b: ({**h, "webhook-id": "msg_2"}, b), "no v1 signature matches"),
        (lambda h, b: ({k: v for k, v in h.items() if k != "webhook-id"}, b), "webhook-id"),
        (lambda h, b: ({**h, "webhook-timestamp": "x"}, b), "not an integer"),
    ],
)
def test_tampering_is_refused_by_both(change: object, why: str) -> None:
    secret = new_secret()
    h, body = change(headers(secret), BODY)  # type: ignore[operator]
    with pytest.raises(SignatureError, match=why):
        verify_webhook(h, body, secret)
    with pytest.raises(WebhookVerificationError):
        Webhook(secret).verify(body, h)


def test_a_stale_timestamp_and_a_wrong_secret_are_refused() -> None:
    secret = new_secret()
    old = headers(secret, at=int(time.time()) - 600)
    with pytest.raises(SignatureError, match="more than 300 s off"):
        verify_webhook(old, BODY, secret)
    with pytest.raises(SignatureError, match="no v1 signature"):
        verify_webhook(headers(secret), BODY, new_secret())
    with pytest.raises(SignatureError, match="whsec_"):
        verify_webhook(headers(secret), BODY, "not-a-secret")


def test_generated_secrets_are_whsec_base64_and_distinct() -> None:
    a, b = new_secret(), new_secret()
    assert a.startswith("whsec_") and a != b and len(secret_key(a)) == 24
    for bad in ("whsec_%%%", "whsec_YWJj", "sk_abc"):
        with pytest.raises(ValueError):
            secret_key(bad)


@pytest.mark.parametrize(
    ("change", "why"),
    [
        (lambda h, b: ({**h, "webhook-signature": "v1,\u00e9t\u00e9"}, b), "no v1 signature"),
        (lambda h, b: ({**h, "webhook-signature": "v1,\udcff"}, b), "no v1 signature"),
        (lambda h, b: ({**h, "webhook-id": "msg_\udcff"}, b), "webhook-id is not ASCII"),
        (lambda h, b: ({**h, "webhook-timestamp": "\u00b2"}, b), "not an integer"),
        (
            lambda h, b: ({**h, "webhook-timestamp": h["webhook-timestamp"].translate(ARABIC)}, b),
            "not an integer",
        ),
    ],
)
def test_non_ascii_headers_are_a_signature_error_not_a_crash(change: object, why: str) -> None:
    """Issue 18 B: `verify_webhook` raised TypeError on a non-ASCII signature (the README's
    receiver, which catches SignatureError, answered 500). The headers start as the reference
    library signs them; each change must be a SignatureError naming what is wrong."""
    secret = new_secret()
    now = datetime.datetime.now(datetime.UTC)
    good = {
        "webhook-id": "msg_1",
        "webhook-timestamp": str(int(now.timestamp())),
        "webhook-signature": Webhook(secret).sign("msg_1", now, BODY.decode()),
    }
    assert verify_webhook(good, BODY, secret)["data"] == {"x": 1}
    h, body = change(good, BODY)  # type: ignore[operator]
    with pytest.raises(SignatureError, match=why):
        verify_webhook(h, body, secret)
