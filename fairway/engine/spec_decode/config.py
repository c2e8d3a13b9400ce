"""How speculative decoding is set up for an engine (vLLM's option names where it has them)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class SpeculativeConfig:
    method: str = "ngram"  # "ngram" (prompt lookup) or "draft_model"
    # The most draft tokens a sequence gets per step. Defaults chosen by replaying the greedy replies
    # of bench/spec_decode.py's prompts through the proposer (tokens per step, a draft row priced as
    # bench/README.md says).
    num_speculative_tokens: int = 8
    prompt_lookup_max: int = 8  # n-gram lengths matched against the sequence so far, longest first
    prompt_lookup_min: int = 1
    draft_model: str | None = None  # draft_model: a model file or folder of the same tokenizer ...
    draft_num_layers: int | None = None  # ... or the target's own first N layers (shared weights)
    disable_by_batch_size: int = 16  # no speculation while this many sequences are decoding
    pause_steps: int = 16  # a sequence for which speculation does not pay waits this long before a probe

    def __post_init__(self) -> None:
        if self.method not in ("ngram", "draft_model"):
            raise ValueError(f"speculative method must be 'ngram' or 'draft_model', got {self.method!r}")
        if self.num_speculative_tokens < 1:
            raise ValueError("num_speculative_tokens must be >= 1")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError("need 1 <= prompt_lookup_min <= prompt_lookup_max")
        if self.draft_model is not None and self.draft_num_layers is not None:
            raise ValueError("give draft_model (a path) or draft_num_layers, not both")
