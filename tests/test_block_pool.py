"""Property tests of the block pool under the real scheduler: no block is both free and referenced,
reference counts equal the sequences holding a block, and nothing leaks once every request ends."""

from __future__ import annotations

from collections import Counter

from hypothesis import example, given, settings
from hypothesis import strategies as st

from fairway.block_hash import prefix_block_hashes
from fairway.engine.block_pool import BlockPool
from fairway.engine.kv_cache_manager import KVCacheManager
from fairway.engine.sampling_params import SamplingParams
from fairway.engine.scheduler import Scheduler, SchedulerConfig
from fairway.engine.sequence import Sequence


def check_invariants(kv: KVCacheManager, seqs: list[Sequence]) -> None:
    pool = kv.pool
    holders = Counter(b.block_id for s in seqs for b in s.blocks)
    for block in pool.blocks:
        in_free = block.block_id in pool.free
        assert not (in_free and block.ref_count > 0), f"block {block.block_id} free and referenced"
        assert in_free or block.ref_count > 0, f"block {block.block_id} leaked"
        assert block.ref_count == holders[block.block_id]
    for h, block in pool.cached.items():
        assert block.hash == h
    for s in seqs:
        assert len(set(b.block_id for b in s.blocks)) == len(s.blocks)


ops = st.lists(st.tuples(st.sampled_from(["add", "step", "step", "step", "abort"]),
                         st.integers(0, 10**6)), min_size=1, max_size=60)


# The explicit example is one a random run once found (see the drain loop).
@settings(max_examples=150, deadline=None)
@given(ops=ops, num_blocks=st.integers(8, 40), budget=st.sampled_from([8, 32, 64]),
       shared=st.booleans())
@example(ops=[("add", 0), ("add", 0), ("add", 0)], num_blocks=8, budget=32, shared=True)
def test_pool_invariants_under_scheduling(ops, num_blocks, budget, shared):
    kv = KVCacheManager(num_blocks, block_size=4, reserve_blocks=1)
    sched = Scheduler(SchedulerConfig(max_num_seqs=6, max_num_batched_tokens=budget), kv)
    live: list[Sequence] = []
    common = [7] * 9  # a shared prefix so requests hit each other's cached blocks
    counter = 0
    for op, r in ops:
        if op == "add":
            length = 1 + r % 30
            prompt = (common if shared else []) + [(r * 31 + i) % 50 for i in range(length)]
            if -(-len(prompt) // 4) + 2 > num_blocks - 1:
                continue
            seq = Sequence(f"r{counter}", prompt, SamplingParams(max_tokens=1 + r % 12, temperature=0))
            counter += 1
            sched.add(seq)
            live.append(seq)
        elif op == "abort" and live:
            seq = live.pop(r % len(live))
            sched.remove(seq)
        else:
            run_step(sched, live, r)
        check_invariants(kv, [s for s in live if s.blocks])
    while live:  # drain: every request must finish and give back every block
        # Progress is any request finishing or computing a token; a step where one finishes and
        # the next is only admitted next step (its blocks were still held) is progress too.
        before = progress(live)
        run_step(sched, live, 0)
        check_invariants(kv, [s for s in live if s.blocks])
        assert live == [] or sched.has_work()
        if progress(live) == before and not sched.running:
            break
    assert not live
    assert kv.pool.num_free == num_blocks
    assert all(b.ref_count == 0 for b in kv.pool.blocks)


def progress(live: list[Sequence]) -> tuple[int, int]:
    return len(live), sum(s.num_computed_tokens + s.num_output_tokens for s in live)


def run_step(sched: Scheduler, live: list[Sequence], r: int) -> None:
    """What LLMEngine.step does, minus the model: advance computed tokens, append a token, finish."""
    batch = sched.schedule()
    for seq, n in zip(batch.seqs, batch.num_new_tokens, strict=True):
        seq.num_computed_tokens += n
        sched.kv.cache_full_blocks(seq)
        if seq.num_computed_tokens == seq.num_tokens:
            seq.token_ids.append((r + seq.num_tokens) % 50)
            if seq.num_output_tokens >= seq.params.max_tokens:
                sched.remove(seq)
                live.remove(seq)


def test_hash_hit_is_verified_by_tokens():
    pool = BlockPool(4, block_size=2)
    tokens = [1, 2, 3, 4]
    hashes = prefix_block_hashes(tokens, 2)
    blocks = pool.allocate(2)
    for b, h, i in zip(blocks, hashes, (0, 2), strict=True):
        pool.cache_block(b, h, tuple(tokens[i:i + 2]))
    pool.release(blocks)
    assert pool.lookup(hashes, tokens) == blocks
    # Same hashes claimed for different tokens (a collision) must not be served.
    assert pool.lookup(hashes, [1, 2, 9, 9]) == blocks[:1]


def test_freed_blocks_stay_cached_until_needed_lru():
    pool = BlockPool(3, block_size=1)
    a, b = pool.allocate(2)
    pool.cache_block(a, 11, (1,))
    pool.cache_block(b, 22, (2,))
    pool.release([a])
    pool.release([b])
    assert set(pool.cached) == {11, 22}  # freed, but still reusable
    pool.allocate(1)  # the never-cached block goes first
    assert set(pool.cached) == {11, 22}
    pool.allocate(1)  # then the least recently freed cached block is evicted
    assert set(pool.cached) == {22}
    assert pool.lookup([22], [2]) == [b]
