"""What a replica tells the routers about its prefix cache: a Bloom filter of the chained block
hashes (fairway/block_hash.py) of the blocks it most recently used.

A Bloom filter rather than the hashes themselves: ~1.2 bytes a block instead of 8, so a summary of
a few thousand blocks fits a heartbeat every gateway reads twice a second. Its false positives
(1% by default) cost little: the router counts a prompt's LEADING blocks that hit, so a false hit
only extends a real run by a block now and then, and the engine verifies every block anyway.

The filter is sized by its capacity, not by how many hashes it holds, so every announcement of a
replica has the same size. Its k bit positions come from the hash itself (two 32-bit halves,
double hashing): the block hashes are already uniform 64-bit values, so no second hash is needed.
"""

from __future__ import annotations

import base64
import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

DEFAULT_CAPACITY = 4096  # blocks a summary describes (the most recently used)
DEFAULT_FP_RATE = 0.01


def _positions(hashes: Sequence[int], k: int, m: int) -> np.ndarray:
    """(len(hashes), k) bit positions: h1 + i * h2 mod m, h1 and h2 the hash's two halves."""
    h = np.asarray(hashes, dtype=np.uint64)
    h1 = h & np.uint64(0xFFFFFFFF)
    h2 = (h >> np.uint64(32)) | np.uint64(1)  # odd: the k positions never collapse onto one
    steps = np.arange(k, dtype=np.uint64)
    return (h1[:, None] + steps[None, :] * h2[:, None]) % np.uint64(m)  # < 2^35: no overflow


@dataclass(frozen=True)
class PrefixSummary:
    bits: bytes  # m bits, little-endian within each byte
    k: int  # bit positions per hash
    count: int = 0  # hashes it holds
    _bytes: np.ndarray = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_bytes", np.frombuffer(self.bits, dtype=np.uint8))

    def _set(self, positions: np.ndarray) -> np.ndarray:
        """Whether each of these bit positions is set (read in place: a lookup touches k bytes
        a hash, where unpacking the whole filter first costs a byte per bit)."""
        return (self._bytes[positions >> np.uint64(3)] >> (positions & np.uint64(7)).astype(np.uint8)) & 1 == 1

    @property
    def m(self) -> int:
        return len(self.bits) * 8

    @classmethod
    def of(cls, hashes: Sequence[int], capacity: int = DEFAULT_CAPACITY,
           fp_rate: float = DEFAULT_FP_RATE) -> PrefixSummary:
        """The summary of these block hashes (at most `capacity` are kept: the first ones)."""
        capacity = max(1, capacity)
        m_bits = math.ceil(-capacity * math.log(fp_rate) / math.log(2) ** 2)
        m = -(-m_bits // 64) * 64  # whole 64-bit words
        k = max(1, round(m / capacity * math.log(2)))
        hashes = hashes[:capacity]
        bits = np.zeros(m, dtype=bool)
        if len(hashes):
            bits[_positions(hashes, k, m).ravel()] = True
        return cls(np.packbits(bits, bitorder="little").tobytes(), k, len(hashes))

    def __contains__(self, block_hash: int) -> bool:
        return bool(self._set(_positions([block_hash], self.k, self.m)).all())

    def leading_hits(self, hashes: Sequence[int]) -> int:
        """How many of these chained hashes, from the first, the summary holds: the prompt's
        leading blocks this replica has cached (the engine's lookup stops at the first miss too)."""
        if not len(hashes) or self.count == 0:
            return 0
        hit = self._set(_positions(hashes, self.k, self.m)).all(axis=1)
        return len(hashes) if hit.all() else int(np.argmin(hit))

    def to_wire(self) -> dict[str, Any]:
        return {"k": self.k, "n": self.count, "bits": base64.b64encode(self.bits).decode()}

    @classmethod
    def from_wire(cls, data: Any) -> PrefixSummary | None:
        """None for anything that is not a summary (an older or newer replica's field)."""
        try:
            return _from_wire(data["bits"], int(data["k"]), int(data.get("n", 1)))
        except (KeyError, TypeError, ValueError):
            return None


@functools.lru_cache(maxsize=256)
def _from_wire(encoded: str, k: int, count: int) -> PrefixSummary | None:
    """Decoded once per distinct announcement: every gateway reads each replica's twice a second,
    and its filter is the same until the replica's cache changes."""
    bits = base64.b64decode(encoded, validate=True)
    return PrefixSummary(bits, k, count) if bits and k >= 1 else None
