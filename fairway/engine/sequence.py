"""One request inside the engine: its tokens, its blocks, and how far the model has computed it."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

import torch

from fairway.domain import FinishReason, Priority
from fairway.engine.block_pool import KVBlock
from fairway.engine.logit_adjust import LogitAdjust
from fairway.engine.outputs import Logprobs
from fairway.engine.sampling_params import SamplingParams
from fairway.engine.spec_decode.state import SpecState
from fairway.engine.stop_checker import StopChecker


class SequenceStatus(StrEnum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    request_id: str
    token_ids: list[int]  # prompt followed by generated tokens
    params: SamplingParams
    priority: int = Priority.PAID  # its lane now (a background sequence that waited long moves up)
    arrival: float = field(default_factory=time.monotonic)
    num_prompt_tokens: int = 0
    status: SequenceStatus = SequenceStatus.WAITING
    blocks: list[KVBlock] = field(default_factory=list)
    block_hashes: list[int] = field(default_factory=list)  # hashes of the full blocks so far
    num_computed_tokens: int = 0  # tokens whose K/V are in the cache
    # Draft tokens proposed for the next step, after token_ids; checked by the target, never part of
    # token_ids until accepted.
    spec_token_ids: list[int] = field(default_factory=list)
    spec: SpecState = field(default_factory=SpecState)
    num_cached_tokens: int = 0  # prompt tokens that came from the prefix cache at first admission
    num_preemptions: int = 0
    finish_reason: FinishReason | None = None
    generator: torch.Generator | None = None
    stop_checker: StopChecker | None = None  # turns tokens into text deltas and finds stop strings
    first_token_time: float | None = None
    last_token_time: float | None = None
    inter_token_times: list[float] = field(default_factory=list)
    guide: Any = None  # the llguidance matcher of a guided request (guided_decoding.py), at its last token
    base_priority: int = -1  # the lane it was added in (-1: priority's)
    # Its penalties and logit bias with the counts of its generated tokens (None: it sets neither)
    adjust: LogitAdjust | None = field(default=None, init=False)
    # The logprobs of the token the last step sampled for it, when it asks for them (logprobs.py):
    # set by the sampler, taken by the engine with the token.
    step_logprobs: Logprobs | None = field(default=None, init=False)

    def __post_init__(self) -> None:
        if self.base_priority < 0:
            self.base_priority = self.priority
        self.num_prompt_tokens = self.num_prompt_tokens or len(self.token_ids)
        if self.params.seed is not None:
            self.generator = torch.Generator().manual_seed(self.params.seed)
        # Tokens it generated before (a continuation's) count from the start.
        self.adjust = LogitAdjust.of(self.params, self.token_ids[self.num_prompt_tokens:])

    def resume_after(self, output_token_ids: list[int]) -> None:
        """Bring the text and the sampler to where they were after these generated tokens (the
        tail of token_ids): the stop checker reads them (their text was shown already: it is
        dropped, but what it held back is kept), and a seeded generator skips the one uniform
        each of them drew (sampler.py)."""
        for token in output_token_ids:
            if self.stop_checker is not None:
                self.stop_checker.add(token)
        if self.generator is not None and not self.params.greedy:
            for _ in output_token_ids:  # one at a time, as they were drawn
                torch.rand(1, generator=self.generator, dtype=torch.float64)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def is_decoding(self) -> bool:
        """Only the last sampled token is still to compute: the prompt is done."""
        return self.num_tokens - self.num_computed_tokens == 1

    @property
    def can_speculate(self) -> bool:
        """Whether drafts may be verified for it, all in one step. Not for one that samples a token
        a step: a guided one (its mask depends on every token before it), a penalised one (a
        verification row's penalties would have to count the drafts before it in that step), one
        asking for logprobs (the sampler gives them to one row per sequence). A logit bias alone
        is the same for every row: it speculates."""
        return self.guide is None and (self.adjust is None or not self.adjust.penalised) and self.params.logprobs is None

    @property
    def is_finished(self) -> bool:
        return self.status == SequenceStatus.FINISHED

    @property
    def ttft(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival
