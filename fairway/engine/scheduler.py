"""Decides each step's batch: one token for every running sequence, then prefill chunks for arrivals.

Waiting sequences sit in one lane per priority (paid, free, background); a lane is served only
when the lanes before it are empty. Preempted sequences go back to the front of their lane.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from fairway.domain import Priority
from fairway.engine.kv_cache_manager import KVCacheManager
from fairway.engine.sequence import Sequence, SequenceStatus


@dataclass
class SchedulerConfig:
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 512  # per-step token budget; longer prompts are prefilled in chunks


@dataclass
class ScheduledBatch:
    # Sequences read through the paged decode path come first (one new token, or a decoding one's
    # last token and its draft tokens), prefill chunks after.
    seqs: list[Sequence] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def empty(self) -> bool:
        return not self.seqs


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager) -> None:
        self.config = config
        self.kv = kv
        self.lanes: list[deque[Sequence]] = [deque() for _ in range(Priority.BACKGROUND + 1)]
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    @property
    def num_waiting(self) -> int:
        return sum(len(lane) for lane in self.lanes)

    def has_work(self) -> bool:
        return bool(self.running) or self.num_waiting > 0

    def add(self, seq: Sequence) -> None:
        self.lanes[seq.priority].append(seq)

    def remove(self, seq: Sequence) -> None:
        """Take a sequence out of the scheduler (finished or aborted) and free its blocks."""
        if seq in self.running:
            self.running.remove(seq)
        else:
            self.lanes[seq.priority].remove(seq)
        self.kv.free(seq)

    def prefill_tokens_next(self) -> int:
        """About how many prompt tokens the next step will prefill (running prompts first, then the
        waiting ones, up to the budget), before it is scheduled."""
        budget = self.config.max_num_batched_tokens
        tokens = sum(s.num_tokens - s.num_computed_tokens for s in self.running if not s.is_decoding)
        for lane in self.lanes:
            for seq in lane:
                if tokens >= budget:
                    return budget
                tokens += seq.num_tokens
        return min(tokens, budget)

    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        budget = self.config.max_num_batched_tokens
        chosen: dict[Sequence, int] = {}
        # Running sequences oldest first, decoding ones before those still prefilling.
        for seq in sorted(self.running, key=lambda s: (s.num_tokens - s.num_computed_tokens > 1, s.arrival)):
            if seq.status != SequenceStatus.RUNNING or budget == 0:
                continue
            if seq.spec_token_ids:  # verify the draft tokens too, as many as the budget allows
                del seq.spec_token_ids[budget - 1:]
            n = min(seq.num_tokens - seq.num_computed_tokens + len(seq.spec_token_ids), budget)
            if not self._make_room(seq, n, chosen, batch):
                continue
            chosen[seq] = n
            budget -= n
        if not batch.preempted:
            budget = self._admit_waiting(chosen, budget)
        ones = [s for s, n in chosen.items() if n == 1 or s.is_decoding]
        many = [s for s, n in chosen.items() if n > 1 and not s.is_decoding]
        batch.seqs = ones + many
        batch.num_new_tokens = [chosen[s] for s in batch.seqs]
        return batch

    def _make_room(self, seq: Sequence, n: int, chosen: dict[Sequence, int], batch: ScheduledBatch) -> bool:
        """Grow seq's blocks for n tokens, preempting the newest lowest-priority sequences if needed."""
        while not self.kv.grow(seq, n):
            victim = max(self.running, key=lambda s: (s.priority, s.arrival))
            self._preempt(victim, batch)
            chosen.pop(victim, None)
            if victim is seq:
                return False
        return True

    def _preempt(self, seq: Sequence, batch: ScheduledBatch) -> None:
        self.running.remove(seq)
        self.kv.free(seq)  # full blocks stay cached, so the recompute is mostly prefix hits
        seq.spec_token_ids.clear()
        seq.spec.draft_computed = 0
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.lanes[seq.priority].appendleft(seq)
        batch.preempted.append(seq)

    def _admit_waiting(self, chosen: dict[Sequence, int], budget: int) -> int:
        for lane in self.lanes:
            while lane and budget > 0 and len(self.running) < self.config.max_num_seqs:
                seq = lane[0]
                if not self.kv.admit(seq):
                    return budget  # head of the highest lane does not fit: nothing behind it jumps ahead
                lane.popleft()
                seq.status = SequenceStatus.RUNNING
                self.running.append(seq)
                n = min(seq.num_tokens - seq.num_computed_tokens, budget)
                chosen[seq] = n
                budget -= n
        return budget
