"""Signed peer requests: the sender proves it holds the peer secret, and says who it is.

The peer client (`service.http.client`) signs every call it makes with `Signer.headers`; the
auth middleware (`service.http.auth`) checks every peer route's request with `Verifier.verify`
before the handler runs. The signature is HMAC-SHA256, keyed with the peer secret, over the
lines `kvhandoff-peer-v1`, METHOD, raw path and query, timestamp, nonce, sender URL and the
body's SHA-256 (`canonical`), so a message cannot be moved to another route, re-addressed to
another sender, altered, or sent again: a timestamp outside `max_skew_s` or a nonce seen
before is refused. The replay cache is bounded; when full, the oldest nonce goes and no
message at or before its timestamp is accepted any more, so an evicted nonce is never replayed.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence

SENDER_HEADER = "KVHandoff-Sender"
TIMESTAMP_HEADER = "KVHandoff-Timestamp"
NONCE_HEADER = "KVHandoff-Nonce"
SIGNATURE_HEADER = "KVHandoff-Signature"
SIGNED_HEADERS = (SENDER_HEADER, TIMESTAMP_HEADER, NONCE_HEADER, SIGNATURE_HEADER)
SCHEME = "v1"
_CONTEXT = b"kvhandoff-peer-v1"
_MAX_NONCE_CHARS = 64

Clock = Callable[[], float]


class SignatureRejected(Exception):
    """Why a signed request was refused; `replayed` separates 409 (seen before) from 401."""

    def __init__(self, message: str, *, replayed: bool = False) -> None:
        super().__init__(message)
        self.replayed = replayed


def canonical(
    method: str, path_qs: str, timestamp: str, nonce: str, sender: str, body: bytes
) -> bytes:
    """The bytes both sides MAC: every part on its own line, the body by its SHA-256."""
    return b"\n".join(
        (
            _CONTEXT,
            method.upper().encode(),
            path_qs.encode(),
            timestamp.encode(),
            nonce.encode(),
            sender.encode(),
            hashlib.sha256(body).hexdigest().encode(),
        )
    )


def _mac(secret: str, message: bytes) -> str:
    return hmac.new(secret.encode(), message, hashlib.sha256).hexdigest()


class Signer:
    """Signs this service's outgoing peer calls with the current peer secret as `sender`."""

    def __init__(self, secret: str, sender: str, *, clock: Clock = time.time) -> None:
        self._secret = secret
        self.sender = sender
        self._clock = clock

    def headers(self, method: str, path_qs: str, body: bytes) -> dict[str, str]:
        timestamp = f"{self._clock():.3f}"
        nonce = secrets.token_hex(16)
        message = canonical(method, path_qs, timestamp, nonce, self.sender, body)
        return {
            SENDER_HEADER: self.sender,
            TIMESTAMP_HEADER: timestamp,
            NONCE_HEADER: nonce,
            SIGNATURE_HEADER: f"{SCHEME}={_mac(self._secret, message)}",
        }


class Verifier:
    """Checks signed requests against every accepted peer secret (current and previous)."""

    def __init__(
        self,
        secrets_: Sequence[str],
        *,
        max_skew_s: float,
        capacity: int,
        clock: Clock = time.time,
    ) -> None:
        self._secrets = tuple(secrets_)
        self.max_skew_s = max_skew_s
        self._capacity = capacity
        self._clock = clock
        self._seen: OrderedDict[str, float] = OrderedDict()  # nonce -> its timestamp
        self._floor = float("-inf")  # messages at or before this are refused (evicted nonces)

    def verify(self, method: str, path_qs: str, headers: dict[str, str | None], body: bytes) -> str:
        """The verified sender URL; raises SignatureRejected. Records the nonce once valid."""
        sender, stamp, nonce, signature = (headers.get(h) for h in SIGNED_HEADERS)
        if sender is None or stamp is None or nonce is None or signature is None:
            missing = [h for h in SIGNED_HEADERS if headers.get(h) is None]
            raise SignatureRejected(f"unsigned peer request: missing {', '.join(missing)}")
        if not nonce or len(nonce) > _MAX_NONCE_CHARS:
            raise SignatureRejected(f"{NONCE_HEADER} must be 1..{_MAX_NONCE_CHARS} characters")
        try:
            timestamp = float(stamp)
        except ValueError:
            raise SignatureRejected(f"{TIMESTAMP_HEADER} {stamp!r} is not a number") from None
        now = self._clock()
        if not abs(now - timestamp) <= self.max_skew_s:  # also refuses nan
            raise SignatureRejected(
                f"{TIMESTAMP_HEADER} is {now - timestamp:.1f} s from this service's clock "
                f"(at most {self.max_skew_s:g} s)"
            )
        scheme, _, given = signature.partition("=")
        if scheme != SCHEME or not given.isascii():  # compare_digest takes ASCII str only
            raise SignatureRejected(f"{SIGNATURE_HEADER} must be {SCHEME}=<hex HMAC-SHA256>")
        message = canonical(method, path_qs, stamp, nonce, sender, body)
        if not any(hmac.compare_digest(_mac(s, message), given) for s in self._secrets):
            raise SignatureRejected("peer signature does not verify with any peer secret")
        self._remember(nonce, timestamp)
        return sender

    def _remember(self, nonce: str, timestamp: float) -> None:
        if nonce in self._seen or timestamp <= self._floor:
            raise SignatureRejected(f"peer message {nonce} was already received", replayed=True)
        self._seen[nonce] = timestamp
        horizon = self._clock() - self.max_skew_s
        while self._seen:
            oldest, at = next(iter(self._seen.items()))
            if at >= horizon and len(self._seen) <= self._capacity:
                break
            del self._seen[oldest]
            if at >= horizon:  # still replayable: refuse everything up to it from now on
                self._floor = max(self._floor, at)

    def __len__(self) -> int:
        return len(self._seen)
