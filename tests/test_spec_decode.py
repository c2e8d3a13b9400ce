"""Speculative decoding: the output is the target model's, exactly, whatever is proposed; rejected
draft tokens leave nothing behind in the KV cache or the prefix cache; speculation is on only
where it pays."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from next_token import next_token_probs, plain_engine
from scipy.stats import chisquare

from fairway.block_hash import prefix_block_hashes
from fairway.engine import EngineConfig, LLMEngine, SamplingParams
from fairway.engine.kv_cache_manager import blocks_for
from fairway.engine.sequence import Sequence
from fairway.engine.spec_decode.config import SpeculativeConfig
from fairway.engine.spec_decode.ngram_proposer import LONG_MATCH, NgramProposer
from fairway.engine.spec_decode.policy import SpecPolicy
from fairway.engine.step_time import StepCost, StepTimeModel
from fairway.models import quant_linear
from fairway.models.config import LlamaConfig
from fairway.models.llama import random_model

GREEDY = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
DOC = ("The Apollo 11 mission launched on July 16, 1969, from Kennedy Space Center. Neil Armstrong and "
       "Buzz Aldrin landed the lunar module Eagle on the Moon on July 20, while Michael Collins remained in "
       "orbit aboard the command module Columbia. The crew returned to Earth on July 24.")
GROUNDED = [f"Repeat the following text exactly, word for word:\n\n{DOC}",
            f"{DOC}\n\nQuote the sentence of this text that names the command module.",
            "Write the numbers from 1 to 30, separated by commas.",
            "def add(a, b):\n    return a + b\n\nRename the function add to plus and repeat the code."]


def spec_engine(model, draft=None, **spec) -> LLMEngine:
    method = "draft_model" if draft is not None or "draft_num_layers" in spec else "ngram"
    # Steps bounded by tokens alone, as in plain_engine: the same chunks, so the same prefill numerics
    # (bf16 logits often tie exactly; a different chunking may break a tie the other way).
    config = EngineConfig(num_kv_blocks=256, bound_step_time=False,
                          speculative=SpeculativeConfig(method=method, **spec))
    return LLMEngine(model, config, draft_model=draft)


def always_speculate(eng: LLMEngine, monkeypatch) -> LLMEngine:
    """Draft at every step, whatever the step-time model says (a tiny model's draft costs as much as
    its target, so the policy would rightly switch speculation off): the tests are of exactness."""
    monkeypatch.setattr(eng.speculator.policy, "draft_pays", lambda *args: True)
    return eng


def random_prompts(n: int, vocab: int = 256, length: int = 12, seed: int = 3) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (length,), generator=g).tolist() for _ in range(n)]


@pytest.fixture(scope="module")
def real_model_bf16(model_path):
    from fairway.models.loader import load_model

    return load_model(model_path, torch.bfloat16)


@pytest.fixture(scope="module")
def grounded_prompts(real_tokenizer):
    return [real_tokenizer.chat_prompt_ids([{"role": "user", "content": q}]) for q in GROUNDED]


@pytest.mark.parametrize("spec", [{}, {"draft_num_layers": 10}], ids=["prompt-lookup", "truncated-draft"])
def test_greedy_on_the_real_model_is_token_for_token_the_same(real_model_bf16, grounded_prompts, spec, monkeypatch):
    """Four replies in one batch. A speculating run's replies end at other steps than the plain
    run's, so its last steps have fewer sequences; where a CPU's stored-block path for steps of one
    or two sequences (quant_linear.VNNI_ROWS: integer products) sums a block with outlier
    activations to another float32 rounding than the many-row path, a tie could break the other
    way there. Here every step takes one path, as on a CPU without that path; one reply alone on
    the default paths is the next test."""
    monkeypatch.setattr(quant_linear, "VNNI_ROWS", 0)
    off = plain_engine(real_model_bf16).generate(grounded_prompts, GREEDY)
    eng = spec_engine(real_model_bf16, **spec)
    assert eng.generate(grounded_prompts, GREEDY) == off
    stats = eng.stats()
    # Drafts were both kept and thrown away, and the step count fell with the kept ones.
    assert 0 < stats.spec_decode_num_accepted_tokens < stats.spec_decode_num_draft_tokens
    assert stats.num_steps < sum(len(o) for o in off) // len(off) + 1
    assert stats.kv_blocks_used == 0


def test_greedy_reply_alone_on_the_real_model_is_token_for_token_the_same(real_model_bf16, grounded_prompts):
    """One reply at a time (a chat), on the default paths: a verification's rows take the path of
    its decode row (the step's rows without drafts), so speculation changes no token."""
    for prompt in grounded_prompts:
        off = plain_engine(real_model_bf16).generate([prompt], GREEDY)
        assert spec_engine(real_model_bf16).generate([prompt], GREEDY) == off


@pytest.mark.parametrize("same_draft", [True, False], ids=["draft-is-target", "other-draft"])
def test_a_draft_model_never_changes_greedy_output(tiny_model, monkeypatch, same_draft):
    draft = tiny_model if same_draft else random_model(LlamaConfig.tiny(), seed=5)
    ps = random_prompts(4)
    off = plain_engine(tiny_model).generate(ps, GREEDY)
    eng = always_speculate(spec_engine(tiny_model, draft), monkeypatch)
    assert eng.generate(ps, GREEDY) == off
    stats = eng.stats()
    if same_draft:  # the target's own guesses: every draft token is kept, 5 tokens a step
        assert stats.spec_decode_num_accepted_tokens == stats.spec_decode_num_draft_tokens > 0
        assert stats.num_steps <= 2 + GREEDY.max_tokens // 9
    else:
        assert stats.spec_decode_num_accepted_tokens < stats.spec_decode_num_draft_tokens


def test_rejected_tokens_leave_no_blocks_and_no_hashes(tiny_model, monkeypatch):
    eng = always_speculate(spec_engine(tiny_model, random_model(LlamaConfig.tiny(), seed=5)), monkeypatch)
    for i, p in enumerate(random_prompts(3, length=30)):
        eng.add_request(f"r{i}", p, SamplingParams(temperature=0, max_tokens=60, ignore_eos=True))
    pool = eng.kv.pool
    rejected = 0
    while eng.has_unfinished():
        eng.step()
        stats = eng.stats()
        rejected = stats.spec_decode_num_draft_tokens - stats.spec_decode_num_accepted_tokens
        for seq in eng.scheduler.running:
            # Blocks for the computed tokens only; hashes of exactly the full blocks of accepted tokens.
            assert len(seq.blocks) == blocks_for(seq.num_computed_tokens)
            assert seq.block_hashes == prefix_block_hashes(seq.token_ids[:seq.num_computed_tokens])
            for i, h in enumerate(seq.block_hashes):
                assert pool.cached[h] is seq.blocks[i]
        assert pool.num_free == sum(1 for b in pool.blocks if b.ref_count == 0)
        assert sum(b.ref_count for b in pool.blocks) == sum(len(s.blocks) for s in eng.scheduler.running)
    assert rejected > 10 and eng.stats().kv_blocks_used == 0


@pytest.mark.parametrize("params", [dict(temperature=0.3), dict(temperature=0.5, top_k=5)],
                         ids=["temperature", "top-k"])
def test_a_seeded_reply_is_the_same_with_speculation_on_or_off(tiny_model, monkeypatch, params):
    ps = random_prompts(3)
    seeded = [SamplingParams(**params, seed=11 + i, max_tokens=30, ignore_eos=True) for i in range(3)]
    off = plain_engine(tiny_model).generate(ps, seeded)
    eng = always_speculate(spec_engine(tiny_model, tiny_model), monkeypatch)  # its own greedy guesses
    assert eng.generate(ps, seeded) == off
    stats = eng.stats()
    assert 0 < stats.spec_decode_num_accepted_tokens < stats.spec_decode_num_draft_tokens


def test_sampled_tokens_follow_the_target_distribution(monkeypatch):
    """Vocabulary of 8: the 2nd and 3rd tokens come from verifications of drafts (the target's own most
    likely tokens, kept a third of the time), unseeded so no draws are replayed; their joint
    distribution is the target's (chi-square)."""
    cfg = dataclasses.replace(LlamaConfig.tiny(vocab_size=8), hidden_size=32)
    target = random_model(cfg, seed=1)
    prompt, temperature, n = [1, 4, 2, 7], 1.0, 3000
    p1 = next_token_probs(target, prompt, temperature)
    expected = np.zeros((8, 8))
    for t1 in range(8):
        p2 = next_token_probs(target, prompt + [t1], temperature)
        for t2 in range(8):
            expected[t2] += p1[t1] * p2[t2] * next_token_probs(target, prompt + [t1, t2], temperature)
    torch.manual_seed(1234)
    eng = always_speculate(spec_engine(target, target, num_speculative_tokens=2, disable_by_batch_size=10**6),
                           monkeypatch)
    params = SamplingParams(temperature=temperature, max_tokens=4, ignore_eos=True)
    counts = np.zeros((8, 8))
    for _, t2, t3, _ in eng.generate([prompt] * n, params):
        counts[t2, t3] += 1
    stats = eng.stats()
    assert stats.spec_decode_num_draft_tokens >= 2 * n  # every reply verified 2 drafts after its first token
    assert 0.1 < stats.spec_decode_acceptance_rate < 0.9
    keep = expected.flatten() * n >= 5  # chi-square needs ~5 expected per cell: pool the rare ones
    observed = np.append(counts.flatten()[keep], counts.flatten()[~keep].sum())
    wanted = np.append(expected.flatten()[keep], expected.flatten()[~keep].sum()) * n
    assert chisquare(observed, wanted).pvalue > 1e-3


def test_prompt_lookup_proposes_what_followed_the_latest_longest_match():
    ngram = NgramProposer(min_n=2, max_n=3)
    seq = Sequence("s", [5, 6, 7, 8, 9, 1, 6, 7, 3, 4, 6, 7], GREEDY)
    # Suffix (6, 7): the 3-gram (4, 6, 7) never occurred before; (6, 7) last ended at index 7.
    assert ngram.propose([seq], [3]) == [[3, 4, 6]]
    assert ngram.propose([seq], [8]) == [[3, 4, 6, 7]]  # a 2-token match: at most 4 tokens from it
    seq.token_ids += [3, 4]  # now (7, 3, 4) matches at index 9
    assert ngram.propose([seq], [2]) == [[6, 7]]
    assert ngram.propose([Sequence("t", [1, 2, 3, 4], GREEDY)], [4]) == [[]]  # no repeated n-gram


def test_prompt_lookups_cue_is_the_length_of_its_match():
    ngram = NgramProposer(min_n=1, max_n=8)
    assert ngram.cue(Sequence("s", [5, 6, 7, 8, 9, 1, 6, 7], GREEDY)) == 2  # (6, 7) occurred before
    assert ngram.cue(Sequence("s", [5, 6, 7, 8, 9, 6, 7, 8, 9], GREEDY)) == LONG_MATCH  # 4 long and longer alike
    assert ngram.cue(Sequence("s", [1, 2, 3, 4], GREEDY)) is None  # nothing to follow: no guess


def test_each_cue_is_priced_on_its_own_record():
    policy = SpecPolicy(SpeculativeConfig(num_speculative_tokens=8, pause_steps=8),
                        _Fixed(StepCost(fixed=0.012, per_decode_row=0.0012, per_prefill_token=0.0003)), 4096)
    seq = _decoding(0.5)
    short, long = seq.spec.acceptance(1), seq.spec.acceptance(LONG_MATCH)
    short.accepted, short.tried, short.num_drafts = 0.5, 10.0, 5  # one-token matches: rarely right
    long.accepted, long.tried, long.num_drafts = 9.0, 10.0, 5  # long matches: nearly always
    assert policy.plan([seq], step=0, prefill_tokens=0, seconds_per_draft=0.0, cues=[LONG_MATCH]) == [8]
    assert policy.plan([seq], step=0, prefill_tokens=0, seconds_per_draft=0.0, cues=[1]) == [1]  # a probe
    assert policy.plan([seq], step=1, prefill_tokens=0, seconds_per_draft=0.0, cues=[1]) == [0]  # paused ...
    assert policy.plan([seq], step=1, prefill_tokens=0, seconds_per_draft=0.0, cues=[LONG_MATCH]) == [8]  # ... alone
    assert policy.plan([seq], step=1, prefill_tokens=0, seconds_per_draft=0.0, cues=[None]) == [0]  # no guess
    # A verification is recorded against the cue its drafts came with.
    seq.spec.cue = LONG_MATCH
    seq.spec.record(8, 2)
    assert long.num_drafts == 6 and short.num_drafts == 5 and long.rate < 0.9


def test_a_big_batch_looks_up_no_cue_and_prompt_lookup_catches_up_after_it():
    """From disable_by_batch_size decoding sequences no draft is possible, so no sequence's
    prompt-lookup index is touched that step; once the batch shrinks, the index catches up on the
    tokens it skipped and proposes what a fresh one would."""
    from fairway.engine.spec_decode.speculator import Speculator

    class Counting(NgramProposer):
        cues = 0

        def cue(self, seq):
            Counting.cues += 1
            return super().cue(seq)

    config = SpeculativeConfig(num_speculative_tokens=4, disable_by_batch_size=4, pause_steps=8)
    cheap = _Fixed(StepCost(fixed=0.012, per_decode_row=0.0001, per_prefill_token=0.0003))
    speculator = Speculator(Counting(min_n=2, max_n=3), SpecPolicy(config, cheap, 4096))
    batch = [_decoding(0.99) for _ in range(4)]
    for seq in batch:
        seq.token_ids[:] = [5, 6, 7, 8, 9, 1, 6, 7]
    speculator.propose(batch, step=0, prefill_tokens=0)
    assert Counting.cues == 0 and all(seq.spec_token_ids == [] for seq in batch)
    alone = batch[0]
    alone.token_ids += [8, 9, 1, 6]  # decoded while the batch was big
    speculator.propose([alone], step=1, prefill_tokens=0)
    assert Counting.cues == 1
    assert alone.spec_token_ids == NgramProposer(min_n=2, max_n=3).propose([alone], [4])[0] == [7, 8, 9, 1]


class _Fixed(StepTimeModel):
    def __init__(self, cost: StepCost) -> None:
        super().__init__(cost)

    def observe(self, *args) -> None:
        pass


def _decoding(acceptance: float, drafts: int = 5) -> Sequence:
    seq = Sequence("d", list(range(20)), SamplingParams(max_tokens=100))
    seq.num_computed_tokens = 19
    record = seq.spec.acceptance(0)
    record.accepted, record.tried, record.num_drafts = acceptance * 10, 10.0, drafts
    return seq



def test_policy_drafts_fewer_where_each_further_row_costs_more():
    """Steps priced as measured on a CPU whose extra rows are dear (one row 4.2 ms, each further
    draft row ~0.2 ms dearer than the one before): a sure cue gets the few drafts that raise the
    step's tokens per second, not as many as each alone would pay for against a one-row step."""
    config = SpeculativeConfig(num_speculative_tokens=8, pause_steps=8)
    linear = SpecPolicy(config, _Fixed(StepCost(0.0036, 0.0006, 0.0003)), 4096)
    bending = SpecPolicy(config, _Fixed(StepCost(0.0036, 0.0004, 0.0003, per_draft_row_squared=0.0001)), 4096)
    def tokens_per_second(policy: SpecPolicy, k: int, rate: float = 0.8) -> float:
        return sum(rate ** i for i in range(k + 1)) / policy.step_time.cost.predict(1 + k, 0, k)

    for policy, best in ((linear, 5), (bending, 3)):  # each the k of the most tokens per second
        assert policy.plan([_decoding(0.8)], step=0, prefill_tokens=0, seconds_per_draft=0.0) == [best]
        assert tokens_per_second(policy, best) == max(tokens_per_second(policy, k) for k in range(9))
    # Across a batch the surest drafts go first: the sure sequence gets more than the fair one.
    sure, fair = _decoding(0.9), _decoding(0.5)
    ks = bending.plan([fair, sure], step=0, prefill_tokens=0, seconds_per_draft=0.0)
    assert ks[1] > ks[0] >= 1

def test_policy_drafts_as_many_tokens_as_pay_and_none_for_big_batches():
    cheap_rows = _Fixed(StepCost(fixed=0.012, per_decode_row=0.0006, per_prefill_token=0.0003))
    policy = SpecPolicy(SpeculativeConfig(num_speculative_tokens=4, disable_by_batch_size=16, pause_steps=8),
                        cheap_rows, 4096)
    # One stream: an extra row costs ~5% of a step, so a fair chance pays.
    assert policy.plan([_decoding(0.9)], step=0, prefill_tokens=0, seconds_per_draft=0.0) == [4]
    assert policy.plan([_decoding(0.3)], step=0, prefill_tokens=0, seconds_per_draft=0.0) == [2]
    # A costly draft model lowers it; a big batch switches it off.
    assert policy.plan([_decoding(0.5)], step=0, prefill_tokens=0, seconds_per_draft=0.004) == [1]
    assert policy.plan([_decoding(0.99) for _ in range(16)], 0, 0, 0.0) == [0] * 16
    # Compute-bound steps (a row costs its share) want near-certain drafts: a poor sequence pauses,
    # is probed with one token, then gets nothing until its pause ends.
    bound = SpecPolicy(SpeculativeConfig(pause_steps=8), _Fixed(StepCost(0.001, 0.002, 0.001)), 4096)
    poor = _decoding(0.5)
    assert bound.plan([poor], step=10, prefill_tokens=0, seconds_per_draft=0.0) == [1]
    assert [bound.plan([poor], step, 0, 0.0)[0] for step in range(11, 18)] == [0] * 7
    assert bound.plan([poor], step=18, prefill_tokens=0, seconds_per_draft=0.0) == [1]
    # A fit whose every term clamped to 0 (noisy timings) predicts free steps: the prior decides.
    clamped = SpecPolicy(SpeculativeConfig(num_speculative_tokens=4, disable_by_batch_size=16, pause_steps=8),
                         _Fixed(StepCost(0.0, 0.0, 0.0)), 4096)
    assert clamped.plan([_decoding(0.3)], step=0, prefill_tokens=0, seconds_per_draft=0.0) == [2]
    # Never past max_tokens: room for the drafts and the token after them.
    near_end = _decoding(0.9)
    near_end.params = SamplingParams(max_tokens=3)
    near_end.num_prompt_tokens = 19  # 1 output token so far: 2 more allowed
    assert policy.plan([near_end], step=0, prefill_tokens=0, seconds_per_draft=0.0) == [1]
