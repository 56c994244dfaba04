"""Digests of packed segments: what a prefill sends with a segment and the decode checks before it
commits a byte of it.

Both sides call `digest(buf, algorithm)` on one contiguous byte buffer (a numpy array on host
memory or a torch tensor on any device). The decode names the algorithm in the destination, by
where its landing arena lives: `xxh3_128` for host memory (fast, non-cryptographic: peers are
authenticated, this catches stale and misdirected bytes), `wsum64` for device memory, computed
with torch on the device so no byte is copied to the host. A sender whose staging buffer lives
elsewhere computes the same function there (a device tensor asked for `xxh3_128` is copied to
the host first: correct, slower).
"""

from __future__ import annotations

from typing import Any, Literal

import numpy as np
import xxhash

Algorithm = Literal["xxh3_128", "wsum64"]
ALGORITHMS: tuple[Algorithm, ...] = ("xxh3_128", "wsum64")

# wsum64 works on 64-bit words in chunks, so its temporaries stay small on any device.
_WSUM_CHUNK_WORDS = 1 << 22


def digest(buf: Any, algorithm: Algorithm) -> str:
    """The hex digest of the bytes of `buf` (a 1-D uint8 numpy array or torch tensor)."""
    if algorithm == "xxh3_128":
        return xxhash.xxh3_128_hexdigest(_host_bytes(buf))
    if algorithm == "wsum64":
        return _wsum64(buf)
    raise ValueError(f"unknown digest algorithm {algorithm!r}")


def _host_bytes(buf: Any) -> Any:
    if isinstance(buf, np.ndarray):
        return np.ascontiguousarray(buf).data
    return np.ascontiguousarray(buf.detach().contiguous().cpu().numpy()).data


def _wsum64(buf: Any) -> str:
    """Two sums over the buffer's little-endian 64-bit words: plain, and each word times an odd
    weight that grows with its position (so a moved or swapped word changes it), both modulo
    2**64, plus the tail bytes and the length. Computed by torch where the buffer lives."""
    import torch

    t = buf if isinstance(buf, torch.Tensor) else torch.from_numpy(np.ascontiguousarray(buf))
    n = int(t.numel())
    whole = n // 8 * 8
    words = t[:whole].view(torch.int64)
    plain = torch.zeros((), dtype=torch.int64, device=t.device)
    weighted = torch.zeros((), dtype=torch.int64, device=t.device)
    for start in range(0, int(words.numel()), _WSUM_CHUNK_WORDS):
        part = words[start : start + _WSUM_CHUNK_WORDS]
        weights = torch.arange(
            2 * start + 1, 2 * (start + part.numel()) + 1, 2, dtype=torch.int64, device=t.device
        )
        # int64 arithmetic wraps modulo 2**64 on every torch backend: the sums are exact mod 2**64
        plain += part.sum()
        weighted += (part * weights).sum()
    tail = bytes(t[whole:].cpu().numpy().tobytes())
    return f"{int(plain) & (2**64 - 1):016x}{int(weighted) & (2**64 - 1):016x}-{n}-{tail.hex()}"
