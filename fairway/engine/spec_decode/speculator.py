"""Speculative decoding for one engine: each step, draft tokens for the decoding sequences that
gain from them (policy.py) from one proposer, and the counters the metrics report."""

from __future__ import annotations

from fairway.engine.kv_cache_manager import KVCacheManager
from fairway.engine.sequence import Sequence
from fairway.engine.spec_decode.config import SpeculativeConfig
from fairway.engine.spec_decode.draft_model_proposer import DraftModelProposer
from fairway.engine.spec_decode.ngram_proposer import NgramProposer
from fairway.engine.spec_decode.policy import SpecPolicy
from fairway.engine.spec_decode.proposer import Proposer
from fairway.engine.step_time import StepTimeModel
from fairway.models.llama import LlamaModel, truncated


class Speculator:
    def __init__(self, proposer: Proposer, policy: SpecPolicy) -> None:
        self.proposer = proposer
        self.policy = policy
        self.num_drafts = self.num_draft_tokens = self.num_accepted_tokens = 0

    @staticmethod
    def build(config: SpeculativeConfig, target: LlamaModel, kv: KVCacheManager, step_time: StepTimeModel,
              max_model_len: int, draft: LlamaModel | None = None) -> Speculator:
        proposer: Proposer
        if config.method == "ngram":
            proposer = NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
        else:
            if draft is None:
                if config.draft_num_layers is None:
                    raise ValueError("the draft_model method needs a draft model (or draft_num_layers)")
                draft = truncated(target, config.draft_num_layers)
            if draft.cfg.vocab_size != target.cfg.vocab_size:
                raise ValueError(f"draft model vocabulary {draft.cfg.vocab_size} != target's {target.cfg.vocab_size}:"
                                 " a draft must share the target's tokenizer")
            proposer = DraftModelProposer(draft, kv)
        return Speculator(proposer, SpecPolicy(config, step_time, max_model_len))

    def propose(self, decoding: list[Sequence], step: int, prefill_tokens: int) -> None:
        """Set spec_token_ids of the decoding sequences that get drafts this step."""
        for seq in decoding:
            seq.spec_token_ids.clear()
        if not self.policy.drafts_at(len(decoding)):
            return  # a big batch: no cue to look up (prompt lookup's index catches up when it shrinks)
        cues = [self.proposer.cue(seq) for seq in decoding]
        ks = self.policy.plan(decoding, step, prefill_tokens, self.proposer.seconds_per_token, cues)
        picked = [i for i, k in enumerate(ks) if k > 0]
        if not picked:
            return
        drafts = self.proposer.propose([decoding[i] for i in picked], [ks[i] for i in picked])
        for i, tokens in zip(picked, drafts, strict=True):
            decoding[i].spec_token_ids = tokens[:ks[i]]
            decoding[i].spec.cue = cues[i] or 0  # (a picked sequence has a cue: None gets no drafts)

    def record(self, seq: Sequence, drafts: int, accepted: int) -> None:
        seq.spec.record(drafts, accepted)
        self.num_drafts += 1
        self.num_draft_tokens += drafts
        self.num_accepted_tokens += accepted

