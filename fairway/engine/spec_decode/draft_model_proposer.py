"""A smaller model of the same tokenizer guesses the next tokens, greedily, one batched step each.

The draft keeps its own K/V cache, laid out like the target's and addressed through the target's
block tables, so it needs no block accounting of its own: before drafting, the sequence's blocks
grow to hold the verification step's tokens (the draft writes a subset of those slots). Each
sequence records how many of its tokens the draft has computed; after verification that count
falls back to the accepted tokens. The draft computes every sequence from its first token itself
(a prefix-cache hit gives the target's K/V only).
"""

from __future__ import annotations

import time

from fairway.engine.kv_cache_manager import KVCacheManager
from fairway.engine.model_runner import ModelRunner
from fairway.engine.sampling_params import SamplingParams
from fairway.engine.scheduler import ScheduledBatch
from fairway.engine.sequence import Sequence, SequenceStatus
from fairway.models.llama import LlamaModel

_GREEDY = SamplingParams(temperature=0.0)
_EMA = 0.9  # weight of the past in the measured seconds per draft step


class DraftModelProposer:
    def __init__(self, model: LlamaModel, kv: KVCacheManager) -> None:
        self.runner = ModelRunner(model, kv.pool.num_blocks, kv.block_size)
        self.kv = kv
        self.seconds_per_token = 0.0  # measured: one batched draft step

    def cue(self, seq: Sequence) -> int | None:
        return 0  # every guess rests on the same model

    def propose(self, seqs: list[Sequence], ks: list[int]) -> list[list[int]]:
        drafts: list[list[int]] = [[] for _ in seqs]
        # The target's slots for the verification: the last token and k drafts (none: no drafting).
        live = [i for i, (seq, k) in enumerate(zip(seqs, ks, strict=True)) if k > 0 and self.kv.grow(seq, 1 + k)]
        views = {i: _view(seqs[i]) for i in live}
        for step in range(max((ks[i] for i in live), default=0)):
            todo = [i for i in live if ks[i] > step]
            t0 = time.perf_counter()
            batch = ScheduledBatch(seqs=[views[i] for i in todo],
                                   num_new_tokens=[views[i].num_tokens - views[i].num_computed_tokens for i in todo])
            tokens = self.runner.execute(batch)
            for i, n in zip(todo, batch.num_new_tokens, strict=True):
                view = views[i]
                view.num_computed_tokens += n
                (token,) = tokens[view]
                view.token_ids.append(token)
                drafts[i].append(token)
            if step > 0:  # the first step also catches up on the context: not the cost of a token
                seconds = time.perf_counter() - t0
                self.seconds_per_token = seconds if not self.seconds_per_token else (
                    _EMA * self.seconds_per_token + (1 - _EMA) * seconds)
        for i in live:
            seqs[i].spec.draft_computed = views[i].num_computed_tokens
        return drafts


def _view(seq: Sequence) -> Sequence:
    """The sequence as the draft sees it: its tokens (a copy, drafts appended), its blocks (shared),
    and the draft's own computed count."""
    return Sequence(seq.request_id, list(seq.token_ids), _GREEDY, num_prompt_tokens=seq.num_prompt_tokens,
                    status=SequenceStatus.RUNNING, blocks=seq.blocks,
                    num_computed_tokens=min(seq.spec.draft_computed, seq.num_tokens - 1))
