"""Digests of packed segments: what a prefill sends with a segment and the decode checks before it
commits a byte of it.

Both sides call `digest(buf, algorithm, seed=segment_seed(...))` on one contiguous byte buffer (a
numpy array on host memory or a torch tensor on any device). The decode names the algorithm in
the destination, by where its landing arena lives: `xxh3_128` for host memory, `mix64` for
device memory, computed with torch on the device so no byte of the segment is copied to the host.
A sender whose staging buffer lives elsewhere computes the same function there (a device tensor
asked for `xxh3_128` is copied to the host first: correct, slower).

Both are seeded per segment (`segment_seed`): the decode life, the handoff, the stage, the grant
and the segment's pieces are bound into what is checked, so bytes left in a window by an earlier
owner, named again by a notice for another grant, do not match. Neither is cryptographic: they
catch stale, misdirected and corrupted bytes, not an attacker who knows the seed's inputs (every
peer does; who may send a peer message is the HTTP layer's job, `pipelines/SAFETY.md`).

`mix64` is non-linear: each 64-bit word, mixed with the seed and its position, goes through a
multiply-xorshift finalizer (MurmurHash3's fmix64) before it is summed, twice over with different
seeds. A sum of words alone (the earlier `wsum64`) is linear: bit 63 flipped in two words (the
sign of a bf16/fp16 lane) adds 2**64 and passes.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

import numpy as np
import xxhash

Algorithm = Literal["xxh3_128", "mix64"]
ALGORITHMS: tuple[Algorithm, ...] = ("xxh3_128", "mix64")

# mix64 works on 64-bit words in chunks, so its temporaries stay small on any device.
_MIX_CHUNK_WORDS = 1 << 22
_M64 = (1 << 64) - 1
# fmix64's multipliers, the golden-ratio step between positions, a second lane's seed offset.
_C1 = 0xFF51AFD7ED558CCD
_C2 = 0xC4CEB9FE1A85EC53
_GOLDEN = 0x9E3779B97F4A7C15
_LANE_B = 0xD6E8FEB86659FD93


def digest(buf: Any, algorithm: Algorithm, *, seed: int) -> str:
    """The hex digest of the bytes of `buf` (a 1-D uint8 numpy array or torch tensor), under
    `seed` (an unsigned 64-bit integer, `segment_seed`)."""
    if algorithm == "xxh3_128":
        return xxhash.xxh3_128_hexdigest(_host_bytes(buf), seed=seed & _M64)
    if algorithm == "mix64":
        return _mix64(buf, seed & _M64)
    raise ValueError(f"unknown digest algorithm {algorithm!r}")


def segment_seed(
    decode_incarnation: str,
    handoff_id: str,
    pp_rank: int,
    grant_id: int,
    rows: Sequence[int] | Any,
    starts: Sequence[int] | Any,
    ends: Sequence[int] | Any,
) -> int:
    """The seed one segment is digested under, from what its notice names: the decode life, the
    handoff, the stage, the grant its window came with, and its pieces."""
    h = xxhash.xxh3_64()
    h.update(f"{decode_incarnation}\0{handoff_id}\0{pp_rank}\0{grant_id}\0".encode())
    for part in (rows, starts, ends):
        h.update(np.ascontiguousarray(np.asarray(part, dtype=np.int64)).tobytes())
        h.update(b"\0")
    return h.intdigest()


def _host_bytes(buf: Any) -> Any:
    if isinstance(buf, np.ndarray):
        return np.ascontiguousarray(buf).data
    return np.ascontiguousarray(buf.detach().contiguous().cpu().numpy()).data


def _signed(value: int) -> int:
    """An unsigned 64-bit constant as the int64 torch computes with (same bits)."""
    value &= _M64
    return value - (1 << 64) if value >= 1 << 63 else value


def _fmix(x: Any) -> Any:
    """MurmurHash3's 64-bit finalizer on an int64 tensor (wrapping arithmetic, logical shifts)."""
    mask = (1 << 31) - 1  # x >> 33 sign-extends on int64: keep the 31 bits a logical shift keeps
    x = x ^ ((x >> 33) & mask)
    x = x * _signed(_C1)
    x = x ^ ((x >> 33) & mask)
    x = x * _signed(_C2)
    return x ^ ((x >> 33) & mask)


def _mix64(buf: Any, seed: int) -> str:
    """Two sums, modulo 2**64, of every little-endian 64-bit word mixed with the seed and its
    position through fmix64 (lanes A and B differ by their seed); then the sums, the tail bytes
    and the length, hashed with the seed on the host (32 bytes and the tail)."""
    import torch

    t = buf if isinstance(buf, torch.Tensor) else torch.from_numpy(np.ascontiguousarray(buf))
    n = int(t.numel())
    whole = n // 8 * 8
    head = t[:whole]
    if whole == 0:  # a uint8 tensor of no elements views as int64 only with stride 1
        words = torch.zeros(0, dtype=torch.int64, device=t.device)
    else:
        if head.storage_offset() % 8:
            head = head.clone()  # a fresh copy starts 8-aligned: int64 views need it
        words = head.view(torch.int64)
    sums = []
    for lane_seed in (seed, seed ^ _LANE_B):
        total = torch.zeros((), dtype=torch.int64, device=t.device)
        for start in range(0, int(words.numel()), _MIX_CHUNK_WORDS):
            part = words[start : start + _MIX_CHUNK_WORDS]
            pos = torch.arange(start, start + part.numel(), dtype=torch.int64, device=t.device)
            # int64 arithmetic wraps modulo 2**64 on every torch backend.
            total += _fmix(part ^ (pos * _signed(_GOLDEN) + _signed(lane_seed))).sum()
        sums.append(int(total) & _M64)
    tail = bytes(t[whole:].cpu().numpy().tobytes())
    summary = b"".join(s.to_bytes(8, "little") for s in sums) + n.to_bytes(8, "little") + tail
    return xxhash.xxh3_128_hexdigest(summary, seed=seed)
