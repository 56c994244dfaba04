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
    if algorithm == "xxh3_128":  # one call: cheaper than a streaming state for small segments
        return xxhash.xxh3_128_hexdigest(_host_bytes(buf), seed=seed & _M64)
    d = Digester(algorithm, seed=seed)
    d.update(buf)
    return d.hexdigest()


class Digester:
    """One segment's digest over its bytes fed in order, in parts of any sizes (`update`):
    `hexdigest()` equals `digest` of all of them at once, so a sender and a receiver may cut the
    same segment into different chunks. What the one-pass gather and commit digest chunk by
    chunk, each chunk while it is in cache (`pipelines/chunked.py`)."""

    def __init__(self, algorithm: Algorithm, *, seed: int) -> None:
        if algorithm not in ALGORITHMS:
            raise ValueError(f"unknown digest algorithm {algorithm!r}")
        self.algorithm: Algorithm = algorithm
        self._seed = seed & _M64
        self._xxh = xxhash.xxh3_128(seed=self._seed) if algorithm == "xxh3_128" else None
        self._mix: _Mix64 | None = None if self._xxh is not None else _Mix64(self._seed)

    def update(self, buf: Any) -> None:
        """Feed the next bytes of the segment (a 1-D uint8 numpy array or torch tensor)."""
        if self._xxh is not None:
            self._xxh.update(_host_bytes(buf))
        else:
            assert self._mix is not None
            self._mix.update(buf)

    def hexdigest(self) -> str:
        if self._xxh is not None:
            return self._xxh.hexdigest()
        assert self._mix is not None
        return self._mix.hexdigest()


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


class _Mix64:
    """mix64 streamed: two sums, modulo 2**64, of every little-endian 64-bit word mixed with the
    seed and its position through fmix64 (lanes A and B differ by their seed); at the end the
    sums, the tail bytes and the length, hashed with the seed on the host (32 bytes and the
    tail). The sums stay on the device until the end; a word cut between two parts (a part whose
    length is not a multiple of 8) is mixed on the host."""

    def __init__(self, seed: int) -> None:
        self._seed = seed
        self._lanes = (seed, seed ^ _LANE_B)
        self._device_sums: list[Any] | None = None  # per lane, a 0-d int64 tensor
        self._host_sums = [0, 0]  # words mixed on the host (cut between parts)
        self._words = 0  # words mixed so far: the next word's position
        self._carry = b""  # bytes after the last whole word (fewer than 8)
        self._length = 0

    def update(self, buf: Any) -> None:
        import torch

        t = buf if isinstance(buf, torch.Tensor) else torch.from_numpy(np.ascontiguousarray(buf))
        self._length += int(t.numel())
        if self._carry:
            need = 8 - len(self._carry)
            self._carry += bytes(t[:need].cpu().numpy().tobytes())
            t = t[need:]
            if len(self._carry) < 8:
                return
            self._mix_host(int.from_bytes(self._carry, "little"))
            self._carry = b""
        whole = int(t.numel()) // 8 * 8
        if whole:
            head = t[:whole]
            if head.storage_offset() % 8:
                head = head.clone()  # a fresh copy starts 8-aligned: int64 views need it
            self._mix_device(head.view(torch.int64))
        self._carry = bytes(t[whole:].cpu().numpy().tobytes())

    def _mix_host(self, word: int) -> None:
        for lane, lane_seed in enumerate(self._lanes):
            x = word ^ ((self._words * _GOLDEN + lane_seed) & _M64)
            x ^= x >> 33
            x = (x * _C1) & _M64
            x ^= x >> 33
            x = (x * _C2) & _M64
            x ^= x >> 33
            self._host_sums[lane] = (self._host_sums[lane] + x) & _M64
        self._words += 1

    def _mix_device(self, words: Any) -> None:
        import torch

        if self._device_sums is None:
            self._device_sums = [
                torch.zeros((), dtype=torch.int64, device=words.device) for _ in self._lanes
            ]
        for total, lane_seed in zip(self._device_sums, self._lanes):
            for start in range(0, int(words.numel()), _MIX_CHUNK_WORDS):
                part = words[start : start + _MIX_CHUNK_WORDS]
                first = self._words + start
                pos = torch.arange(
                    first, first + part.numel(), dtype=torch.int64, device=words.device
                )
                # int64 arithmetic wraps modulo 2**64 on every torch backend.
                total += _fmix(part ^ (pos * _signed(_GOLDEN) + _signed(lane_seed))).sum()
        self._words += int(words.numel())

    def hexdigest(self) -> str:
        sums = list(self._host_sums)
        if self._device_sums is not None:
            sums = [(s + int(d)) & _M64 for s, d in zip(sums, self._device_sums)]
        summary = (
            b"".join(s.to_bytes(8, "little") for s in sums)
            + self._length.to_bytes(8, "little")
            + self._carry
        )
        return xxhash.xxh3_128_hexdigest(summary, seed=self._seed)
