"""What the engine hands back: one RequestOutput per new token, the last one with a finish reason."""

from __future__ import annotations

from dataclasses import dataclass

from fairway.domain import FinishReason


@dataclass
class Logprobs:
    """One sampled token's log-probability and its position's most likely tokens, best first
    (OpenAI's logprobs, from the model's raw logits: logprobs.py)."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # (token id, logprob), at most the request's top_logprobs


@dataclass
class RequestOutput:
    request_id: str
    token_id: int | None  # None only on a final output that carries no token (abort, or a stop string cut)
    text: str  # the text delta this token adds (valid UTF-8; may be "" while a character is incomplete)
    finish_reason: FinishReason | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    num_output_tokens: int = 0
    ttft: float | None = None  # seconds from arrival to the first token
    inter_token_times: list[float] | None = None  # on the final output only
    logprobs: Logprobs | None = None  # this token's, when the request asks for them

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
