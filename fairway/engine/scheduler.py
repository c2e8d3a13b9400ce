"""Decides each step's batch: one token for every running sequence, then prefill chunks, lane by lane.

Waiting sequences sit in one lane per priority (paid, free, background). Prompt tokens go lane by
lane: the paid prompts already prefilling, then the paid arrivals, then free, then background, so
a paid prompt never waits behind a lower lane's. An arrival that finds no seat or no blocks takes
them from a running sequence of a lower lane (the lowest lane first, the newest first), which
goes back to the front of its lane and is recomputed later, mostly from the prefix cache. So a
flood of free requests delays a paid one by a step, not by a whole reply.

Background work ages: one that has waited background_max_wait_s moves up to the free lane (by its
arrival), and after twice that to the paid lane, so a busy replica never starves it for ever.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from fairway.domain import Priority
from fairway.engine.kv_cache_manager import KVCacheManager
from fairway.engine.sequence import Sequence, SequenceStatus
from fairway.engine.step_time import StepTimeModel


@dataclass
class SchedulerConfig:
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 512  # per-step token budget; longer prompts are prefilled in chunks
    # The time a step may take (seconds; None: tokens alone bound it). The prefill chunk shrinks
    # as more sequences decode, so their inter-token time stays near it. Where decoding alone
    # takes longer, a step may take step_time_headroom times the decode-only step of the whole
    # batch (everyone running or waiting), so prompts still progress and no step is far longer
    # than a typical one.
    step_time_target: float | None = None
    step_time_headroom: float = 1.5
    # A background sequence that waited this long moves up a lane (twice: up two); None: never.
    background_max_wait_s: float | None = 30.0


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

    @property
    def draft_rows(self) -> int:
        """The step's speculative draft tokens: a decoding sequence's rows after its last real token."""
        return sum(n - 1 for seq, n in zip(self.seqs, self.num_new_tokens, strict=True) if seq.is_decoding)


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager, step_time: StepTimeModel | None = None) -> None:
        self.config = config
        self.kv = kv
        self.step_time = step_time
        self.lanes: list[deque[Sequence]] = [deque() for _ in range(Priority.BACKGROUND + 1)]
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self.num_aged = 0  # background sequences moved up a lane

    @property
    def num_waiting(self) -> int:
        return sum(len(lane) for lane in self.lanes)

    def has_work(self) -> bool:
        return bool(self.running) or self.num_waiting > 0

    def add(self, seq: Sequence) -> None:
        self.lanes[seq.priority].append(seq)

    def age(self, now: float | None = None) -> None:
        """Move background sequences that waited past the bound up a lane, each by its arrival
        (so among the free lane's it stands where it would have had it arrived free)."""
        bound = self.config.background_max_wait_s
        if bound is None:
            return
        now = time.monotonic() if now is None else now
        for priority in (Priority.FREE, Priority.BACKGROUND):  # free first: a sequence climbs one lane per call
            lane = self.lanes[priority]
            due = [s for s in lane if s.base_priority == Priority.BACKGROUND
                   and now - s.arrival > bound * (Priority.BACKGROUND - priority + 1)]
            for seq in due:
                lane.remove(seq)
                seq.priority = priority - 1
                higher = self.lanes[seq.priority]
                at = next((i for i, s in enumerate(higher) if s.arrival > seq.arrival), len(higher))
                higher.insert(at, seq)
                self.num_aged += 1

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
        running = sorted(self.running, key=lambda s: s.arrival)
        decoding = [s for s in running if s.is_decoding]
        for seq in decoding:
            if seq.status != SequenceStatus.RUNNING or budget == 0:
                continue
            if seq.spec_token_ids:  # verify the draft tokens too, as many as the budget allows
                del seq.spec_token_ids[budget - 1:]
            budget -= self._take(seq, 1 + len(seq.spec_token_ids), chosen, batch)
        whole_batch = min(self.config.max_num_seqs, len(self.running) + self.num_waiting)
        budget = min(budget, self.prefill_budget(sum(chosen.values()), whole_batch))
        self.age()
        for priority, lane in enumerate(self.lanes):  # prompt tokens lane by lane, paid first
            for seq in running:
                if seq.priority != priority or seq.is_decoding or seq.status != SequenceStatus.RUNNING \
                        or budget == 0:
                    continue
                budget -= self._take(seq, min(seq.num_tokens - seq.num_computed_tokens, budget), chosen, batch)
            if not batch.preempted:
                budget = self._admit_waiting(lane, chosen, budget, batch)
        ones = [s for s, n in chosen.items() if n == 1 or s.is_decoding]
        many = [s for s, n in chosen.items() if n > 1 and not s.is_decoding]
        batch.seqs = ones + many
        batch.num_new_tokens = [chosen[s] for s in batch.seqs]
        return batch

    def prefill_budget(self, decode_rows: int, whole_batch: int) -> int:
        """Prompt tokens that fit in this step beside decode_rows decode rows, by the step-time
        model (whole_batch: the sequences running or waiting); at least a block, so prompts always
        progress. A step that decodes nothing takes the whole token budget: the bound is for the
        inter-token time of decoding sequences."""
        c = self.config
        if c.step_time_target is None or self.step_time is None or decode_rows == 0:
            return c.max_num_batched_tokens  # no sequence waits for this step's token: no bound
        cost = self.step_time.cost
        limit = max(c.step_time_target, c.step_time_headroom * cost.predict(whole_batch, 0))
        room = limit - cost.predict(decode_rows, 0)
        if cost.per_prefill_token <= 0:
            return c.max_num_batched_tokens
        return max(self.kv.block_size, min(int(room / cost.per_prefill_token), c.max_num_batched_tokens))

    def _take(self, seq: Sequence, n: int, chosen: dict[Sequence, int], batch: ScheduledBatch) -> int:
        """Schedule n tokens of a running sequence if its blocks can grow; returns the tokens taken."""
        if not self._make_room(seq, n, chosen, batch):
            return 0
        chosen[seq] = n
        return n

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

    def _admit_waiting(self, lane: deque[Sequence], chosen: dict[Sequence, int], budget: int,
                       batch: ScheduledBatch) -> int:
        """Admit the lane's sequences in order while the budget lasts, each taking a seat and
        blocks from lower lanes' running sequences when none are free."""
        while lane and budget > 0:
            seq = lane[0]
            while len(self.running) >= self.config.max_num_seqs or not self.kv.admit(seq):
                lower = [s for s in self.running if s.priority > seq.priority]
                if not lower:
                    return budget  # the head does not fit: nothing behind it jumps ahead
                victim = max(lower, key=lambda s: (s.priority, s.arrival))  # the lowest lane, the newest
                self._preempt(victim, batch)
                budget += chosen.pop(victim, 0)
            lane.popleft()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            chosen[seq] = n
            budget -= n
        return budget
