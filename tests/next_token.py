"""A model's own distribution of the next token, from one plain forward pass: what the sampling
tests (speculation's rejection sampling, penalties) compare the engine's draws with."""

from __future__ import annotations

import numpy as np
import torch

from fairway.engine import EngineConfig, LLMEngine, SamplingParams
from fairway.engine.scheduler import ScheduledBatch
from fairway.engine.sequence import Sequence


def plain_engine(model) -> LLMEngine:
    """No speculation; steps bounded by tokens alone (the same prefill chunks every run)."""
    return LLMEngine(model, EngineConfig(num_kv_blocks=256, bound_step_time=False, speculative=None))


def next_token_probs(model, tokens: list[int], temperature: float) -> np.ndarray:
    """The model's distribution of the token after `tokens` at this temperature (float64)."""
    eng = plain_engine(model)
    seq = Sequence("p", list(tokens), SamplingParams(temperature=0, max_tokens=1))
    assert eng.kv.admit(seq)
    ids, positions, meta, rows, _, _ = eng.runner._prepare(ScheduledBatch([seq], [len(tokens)]))
    logits = model.compute_logits(model(ids, positions, eng.runner.kv, meta)[rows])[0]
    return torch.softmax(logits.double() / temperature, dim=-1).numpy()
