"""The signed excusal a decode rank sends the prefill ranks SGLang makes "dummy" for a request.

Under an MLA model every attention-TP rank holds the same latent KV. When the prefill's
attention TP is k times the decode's, SGLang pairs each decode rank with the first of its k
prefill ranks (`target_tp_ranks[0]`) and marks the other k - 1 "dummy" for the request: they
move nothing, but SGLang's prefill reduces every rank's poll (MIN over attention TP), so each
must still reach Success. Only the decode knows, per request, which ranks those are (the
prefill never learns the decode's TP size), so its rank tells each of them, over SGLang's own
ZMQ channel to the rank (`rank_ip` / `rank_port` of its bootstrap row), once it has paired.

An excusal makes a prefill rank skip the request's transfer, so it is taken only when signed:
HMAC-SHA256 with the current peer secret (`bootstrap.sign` / `check`, which takes any
configured one, so a rotation does not stop excusals; fresh within `MAX_SKEW_S`) over the room
and the kvhandoff service URL of the rank it is for, which names one rank in one life. A
message signed for another rank, another life, without a secret or stale is refused and
changes nothing. (A replay within the skew window can only excuse the same rank for the same
room again.)

Called by: `receiver.py` (the decode receiver's `init` sends) and `manager.py` (a prefill
manager's listener thread reads its `server_socket` and hands each excusal to
`PrefillRank.excuse`, which keeps one that comes before its room in `Excusals`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence

import zmq

from kvhandoff.service.integrations.sglang.bootstrap import check, sign

log = logging.getLogger("kvhandoff.sglang.excusal")

TAG = b"KVHANDOFF_EXCUSED"
#: What the signature's method and path are, so an excusal's MAC can never pass as a
#: bootstrap registration's (their paths differ) or the other way round.
METHOD, PATH = "ZMQ", "/excused"
POLL_MS = 200  # how often the listener looks at its stop flag


def _body(room: int, url: str) -> bytes:
    return f"{int(room)}\n{url}".encode()


def excusal(secret: bytes, room: int, url: str) -> list[bytes]:
    """The ZMQ frames excusing the prefill rank whose kvhandoff service is at `url`."""
    signature = sign(secret, METHOD, PATH, _body(room, url))
    return [TAG, str(int(room)).encode("ascii"), url.encode(), signature.encode("ascii")]


def read(secrets: Sequence[bytes], frames: list[bytes], url: str) -> tuple[int | None, str | None]:
    """(room, None) for an excusal signed with one of `secrets` for this rank (`url`), else
    (None, why not)."""
    if len(frames) != 4 or frames[0] != TAG:
        return None, f"not an excusal ({len(frames)} frames)"
    try:
        room, for_url, signature = int(frames[1]), frames[2].decode(), frames[3].decode("ascii")
    except (ValueError, UnicodeDecodeError):
        return None, "a malformed excusal"
    why = check(secrets, METHOD, PATH, _body(room, for_url), signature)
    if why is not None:
        return None, f"room {room}: {why}"
    if for_url != url:
        return None, f"room {room}: signed for the rank at {for_url!r}, not this one ({url})"
    return room, None


class Listener:
    """Reads excusals from a prefill manager's ZMQ PULL socket on a thread of its own and
    hands each verified one to `excuse(room)`; anything else is logged and dropped. Nothing
    but `stop` ends it: a rank whose listener died would fail every excused request."""

    def __init__(
        self,
        socket: zmq.Socket[bytes],
        secrets: Sequence[bytes],
        url: str,
        excuse: Callable[[int], None],
    ) -> None:
        self._socket, self._secrets, self._url, self._excuse = socket, secrets, url, excuse
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvhandoff-excusals", daemon=True)

    def start(self) -> Listener:
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self._once()
            except Exception:  # logged; the next message is read all the same
                if self._stop.is_set():
                    return
                log.exception("reading excusals")
                self._stop.wait(POLL_MS / 1000)  # a socket that keeps failing: no busy loop

    def _once(self) -> None:
        if not self._socket.poll(POLL_MS):
            return
        frames = self._socket.recv_multipart()
        room, why = read(self._secrets, frames, self._url)
        if room is not None:
            self._excuse(room)
        elif frames[:1] == [TAG]:
            log.warning("refused an excusal: %s", why)
        else:  # nothing of SGLang's is sent here under the policies kvhandoff runs with
            log.debug("dropped a message that is no excusal: %s", why)

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5 * POLL_MS / 1000)


class Excusals:
    """The rooms a prefill rank is excused from. Not thread-safe: the manager holds its lock.

    An excusal for a room whose sender is open binds to it until it clears (`close`). One that
    comes first (the decode pairs before the request reaches this rank) waits `ttl_s`, at most
    `cap` of them, oldest out first; a sender that opens its room within that time takes it
    (`open`), one that comes later does not (an earlier request of that room number)."""

    def __init__(self, ttl_s: float, cap: int, clock: Callable[[], float] = time.monotonic) -> None:
        self._ttl_s, self._cap, self._clock = ttl_s, cap, clock
        self._bound: set[int] = set()
        self._early: OrderedDict[int, float] = OrderedDict()  # room -> when it came

    def __contains__(self, room: int) -> bool:
        """Whether the open room `room` is excused."""
        return room in self._bound

    def excuse(self, room: int, *, opened: bool) -> bool:
        """Record an excusal for `room` (`opened`: its sender is open); False for a repeat."""
        now = self._clock()
        at = self._early.get(room)
        if room in self._bound or (at is not None and at >= now - self._ttl_s):
            return False
        self._early.pop(room, None)
        if opened:
            self._bound.add(room)
            return True
        self._early[room] = now
        while len(self._early) > self._cap or next(iter(self._early.values())) < now - self._ttl_s:
            self._early.popitem(last=False)  # never the one just added: it is the newest
        return True

    def open(self, room: int) -> bool:
        """A sender opened `room`: True when an excusal for it came first (it binds to it)."""
        at = self._early.pop(room, None)
        if at is None or at < self._clock() - self._ttl_s:
            return False
        self._bound.add(room)
        return True

    def close(self, room: int) -> None:
        self._bound.discard(room)
        self._early.pop(room, None)

    def __len__(self) -> int:
        return len(self._bound) + len(self._early)
