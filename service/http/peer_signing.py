"""Signed peer requests and their signed answers: both ends prove they hold the peer secret,
say who they are, and name whom they address.

The peer client (`kvhandoff.service.http.peer_client`) signs every call with `Signer.headers`,
naming the recipient it addresses (its URL, and its incarnation once an authenticated answer told
it); the auth middleware (`kvhandoff.service.http.auth`) checks every peer route's request with
`Verifier.verify` before the handler runs, and signs the answer (`AnswerSigner`), which the client
checks with `check_answer` before it believes a word of it.

A request's MAC (HMAC-SHA256 under the peer secret, `canonical`) covers the lines
`kvhandoff-peer-v3`, METHOD, raw path and query, timestamp, nonce, sender URL, recipient URL,
recipient incarnation (empty when not known yet) and the body's SHA-256. So a message cannot be
moved to another route, re-addressed to another sender, **relayed to another service** (the
recipient refuses a request signed for another URL, or for another of its lives), altered, or
sent again: a timestamp outside `max_skew_s` or a nonce seen before is refused.

An answer's MAC (`canonical_answer`) covers `kvhandoff-peer-answer-v3`, the request's nonce, the
status, the responder's URL and incarnation and the body's SHA-256: it cannot be produced by a
party without the secret, moved to another request, or passed off as another service's. What
releases pages or binds a stage (a layout's incarnation, an abort ack, a heartbeat's live list)
is read only from such an answer.

The replay cache is bounded; when full, the oldest nonce goes and no message of *its sender* at
or before its timestamp is accepted any more, so an evicted nonce is never replayed, and a peer
whose clock runs behind the others' is not refused for their traffic.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence

from kvhandoff.pipelines.urls import canonical_url

SENDER_HEADER = "KVHandoff-Sender"
RECIPIENT_HEADER = "KVHandoff-Recipient"
RECIPIENT_INCARNATION_HEADER = "KVHandoff-Recipient-Incarnation"
TIMESTAMP_HEADER = "KVHandoff-Timestamp"
NONCE_HEADER = "KVHandoff-Nonce"
SIGNATURE_HEADER = "KVHandoff-Signature"
#: Headers every signed request carries (the recipient incarnation only once known).
SIGNED_HEADERS = (SENDER_HEADER, RECIPIENT_HEADER, TIMESTAMP_HEADER, NONCE_HEADER, SIGNATURE_HEADER)
RESPONDER_HEADER = "KVHandoff-Responder"
RESPONDER_INCARNATION_HEADER = "KVHandoff-Responder-Incarnation"
ANSWER_SIGNATURE_HEADER = "KVHandoff-Answer-Signature"
SCHEME = "v1"
_CONTEXT = b"kvhandoff-peer-v3"
_ANSWER_CONTEXT = b"kvhandoff-peer-answer-v3"
_CHANNEL_CONTEXT = b"kvhandoff-peer-channel-v1"
_MAX_NONCE_CHARS = 64
#: Senders whose replay floor is kept apart; beyond it the evicted sender's floor is shared.
_MAX_SENDER_FLOORS = 4096

Clock = Callable[[], float]


class SignatureRejected(Exception):
    """Why a signed request was refused: `replayed` (409, seen before), `stale` (409, signed for
    another life of this service), otherwise 401."""

    def __init__(self, message: str, *, replayed: bool = False, stale: bool = False) -> None:
        super().__init__(message)
        self.replayed = replayed
        self.stale = stale


class AnswerRejected(Exception):
    """An answer to a signed request that does not prove it came from the addressed service."""


def canonical(
    method: str,
    path_qs: str,
    timestamp: str,
    nonce: str,
    sender: str,
    recipient: str,
    recipient_incarnation: str,
    body: bytes,
) -> bytes:
    """The bytes both sides MAC for a request: every part on its own line, the body by its
    SHA-256."""
    return b"\n".join(
        (
            _CONTEXT,
            method.upper().encode(),
            path_qs.encode(),
            timestamp.encode(),
            nonce.encode(),
            sender.encode(),
            recipient.encode(),
            recipient_incarnation.encode(),
            hashlib.sha256(body).hexdigest().encode(),
        )
    )


def canonical_answer(
    nonce: str, status: int, responder: str, incarnation: str, body: bytes
) -> bytes:
    """The bytes both sides MAC for an answer to the request that carried `nonce`."""
    return b"\n".join(
        (
            _ANSWER_CONTEXT,
            nonce.encode(),
            str(status).encode(),
            responder.encode(),
            incarnation.encode(),
            hashlib.sha256(body).hexdigest().encode(),
        )
    )


def _mac(secret: str, message: bytes) -> str:
    return hmac.new(secret.encode(), message, hashlib.sha256).hexdigest()


def _matching(secrets_: Sequence[str], message: bytes, signature: str) -> str | None:
    """The secret of `secrets_` that `signature` was made with; None when none verifies."""
    scheme, _, given = signature.partition("=")
    if scheme != SCHEME or not given.isascii():  # compare_digest takes ASCII str only
        return None
    return next((s for s in secrets_ if hmac.compare_digest(_mac(s, message), given)), None)


def channel_key(
    secret: str, nonce: str, channel_nonce: str, sender: str, recipient: str, incarnation: str
) -> bytes:
    """The session key of a peer channel (`kvhandoff.service.http.peer_channel`): derived from the
    peer secret that signed its handshake, the handshake's nonce, the nonce the recipient chose for
    the session, both ends' URLs and the recipient's life. Nobody without the secret can
    compute it, and no two sessions share it."""
    context = b"\n".join(
        (
            _CHANNEL_CONTEXT,
            nonce.encode(),
            channel_nonce.encode(),
            canonical_url(sender).encode(),
            canonical_url(recipient).encode(),
            incarnation.encode(),
        )
    )
    return hmac.new(secret.encode(), context, hashlib.sha256).digest()


class Signer:
    """Signs this service's outgoing peer calls as `sender` with the current peer secret (the
    first of `secrets_`), and checks their answers against every accepted one."""

    def __init__(
        self, secrets_: str | Sequence[str], sender: str, *, clock: Clock = time.time
    ) -> None:
        self._secrets = (secrets_,) if isinstance(secrets_, str) else tuple(secrets_)
        self.sender = sender
        self._clock = clock

    def headers(
        self,
        method: str,
        path_qs: str,
        body: bytes,
        *,
        recipient: str,
        recipient_incarnation: str = "",
    ) -> dict[str, str]:
        """The headers of one call to `recipient` (a URL: signed in its canonical form)."""
        timestamp = f"{self._clock():.3f}"
        nonce = secrets.token_hex(16)
        to = canonical_url(recipient)
        message = canonical(
            method, path_qs, timestamp, nonce, self.sender, to, recipient_incarnation, body
        )
        out = {
            SENDER_HEADER: self.sender,
            RECIPIENT_HEADER: to,
            TIMESTAMP_HEADER: timestamp,
            NONCE_HEADER: nonce,
            SIGNATURE_HEADER: f"{SCHEME}={_mac(self._secrets[0], message)}",
        }
        if recipient_incarnation:
            out[RECIPIENT_INCARNATION_HEADER] = recipient_incarnation
        return out

    def check_answer(
        self,
        nonce: str,
        recipient: str,
        status: int,
        headers: Mapping[str, str],
        body: bytes,
    ) -> str:
        """The responder's incarnation, once the answer proves it came from `recipient` (the
        service this call addressed) for the request that carried `nonce`; AnswerRejected
        otherwise."""
        responder = headers.get(RESPONDER_HEADER)
        incarnation = headers.get(RESPONDER_INCARNATION_HEADER)
        signature = headers.get(ANSWER_SIGNATURE_HEADER)
        if responder is None or incarnation is None or signature is None:
            raise AnswerRejected(f"the answer (status {status}) is not signed")
        if canonical_url(responder) != canonical_url(recipient):
            raise AnswerRejected(f"the answer is signed by {responder}, not by {recipient}")
        message = canonical_answer(nonce, status, responder, incarnation, body)
        if _matching(self._secrets, message, signature) is None:
            raise AnswerRejected("the answer's signature does not verify with any peer secret")
        return incarnation

    def channel_key(
        self, nonce: str, channel_nonce: str, recipient: str, recipient_incarnation: str
    ) -> bytes:
        """The key of the channel whose handshake this signer signed with `nonce`."""
        return channel_key(
            self._secrets[0], nonce, channel_nonce, self.sender, recipient, recipient_incarnation
        )


class AnswerSigner:
    """Signs this service's answers to verified peer requests as `url`, life `incarnation`."""

    def __init__(self, secret: str, url: str, incarnation: str) -> None:
        self._secret = secret
        self.url = url
        self.incarnation = incarnation

    def headers(self, nonce: str, status: int, body: bytes) -> dict[str, str]:
        message = canonical_answer(nonce, status, self.url, self.incarnation, body)
        return {
            RESPONDER_HEADER: self.url,
            RESPONDER_INCARNATION_HEADER: self.incarnation,
            ANSWER_SIGNATURE_HEADER: f"{SCHEME}={_mac(self._secret, message)}",
        }


