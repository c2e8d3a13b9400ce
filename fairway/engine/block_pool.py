"""KV cache blocks: reference counts, prefix hashes, and an LRU of freed-but-still-cached blocks.

A block that nobody references goes to the free queue but keeps its hash and tokens, so a later
request with the same prefix can take it back; it loses them only when its memory is reused.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from itertools import islice

from fairway.block_hash import BLOCK_SIZE


@dataclass
class KVBlock:
    block_id: int
    ref_count: int = 0
    hash: int | None = None  # set only for a full block whose tokens are final
    tokens: tuple[int, ...] | None = None  # kept to verify a hash hit, not just trust it


class BlockPool:
    def __init__(self, num_blocks: int, block_size: int = BLOCK_SIZE) -> None:
        self.block_size = block_size
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        # Free blocks, least recently freed first; eviction takes from the front.
        self.free: OrderedDict[int, KVBlock] = OrderedDict((b.block_id, b) for b in self.blocks)
        self.cached: dict[int, KVBlock] = {}  # hash -> block, least recently used first
        self.version = 0  # bumped when the set of cached hashes or their order changes
        self.queries = 0  # prefix-cache lookups, in blocks
        self.hits = 0

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free(self) -> int:
        return len(self.free)

    def lookup(self, hashes: list[int], token_ids: list[int]) -> list[KVBlock]:
        """The longest run of cached blocks matching this prefix, verified token by token."""
        found: list[KVBlock] = []
        bs = self.block_size
        for i, h in enumerate(hashes):
            block = self.cached.get(h)
            if block is None or block.tokens != tuple(token_ids[i * bs:(i + 1) * bs]):
                break
            found.append(block)
        for block in found:  # most recently used now: to the end (recent_hashes reads from there)
            self.cached[block.hash] = self.cached.pop(block.hash)  # type: ignore[index]
        if found:
            self.version += 1
        self.queries += len(hashes)
        self.hits += len(found)
        return found

    def recent_hashes(self, limit: int) -> tuple[int, ...]:
        """The hashes of up to `limit` cached blocks, most recently used first: what the replica
        tells the routers it caches (fairway/replica/prefix_summary.py)."""
        return tuple(islice(reversed(self.cached), limit))

    def touch(self, blocks: list[KVBlock]) -> None:
        """Take a reference on cached blocks (removing them from the free queue if idle)."""
        for b in blocks:
            if b.ref_count == 0:
                del self.free[b.block_id]
            b.ref_count += 1

    def can_allocate(self, n: int) -> bool:
        return n <= len(self.free)

    def allocate(self, n: int) -> list[KVBlock]:
        if n > len(self.free):
            raise RuntimeError(f"asked for {n} KV blocks, {len(self.free)} free")
        out = []
        for _ in range(n):
            _, block = self.free.popitem(last=False)
            self._forget(block)
            block.ref_count = 1
            out.append(block)
        return out

    def release(self, blocks: list[KVBlock]) -> None:
        """Drop one reference each; blocks reaching zero join the free queue, hash kept."""
        # Free in reverse so a sequence's tail blocks are evicted before its shared head blocks.
        for b in reversed(blocks):
            b.ref_count -= 1
            if b.ref_count == 0:
                self.free[b.block_id] = b
            elif b.ref_count < 0:
                raise RuntimeError(f"block {b.block_id} released more often than taken")

    def cache_block(self, block: KVBlock, h: int, tokens: tuple[int, ...]) -> None:
        """Mark a now-full block as reusable by later requests with the same prefix."""
        if block.hash is not None:
            return
        if h in self.cached:  # an identical block already cached (computed concurrently): keep the first
            return
        block.hash, block.tokens = h, tokens
        self.cached[h] = block
        self.version += 1

    def _forget(self, block: KVBlock) -> None:
        if block.hash is not None and self.cached.get(block.hash) is block:
            del self.cached[block.hash]
            self.version += 1
        block.hash, block.tokens = None, None
