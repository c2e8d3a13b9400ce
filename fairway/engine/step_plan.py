"""One step's flat batch as host lists: which token goes in which row, at which position and cache
slot, which rows are decode rows and which prefill chunks, and which rows are sampled. Both
runners build their device inputs from it (model_runner.py for the CPU, gpu_model_runner.py)."""

from __future__ import annotations

from dataclasses import dataclass, field

from fairway.engine.scheduler import ScheduledBatch
from fairway.engine.sequence import Sequence


@dataclass
class StepPlan:
    input_ids: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    slots: list[int] = field(default_factory=list)
    decode_rows: list[tuple[Sequence, int]] = field(default_factory=list)  # (sequence, context length), rows first
    prefills: list[tuple[int, int, Sequence]] = field(default_factory=list)  # rows [row, end) of seq, after them
    sample_rows: list[int] = field(default_factory=list)
    samplers: list[Sequence] = field(default_factory=list)
    num_rows: list[int] = field(default_factory=list)  # sample rows of each sampler

    @property
    def decode_only(self) -> bool:
        return not self.prefills


def plan_step(batch: ScheduledBatch, block_size: int) -> StepPlan:
    plan = StepPlan()
    # Decode rows first, shortest context first, so similar lengths sit next to each other.
    pairs = sorted(zip(batch.seqs, batch.num_new_tokens, strict=True),
                   key=lambda sn: (not decodes(*sn), sn[0].num_computed_tokens if decodes(*sn) else 0))
    for seq, n in pairs:
        start = seq.num_computed_tokens
        row = len(plan.input_ids)
        drafts = start + n - seq.num_tokens  # > 0: draft tokens to check after the last real one
        plan.input_ids.extend(seq.token_ids[start:start + n])
        if drafts > 0:
            plan.input_ids.extend(seq.spec_token_ids[:drafts])
        plan.positions.extend(range(start, start + n))
        plan.slots.extend(slots_of(seq, start, start + n, block_size))
        if decodes(seq, n):  # each row a decode row: the cache holds every key it may see
            plan.decode_rows.extend((seq, p + 1) for p in range(start, start + n))
        else:
            plan.prefills.append((row, row + n, seq))
        if start + n >= seq.num_tokens:
            rows = n if drafts > 0 else 1
            plan.sample_rows.extend(range(row + n - rows, row + n))
            plan.samplers.append(seq)
            plan.num_rows.append(rows)
    return plan


def decodes(seq: Sequence, n: int) -> bool:
    """Whether seq's n scheduled tokens go through the paged decode path: one token, or a decoding
    sequence's last token with its draft tokens (row i attends to the context up to itself, which
    the step writes to the cache before any row attends)."""
    return n == 1 or seq.is_decoding


def slots_of(seq: Sequence, begin: int, end: int, block_size: int) -> list[int]:
    """The KV cache slots of seq's positions [begin, end)."""
    return [seq.blocks[p // block_size].block_id * block_size + p % block_size for p in range(begin, end)]
