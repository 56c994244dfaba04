"""Standard Webhooks signatures: make a `whsec_` secret, sign a delivery, verify one.

Called by the webhook dispatcher (`kvhandoff.service.webhooks.dispatch`, to sign each attempt) and
by the router client (`kvhandoff.service.client.verify_webhook`, on the receiving side). The signed
content is `{webhook-id}.{webhook-timestamp}.{body}`; the signature header carries one or more
space-separated `v1,<base64 HMAC-SHA256>` values (several while a secret is being rotated).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import secrets
from collections.abc import Mapping

SECRET_PREFIX = "whsec_"
#: A receiver refuses a timestamp further than this from its clock (replay protection).
TOLERANCE_S = 5 * 60


class SignatureError(ValueError):
    """A webhook failed verification: missing header, stale timestamp or no matching signature."""


def new_secret() -> str:
    """A fresh `whsec_` secret of 24 random bytes (shown to its owner once)."""
    return SECRET_PREFIX + base64.b64encode(secrets.token_bytes(24)).decode()


def secret_key(secret: str) -> bytes:
    """The HMAC key of a `whsec_...` secret; raises ValueError if it is not one."""
    if not secret.startswith(SECRET_PREFIX):
        raise ValueError("a webhook secret starts with whsec_")
    try:
        key = base64.b64decode(secret[len(SECRET_PREFIX) :], validate=True)
    except binascii.Error:
        raise ValueError("a webhook secret is whsec_ followed by base64") from None
    if len(key) < 16:
        raise ValueError("a webhook secret holds at least 16 bytes")
    return key


def sign(key: bytes, msg_id: str, timestamp: int, body: bytes) -> str:
    """The `webhook-signature` header value for one attempt."""
    mac = hmac.new(key, f"{msg_id}.{timestamp}.".encode() + body, hashlib.sha256).digest()
    return "v1," + base64.b64encode(mac).decode()


def verify(headers: Mapping[str, str], body: bytes, secret: str, *, now: float) -> None:
    """Check a delivery's headers against `secret`; raises SignatureError naming what is wrong.

    `headers` is looked up case-insensitively (pass any mapping of the received headers).
    """
    lowered = {k.lower(): v for k, v in headers.items()}
    missing = [
        h for h in ("webhook-id", "webhook-timestamp", "webhook-signature") if h not in lowered
    ]
    if missing:
        raise SignatureError(f"missing header {missing[0]}")
    raw_stamp = lowered["webhook-timestamp"]
    # ASCII digits only: int() also takes "١٢" and "²" raises; either must be a refusal.
    if not (raw_stamp.isascii() and raw_stamp.isdigit()):
        raise SignatureError("webhook-timestamp is not an integer")
    timestamp = int(raw_stamp)
    if abs(now - timestamp) > TOLERANCE_S:
        raise SignatureError(f"webhook-timestamp {timestamp} is more than {TOLERANCE_S} s off")
    try:
        key = secret_key(secret)
    except ValueError as exc:
        raise SignatureError(str(exc)) from None
    msg_id = lowered["webhook-id"]
    if not msg_id.isascii():  # also undecodable bytes, which aiohttp keeps as surrogates
        raise SignatureError("webhook-id is not ASCII")
    expected = sign(key, msg_id, timestamp, body).split(",", 1)[1]
    for candidate in lowered["webhook-signature"].split():
        version, _, value = candidate.partition(",")
        # compare_digest raises TypeError on a non-ASCII str: such a candidate matches nothing.
        if version == "v1" and value.isascii() and hmac.compare_digest(value, expected):
            return
    raise SignatureError("no v1 signature matches")
