"""Which KV blocks each sequence holds: admission with prefix reuse, growth, caching full blocks, freeing."""

from __future__ import annotations

from fairway.block_hash import BLOCK_SIZE, block_hash, prefix_block_hashes
from fairway.engine.block_pool import BlockPool
from fairway.engine.sequence import Sequence


def blocks_for(num_tokens: int, block_size: int = BLOCK_SIZE) -> int:
    return -(-num_tokens // block_size)


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int = BLOCK_SIZE, reserve_blocks: int | None = None,
                 enable_prefix_caching: bool = True) -> None:
        self.pool = BlockPool(num_blocks, block_size)
        self.block_size = block_size
        # Kept free at admission so running sequences can still grow by a block without preempting.
        self.reserve = max(1, num_blocks // 100) if reserve_blocks is None else reserve_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self.query_tokens = 0  # prompt tokens looked up in the prefix cache, at admission
        self.hit_tokens = 0

    def max_admissible_tokens(self) -> int:
        """The longest sequence that could ever be admitted, with every other block free."""
        return (self.pool.num_blocks - self.reserve) * self.block_size

    def admit(self, seq: Sequence) -> bool:
        """Give a waiting sequence blocks for all its tokens, reusing cached prefix blocks; False if it must wait."""
        hits = []
        if self.enable_prefix_caching:
            hashes = prefix_block_hashes(seq.token_ids, self.block_size)
            hits = self.pool.lookup(hashes, seq.token_ids)
            if len(hits) * self.block_size >= seq.num_tokens:
                # The last token must be computed to get logits: recompute its whole block rather than
                # write into a block other sequences may be reading.
                hits = hits[:-1]
        needed = blocks_for(seq.num_tokens, self.block_size) - len(hits)
        idle_hits = sum(1 for b in hits if b.ref_count == 0)  # taking these shrinks the free queue
        if self.pool.num_free - idle_hits - needed < self.reserve:
            return False
        self.pool.touch(hits)
        seq.blocks = hits + self.pool.allocate(needed)
        seq.block_hashes = [b.hash for b in hits]  # type: ignore[misc]
        seq.num_computed_tokens = len(hits) * self.block_size
        if seq.num_preemptions == 0:
            seq.num_cached_tokens = seq.num_computed_tokens
            self.query_tokens += seq.num_tokens
            self.hit_tokens += seq.num_computed_tokens
        return True

    def grow(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Make room for num_new_tokens more K/V entries; False when no block is free."""
        needed = blocks_for(seq.num_computed_tokens + num_new_tokens, self.block_size) - len(seq.blocks)
        if needed <= 0:
            return True
        if not self.pool.can_allocate(needed):
            return False
        seq.blocks.extend(self.pool.allocate(needed))
        return True

    def cache_full_blocks(self, seq: Sequence, accepted: list[int] | None = None) -> None:
        """Register blocks that became full and computed this step, so later requests can reuse them.
        accepted: draft tokens the target kept this step, computed but not yet in seq.token_ids."""
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        token_ids = seq.token_ids + accepted if accepted else seq.token_ids
        while (len(seq.block_hashes) + 1) * bs <= seq.num_computed_tokens:
            i = len(seq.block_hashes)
            tokens = tuple(token_ids[i * bs:(i + 1) * bs])
            h = block_hash(seq.block_hashes[-1] if seq.block_hashes else None, tokens)
            seq.block_hashes.append(h)
            self.pool.cache_block(seq.blocks[i], h, tokens)

    def trim(self, seq: Sequence) -> None:
        """Give back the blocks past the computed tokens: those that held only rejected draft tokens.
        Their K/V is garbage, never hashed (only computed full blocks are), and overwritten if reused."""
        keep = max(blocks_for(seq.num_computed_tokens, self.block_size), len(seq.block_hashes))
        if len(seq.blocks) > keep:
            self.pool.release(seq.blocks[keep:])
            del seq.blocks[keep:]

    def free(self, seq: Sequence) -> None:
        self.pool.release(seq.blocks)
        seq.blocks = []
        seq.block_hashes = []
        seq.num_computed_tokens = 0

    @property
    def num_used_blocks(self) -> int:
        return self.pool.num_blocks - self.pool.num_free
