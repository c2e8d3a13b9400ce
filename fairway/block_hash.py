"""The hash of each full KV block of a prompt, chained with its prefix.

The engine's prefix cache keys its blocks by it, and the router matches a prompt's hashes with
what each replica caches (prefix affinity) without loading torch: so it lives here, below both. Stable across processes and machines: blake2b over the tokens as 64-bit little-endian.
"""

from __future__ import annotations

import hashlib

import numpy as np

BLOCK_SIZE = 16  # tokens per KV block


def block_hash(parent: int | None, tokens: tuple[int, ...]) -> int:
    """Hash of a full block, chained with its prefix; stable across processes (the router uses it)."""
    h = hashlib.blake2b(digest_size=8)
    h.update((parent or 0).to_bytes(8, "little"))
    h.update(np.asarray(tokens, dtype=np.int64).tobytes())
    return int.from_bytes(h.digest(), "little")


def prefix_block_hashes(token_ids: list[int], block_size: int = BLOCK_SIZE) -> list[int]:
    """block_hash of each full block, chained: the same values, with the tokens converted once
    rather than once a block (a router hashes every prompt it places)."""
    raw = np.asarray(token_ids, dtype=np.int64).tobytes()
    width = block_size * 8
    hashes: list[int] = []
    parent = 0
    for start in range(0, (len(token_ids) // block_size) * width, width):
        h = hashlib.blake2b(parent.to_bytes(8, "little"), digest_size=8)
        h.update(raw[start:start + width])
        parent = int.from_bytes(h.digest(), "little")
        hashes.append(parent)
    return hashes