class Verifier:
    """Checks signed requests addressed to this service (`url`, life `incarnation`) against
    every accepted peer secret (current and previous)."""

    def __init__(
        self,
        secrets_: Sequence[str],
        *,
        url: str,
        incarnation: str,
        max_skew_s: float,
        capacity: int,
        clock: Clock = time.time,
    ) -> None:
        self._secrets = tuple(secrets_)
        self.url = canonical_url(url)
        self.incarnation = incarnation
        self.max_skew_s = max_skew_s
        self._capacity = capacity
        self._clock = clock
        self._seen: OrderedDict[str, tuple[str, float]] = OrderedDict()  # nonce -> sender, at
        # Per sender: its messages at or before this are refused (its evicted nonces).
        self._floors: OrderedDict[str, float] = OrderedDict()
        self._floor = float("-inf")  # the same for senders whose own floor was dropped

    def verify(
        self, method: str, path_qs: str, headers: Mapping[str, str | None], body: bytes
    ) -> str:
        """The verified sender URL; raises SignatureRejected. Records the nonce once valid."""
        return self.verify_secret(method, path_qs, headers, body)[0]

    def verify_secret(
        self, method: str, path_qs: str, headers: Mapping[str, str | None], body: bytes
    ) -> tuple[str, str]:
        """As `verify`, with the peer secret the request was signed with."""
        sender, recipient, stamp, nonce, signature = (headers.get(h) for h in SIGNED_HEADERS)
        if (
            sender is None
            or recipient is None
            or stamp is None
            or nonce is None
            or signature is None
        ):
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
        if scheme != SCHEME or not given.isascii():
            raise SignatureRejected(f"{SIGNATURE_HEADER} must be {SCHEME}=<hex HMAC-SHA256>")
        incarnation = headers.get(RECIPIENT_INCARNATION_HEADER) or ""
        message = canonical(method, path_qs, stamp, nonce, sender, recipient, incarnation, body)
        secret = _matching(self._secrets, message, signature)
        if secret is None:
            raise SignatureRejected("peer signature does not verify with any peer secret")
        if canonical_url(recipient) != self.url:
            # A request the sender meant for another service, relayed here: never acted on.
            raise SignatureRejected(
                f"the request was signed for {recipient}, not for this service ({self.url})"
            )
        self._remember(nonce, sender, timestamp)
        if incarnation and incarnation != self.incarnation:
            raise SignatureRejected(
                f"the request was signed for incarnation {incarnation} of this service, which "
                f"is incarnation {self.incarnation}",
                stale=True,
            )
        return sender, secret

    def _remember(self, nonce: str, sender: str, timestamp: float) -> None:
        floor = self._floors.get(sender, self._floor)
        if nonce in self._seen or timestamp <= floor:
            raise SignatureRejected(f"peer message {nonce} was already received", replayed=True)
        self._seen[nonce] = (sender, timestamp)
        horizon = self._clock() - self.max_skew_s
        while self._seen:
            oldest, (by, at) = next(iter(self._seen.items()))
            if at >= horizon and len(self._seen) <= self._capacity:
                break
            del self._seen[oldest]
            if at >= horizon:  # still replayable: refuse everything of its sender up to it
                self._raise_floor(by, at)

    def _raise_floor(self, sender: str, at: float) -> None:
        self._floors[sender] = max(self._floors.get(sender, self._floor), at)
        self._floors.move_to_end(sender)
        while len(self._floors) > _MAX_SENDER_FLOORS:
            _, dropped = self._floors.popitem(last=False)
            self._floor = max(self._floor, dropped)  # never lower a dropped sender's floor

    def __len__(self) -> int:
        return len(self._seen)
