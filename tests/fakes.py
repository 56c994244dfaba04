"""Test doubles shared by the unit tests. Integration tests never use these: they run the real
Transfer Engine in real processes."""

from __future__ import annotations

import ctypes
import threading


class FakeEngine:
    """Stands in for `mooncake.engine.TransferEngine` in unit tests of `MooncakeTransport`.

    Writes are memmoves within this process. Knobs: `rc` makes every write return that code,
    `hang` (an Event) blocks writes until it is set, `max_blocks` fails (rc -1) any call with more
    blocks, like the real TCP transport's per-peer queue. Records every call's size and the
    highest number of concurrent calls.
    """

    def __init__(self, *, max_blocks: int = 2048) -> None:
        self.rc = 0
        self.hang: threading.Event | None = None
        self.max_blocks = max_blocks
        self.batch_sizes: list[int] = []
        self.bytes_per_call: list[int] = []
        self.targets: list[str] = []
        self.registered: dict[int, int] = {}
        self.active = 0
        self.max_active = 0
        self._lock = threading.Lock()

    def get_rpc_port(self) -> int:
        return 12345

    def batch_register_memory(self, addrs: list[int], lengths: list[int]) -> int:
        if any(a in self.registered for a in addrs):
            return -7
        self.registered.update(zip(addrs, lengths, strict=True))
        return 0

    def batch_unregister_memory(self, addrs: list[int]) -> int:
        if any(a not in self.registered for a in addrs):
            return -3
        for a in addrs:
            del self.registered[a]
        return 0

    def batch_transfer_sync_write(
        self, target: str, src: list[int], dst: list[int], lengths: list[int]
    ) -> int:
        with self._lock:
            self.active += 1
            self.max_active = max(self.max_active, self.active)
            self.batch_sizes.append(len(src))
            self.bytes_per_call.append(sum(lengths))
            self.targets.append(target)
        try:
            if self.hang is not None:
                self.hang.wait()
            if len(src) > self.max_blocks:
                return -1
            if self.rc != 0:
                return self.rc
            for s, d, n in zip(src, dst, lengths, strict=True):
                ctypes.memmove(d, s, n)
            return 0
        finally:
            with self._lock:
                self.active -= 1
