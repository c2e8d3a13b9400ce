"""What the caller asks of one generation: how to sample and when to stop."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

# Temperatures below this sample as greedy (vLLM's _SAMPLING_EPS): dividing logits by a smaller one,
# or one that rounds to 0 in float32/bf16 (1e-320 does), overflows the sampler.
SAMPLING_EPS = 1e-5


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

    @property
    def greedy(self) -> bool:
        return self.temperature < SAMPLING_EPS
