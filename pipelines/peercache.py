"""Bounded per-peer state, and the incarnation id a service draws at start.

Anything a pipeline keys by peer URL (cached layouts, lost-peer marks) lives in a `PeerCache`: at
most `maxsize` peers, least recently used first out, so a deployment that churns through many
peers does not grow without bound. Used by the decode and prefill pipelines.
"""

from __future__ import annotations

import secrets
from collections import OrderedDict
from typing import Generic, TypeVar

V = TypeVar("V")

#: Peers remembered per cache: far above one deployment's prefill/decode count.
MAX_PEERS = 1024


def new_incarnation() -> str:
    """A random id for one life of a service: peers refuse messages of another life."""
    return secrets.token_hex(8)


class PeerCache(Generic[V]):
    """A dict of at most `maxsize` peers, evicting the least recently written or read."""

    def __init__(self, maxsize: int = MAX_PEERS) -> None:
        self._items: OrderedDict[str, V] = OrderedDict()
        self.maxsize = maxsize

    def get(self, peer: str) -> V | None:
        value = self._items.get(peer)
        if value is not None:
            self._items.move_to_end(peer)
        return value

    def put(self, peer: str, value: V) -> None:
        self._items[peer] = value
        self._items.move_to_end(peer)
        while len(self._items) > self.maxsize:
            self._items.popitem(last=False)

    def pop(self, peer: str) -> V | None:
        return self._items.pop(peer, None)

    def snapshot(self) -> dict[str, V]:
        """A copy of every entry, least recently used first (reading it touches none)."""
        return dict(self._items)

    def __contains__(self, peer: object) -> bool:
        return peer in self._items

    def __len__(self) -> int:
        return len(self._items)
