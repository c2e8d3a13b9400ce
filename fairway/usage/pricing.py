"""What a reply costs: a price per 1k tokens for prompt, cached prompt and completion tokens."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Price:
    prompt_per_1k: float
    completion_per_1k: float
    cached_prompt_per_1k: float | None = None  # None: half the prompt price

    def cost(self, prompt_tokens: int, cached_tokens: int, completion_tokens: int) -> float:
        cached = min(cached_tokens, prompt_tokens)
        cached_price = self.prompt_per_1k / 2 if self.cached_prompt_per_1k is None else self.cached_prompt_per_1k
        return ((prompt_tokens - cached) * self.prompt_per_1k + cached * cached_price
                + completion_tokens * self.completion_per_1k) / 1000.0


@dataclass(frozen=True)
class Pricing:
    default: Price = Price(prompt_per_1k=0.00015, completion_per_1k=0.0006)
    models: dict[str, Price] = field(default_factory=dict)

    def price(self, model: str) -> Price:
        return self.models.get(model, self.default)

    def cost(self, model: str, prompt_tokens: int, cached_tokens: int, completion_tokens: int) -> float:
        return self.price(model).cost(prompt_tokens, cached_tokens, completion_tokens)
