"""What the caller asks of one generation: how to sample and when to stop."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from fairway.domain import MAX_LOGIT_BIAS, MAX_LOGIT_BIAS_ENTRIES, MAX_PENALTY, MAX_TOP_LOGPROBS

# Temperatures below this sample as greedy (vLLM's _SAMPLING_EPS): dividing logits by a smaller one,
# or one that rounds to 0 in float32/bf16 (1e-320 does), overflows the sampler.
SAMPLING_EPS = 1e-5
_DIGITS = frozenset("0123456789")  # str.isdigit() also takes '²', which int() refuses


@dataclass
class SamplingParams:
    temperature: float = 1.0  # 0 (or below SAMPLING_EPS) means greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 means no top-k cut
    seed: int | None = None
    max_tokens: int = 256
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    # Output held to a grammar (guided_decoding.py): {"json_schema": {...}}, {"json_object": true}
    # or {"lark": "..."}; None: free text.
    guided_decoding: dict[str, Any] | None = None
    # OpenAI's penalties on the tokens generated so far and bias per token id (logit_adjust.py).
    # logit_bias keys may come as JSON gives them, strings of digits: they are read as ints here.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    # OpenAI's logprobs: how many of each position's most likely tokens to return with each sampled
    # token's own log-probability (0: its own alone); None: no logprobs (logprobs.py).
    logprobs: int | None = None

    def __post_init__(self) -> None:
        # Validate here so every entry point (CLI, HTTP, tests) gets the same error naming the field.
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        # NaN passes `< 0` (every comparison with it is False) and would reach the sampler.
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0, got {self.top_k!r}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError("stop must be a list of non-empty strings")
        if self.guided_decoding is not None and not isinstance(self.guided_decoding, dict):
            raise ValueError("guided_decoding must be a dict (json_schema, json_object or lark)")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _number(value) or not -MAX_PENALTY <= value <= MAX_PENALTY:
                raise ValueError(f"{name} must be a number in [-2, 2], got {value!r}")
        self.logit_bias = _logit_bias(self.logit_bias)
        if self.logprobs is not None and (not isinstance(self.logprobs, int) or isinstance(self.logprobs, bool)
                                          or not 0 <= self.logprobs <= MAX_TOP_LOGPROBS):
            raise ValueError(f"logprobs must be an integer in [0, {MAX_TOP_LOGPROBS}] (the top tokens wanted) "
                             f"or None, got {self.logprobs!r}")

    @property
    def adjusts_logits(self) -> bool:
        """Whether a penalty or a bias changes this request's logits before sampling."""
        return bool(self.presence_penalty or self.frequency_penalty or self.logit_bias)

    @property
    def greedy(self) -> bool:
        return self.temperature < SAMPLING_EPS


def _number(value: Any) -> bool:
    """A finite int or float (a bool is an int to Python, not a number to JSON)."""
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _logit_bias(bias: Any) -> dict[int, float]:
    """The bias as {token id: float}, checked (each token id below the vocabulary's size is the
    engine's check: it knows the model)."""
    if not isinstance(bias, dict):
        raise ValueError(f"logit_bias must be a dict of token id to number, got {type(bias).__name__}")
    if len(bias) > MAX_LOGIT_BIAS_ENTRIES:
        raise ValueError(f"logit_bias may bias at most {MAX_LOGIT_BIAS_ENTRIES} tokens, got {len(bias)}")
    out: dict[int, float] = {}
    for key, value in bias.items():
        if isinstance(key, str) and key and set(key) <= _DIGITS:
            key = int(key)
        if not isinstance(key, int) or isinstance(key, bool) or key < 0:
            raise ValueError(f"logit_bias keys must be token ids (non-negative integers), got {key!r}")
        if not _number(value) or not -MAX_LOGIT_BIAS <= value <= MAX_LOGIT_BIAS:
            raise ValueError(f"logit_bias values must be numbers in [-100, 100], got {value!r} for token {key}")
        out[key] = float(value)
    return out
