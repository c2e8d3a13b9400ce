"""A token's logprobs as the reply's events carry them: the engine's token ids spelt out by the
replica's tokenizer (the gateway may not have the model's), each as its text and its bytes."""

from __future__ import annotations

from typing import Any

from fairway.engine.outputs import Logprobs
from fairway.relay.events import TokenLogprob

# What a logprob of -inf (a token the model rules out entirely) is sent as: JSON has no infinity
# (vLLM sends the same).
FLOOR = -9999.0


def token_logprobs(logprobs: Logprobs | None, tokenizer: Any) -> list[TokenLogprob]:
    """The event's logprobs for one sampled token (none when the reply does not ask for them)."""
    if logprobs is None:
        return []
    top = [_spelt(tokenizer, token, value) for token, value in logprobs.top]
    sampled = _spelt(tokenizer, logprobs.token_id, logprobs.logprob)
    return [TokenLogprob(sampled.token, sampled.logprob, sampled.bytes, top)]


def _spelt(tokenizer: Any, token_id: int, logprob: float) -> TokenLogprob:
    raw = tokenizer.token_bytes(token_id)
    return TokenLogprob(raw.decode("utf-8", errors="replace"), max(logprob, FLOOR), list(raw))
