"""The measured step-time model, and the scheduler bounding each step's time with it."""

from __future__ import annotations

import numpy as np
import pytest

from fairway.engine import EngineConfig, LLMEngine, SamplingParams
from fairway.engine.step_time import StepCost, StepTimeModel

COST = StepCost(fixed=0.010, per_decode_row=0.0005, per_prefill_token=0.0002)


def test_step_time_model_learns_costs_it_sees_and_keeps_its_prior_for_the_rest():
    model = StepTimeModel(StepCost(fixed=0.01, per_decode_row=0.001, per_prefill_token=0.001))
    rng = np.random.default_rng(0)
    for _ in range(300):  # rows vary, prefill never happens
        rows = int(rng.integers(1, 33))
        model.observe(rows, 0, 0.004 + 0.0005 * rows + rng.normal(0, 1e-4))
    assert model.cost.fixed == pytest.approx(0.004, abs=5e-4)
    assert model.cost.per_decode_row == pytest.approx(0.0005, abs=5e-5)
    assert model.cost.per_prefill_token == pytest.approx(0.001, rel=0.05)  # unseen: the prior holds
    for _ in range(300):  # now prefill too
        rows, prefill = int(rng.integers(1, 33)), int(rng.integers(0, 512))
        model.observe(rows, prefill, 0.004 + 0.0005 * rows + 0.0002 * prefill + rng.normal(0, 1e-4))
    assert model.cost.per_prefill_token == pytest.approx(0.0002, rel=0.05)



def test_step_time_model_learns_that_draft_rows_grow_dearer():
    """A single stream's verification steps, rows 1 + d, priced as on a CPU where the first extra
    rows ride along with reading the weights and later ones pay their products: the fit bends, and
    the d-th draft row's price follows the measured growth."""
    model = StepTimeModel()
    rng = np.random.default_rng(1)
    true = StepCost(fixed=0.0038, per_decode_row=0.0004, per_prefill_token=0.0003, per_draft_row_squared=0.0001)
    for _ in range(400):
        drafts = int(rng.integers(0, 9))
        model.observe(1 + drafts, 0, true.predict(1 + drafts, 0, drafts) + rng.normal(0, 5e-5), drafts)
    for d in (1, 4, 8):
        assert model.cost.draft_row(d) == pytest.approx(true.draft_row(d), rel=0.15)
    assert model.cost.draft_row(8) > 3 * model.cost.draft_row(1)
    # Plain steps of many sequences (no drafts) leave the draft term as it was learned.
    bend = model.cost.per_draft_row_squared
    for _ in range(50):
        rows = int(rng.integers(1, 33))
        model.observe(rows, 0, true.predict(rows, 0) + rng.normal(0, 5e-5))
    assert model.cost.per_draft_row_squared == pytest.approx(bend, rel=0.1)

def _frozen(eng: LLMEngine, cost: StepCost, monkeypatch) -> LLMEngine:
    """The engine's step-time model fixed at `cost` (a tiny model's real steps would teach it others)."""
    eng.step_time.cost = cost
    monkeypatch.setattr(eng.step_time, "observe", lambda *args: None)
    return eng


def _run_and_record(eng: LLMEngine, prompts: list[list[int]], max_tokens: int) -> list[tuple[int, int]]:
    """(decode rows, prefill tokens) of every step until all finish."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    for i, p in enumerate(prompts):
        eng.add_request(f"r{i}", p, params)
    steps = []
    schedule = eng.scheduler.schedule

    def recording():
        batch = schedule()
        decode = sum(n for s, n in zip(batch.seqs, batch.num_new_tokens, strict=True) if s.is_decoding)
        steps.append((decode, sum(batch.num_new_tokens) - decode))
        return batch

    eng.scheduler.schedule = recording
    while eng.has_unfinished():
        eng.step()
    return steps


def test_prefill_chunks_shrink_as_more_sequences_decode_and_output_is_unchanged(tiny_model, monkeypatch):
    # 40 prompts of 150 tokens arrive at once; a step's budget is the 50 ms target or 1.5x the
    # decode-only step of all 40 (1.5 * 30 ms = 45 ms): 50 ms. Without a bound, 512-token steps.
    prompts = [[(7 * i + j) % 256 for j in range(150)] for i in range(40)]
    cfg = dict(num_kv_blocks=1024, speculative=None)
    free = _frozen(LLMEngine(tiny_model, EngineConfig(**cfg, bound_step_time=False)), COST, monkeypatch)
    bounded = _frozen(LLMEngine(tiny_model, EngineConfig(**cfg, bound_step_time=True, step_time_target=0.05)),
                      COST, monkeypatch)
    free_steps = _run_and_record(free, prompts, 8)
    bounded_steps = _run_and_record(bounded, prompts, 8)
    assert max(COST.predict(*s) for s in free_steps) > 0.1  # 512 prompt tokens beside the decodes
    # Every step with a sequence decoding within the target (the first, decoding nothing, is not bounded).
    assert bounded_steps[0] == (0, 512)
    assert all(COST.predict(decode, prefill) <= 0.0501 for decode, prefill in bounded_steps[1:])
    # The chunk is what the target leaves beside the decode rows (200 tokens less 2.5 per row), not less.
    assert np.mean([prefill for _, prefill in bounded_steps if prefill]) > 100
    assert bounded.generate(prompts[:3], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)) == \
        free.generate(prompts[:3], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))


def test_when_decoding_alone_exceeds_the_target_prompts_still_progress(tiny_model, monkeypatch):
    # 100 decoding rows cost 60 ms, over the 50 ms target: a step may take 1.5x that (90 ms), so
    # prompts get 150 tokens a step, and never fewer than a block.
    eng = _frozen(LLMEngine(tiny_model, EngineConfig(num_kv_blocks=2048, speculative=None, bound_step_time=True,
                                                   step_time_target=0.05)),
                  COST, monkeypatch)
    sched = eng.scheduler
    assert sched.prefill_budget(1, 2) == 197  # one decoding: the 50 ms target, (50 - 10.5) / 0.2
    assert sched.prefill_budget(0, 100) == 512  # nobody decoding: nobody's inter-token time to keep
    assert sched.prefill_budget(100, 100) == int((1.5 * 0.060 - 0.060) / 0.0002)
    assert sched.prefill_budget(400, 100) == eng.kv.block_size
    assert LLMEngine(tiny_model, EngineConfig(bound_step_time=False)).scheduler.prefill_budget(400, 100) == 512
