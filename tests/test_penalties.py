"""OpenAI's presence and frequency penalties and logit bias in the engine: the sampler's adjusted
logits against the formula, greedy and sampled rows, a continuation, speculative decoding, the
GPU's sampler and a grammar's mask. Expected tokens come from the model's own logits."""

from __future__ import annotations

import json
from collections import Counter

import numpy as np
import pytest
import torch
from next_token import next_token_probs

from fairway.engine import EngineConfig, LLMEngine, SamplingParams
from fairway.engine.device_sampler import DeviceSampler
from fairway.engine.host_buffers import HostBuffers
from fairway.engine.sampler import adjust_rows, sample
from fairway.engine.sequence import Sequence
from fairway.engine.spec_decode.config import SpeculativeConfig
from fairway.replica.job import GenerationJob

MAX_TOKENS = 16
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)


def engine(model, **kw) -> LLMEngine:
    return LLMEngine(model, EngineConfig(**{"num_kv_blocks": 128, "bound_step_time": False, "speculative": None,
                                            **kw}))


def prompts(n: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, 256, (10 * (i + 1),), generator=g).tolist() for i in range(n)]


def repeats(tokens: list[int]) -> int:
    return len(tokens) - len(set(tokens))


def with_(params: SamplingParams, **kw) -> SamplingParams:
    return SamplingParams(**{**vars(params), **kw})


def reference_logits(logits: torch.Tensor, params: SamplingParams, generated: list[int]) -> torch.Tensor:
    """OpenAI's formula, token by token."""
    counts = Counter(generated)
    out = logits.clone()
    for t in range(logits.shape[-1]):
        c = counts[t]
        delta = params.logit_bias.get(t, 0.0) - params.frequency_penalty * c - params.presence_penalty * (c > 0)
        out[t] += delta
    return out


def test_the_sampler_adjusts_the_rows_that_ask_and_no_other():
    vocab, prompt, generated = 40, [3, 3, 9, 9, 9], [3, 5, 5, 5, 11]
    params = [SamplingParams(temperature=0),
              SamplingParams(temperature=0, frequency_penalty=0.7, presence_penalty=0.3),
              SamplingParams(temperature=0.8, seed=1, logit_bias={"2": 100, "5": -3.5}),
              SamplingParams(temperature=0, frequency_penalty=2, presence_penalty=-1.25, logit_bias={5: 1.0, 9: 4}),
              SamplingParams(temperature=1.1, top_k=10, seed=2, frequency_penalty=-1.5)]
    seqs = [Sequence(f"r{i}", prompt + generated, p, num_prompt_tokens=len(prompt)) for i, p in enumerate(params)]
    logits = torch.randn(len(seqs), vocab, generator=torch.Generator().manual_seed(3)) * 2
    adjusted = logits.clone()
    adjust_rows(adjusted, seqs)
    want = torch.stack([reference_logits(logits[i], p, generated) for i, p in enumerate(params)])
    torch.testing.assert_close(adjusted, want)
    assert seqs[0].adjust is None and torch.equal(adjusted[0], logits[0])  # nothing set: untouched
    assert adjusted[1, 9] == logits[1, 9]  # a prompt token is not penalised
    # Greedy rows take the argmax of the adjusted logits.
    picked = sample(logits.clone(), [Sequence(f"g{i}", prompt + generated, p, num_prompt_tokens=len(prompt))
                                     for i, p in enumerate(params)])
    assert [picked[i] for i in (0, 1, 3)] == [want[i].argmax().item() for i in (0, 1, 3)]


def test_a_bias_of_100_makes_every_token_that_token_greedy_or_sampled(tiny_model):
    eng = engine(tiny_model)
    ps = prompts(5)
    (alone,) = eng.generate(ps[:1], GREEDY)
    forced = next(t for t in range(256) if t not in alone)  # a token greedy would not pick
    bias = {str(forced): 100}
    params = [GREEDY, with_(GREEDY, logit_bias=bias), with_(GREEDY, temperature=1.0, seed=1, logit_bias=bias),
              with_(GREEDY, temperature=0.8, top_k=20, seed=2, logit_bias=bias),
              with_(GREEDY, temperature=1.3, top_p=0.9, logit_bias=bias)]
    outs = eng.generate(ps, params)
    assert outs[0] == alone  # the row without a bias is what it is alone
    assert outs[1:] == [[forced] * MAX_TOKENS] * 4


def test_a_bias_of_minus_100_bans_the_greedy_choice(tiny_model):
    eng = engine(tiny_model)
    prompt = prompts(1)[0]
    (unbiased,) = eng.generate([prompt], GREEDY)
    banned = unbiased[0]
    (biased,) = eng.generate([prompt], with_(GREEDY, logit_bias={banned: -100}))
    logits = torch.from_numpy(np.log(next_token_probs(tiny_model, prompt, 1.0)))
    logits[banned] -= 100
    assert biased[0] == logits.argmax().item() != banned
    assert banned not in biased


def test_a_penalised_greedy_reply_follows_the_formula_and_repeats_less(tiny_model):
    eng = engine(tiny_model)
    prompt = next(p for p in prompts(6) if repeats(eng.generate([p], GREEDY)[0]) >= 2)  # one that repeats
    params = with_(GREEDY, frequency_penalty=1.5, presence_penalty=0.5)
    expected: list[int] = []
    for _ in range(MAX_TOKENS):
        logits = torch.from_numpy(np.log(next_token_probs(tiny_model, prompt + expected, 1.0)))
        expected.append(reference_logits(logits, params, expected).argmax().item())
    eng.add_request("p", prompt, params)
    got: list[int] = []
    while eng.has_unfinished():
        seq = eng.requests["p"]
        got += [o.token_id for o in eng.step()]
        assert seq.adjust.counts == Counter(got)  # kept as the tokens come, not recounted
    assert got == expected
    assert repeats(got) < repeats(eng.generate([prompt], GREEDY)[0])


def test_a_continuation_counts_the_tokens_generated_before_it(tiny_model):
    eng = engine(tiny_model)
    prompt = prompts(2)[1]
    params = with_(GREEDY, frequency_penalty=2.0, presence_penalty=1.0)
    (whole,) = eng.generate([prompt], params)
    eng.add_request("c", prompt, params, output_token_ids=whole[:6])  # a replica carrying on after a failover
    rest = []
    while eng.has_unfinished():
        rest += [o.token_id for o in eng.step()]
    assert rest == whole[6:]


def test_speculation_keeps_a_biased_reply_and_skips_a_penalised_one(tiny_model, monkeypatch):
    ps = prompts(3)
    (plain,) = engine(tiny_model).generate(ps[:1], GREEDY)
    biased = with_(GREEDY, logit_bias={plain[i]: -100 for i in (1, 3)})  # the draft (the target, unbiased) errs
    penalised = with_(GREEDY, frequency_penalty=1.0)
    off = engine(tiny_model).generate(ps, [biased, penalised, GREEDY])
    spec = LLMEngine(tiny_model, EngineConfig(num_kv_blocks=128, bound_step_time=False,
                                              speculative=SpeculativeConfig(method="draft_model")),
                     draft_model=tiny_model)  # the target's own greedy guesses, unbiased
    monkeypatch.setattr(spec.speculator.policy, "draft_pays", lambda *args: True)  # draft at every step
    assert spec.generate(ps[:1], biased) == off[:1]
    stats = spec.stats()
    assert 0 < stats.spec_decode_num_accepted_tokens < stats.spec_decode_num_draft_tokens
    assert spec.generate(ps[1:2], penalised) == off[1:2]
    assert spec.stats().spec_decode_num_draft_tokens == stats.spec_decode_num_draft_tokens  # none for it
    assert spec.generate(ps, [biased, penalised, GREEDY]) == off


def test_the_gpu_sampler_adjusts_as_the_host_sampler():
    logits = torch.randn(4, 300, generator=torch.Generator().manual_seed(5)) * 3
    settings = [SamplingParams(temperature=0, frequency_penalty=2, presence_penalty=2),
                SamplingParams(temperature=0, logit_bias={int(logits[1].argmax()): -100}),
                SamplingParams(temperature=0.9, top_k=30, seed=4, logit_bias={17: 100}),
                SamplingParams(temperature=0)]
    generated = logits[0].topk(3).indices.tolist()  # the three likeliest have been said: penalised

    def seqs() -> list[Sequence]:
        return [Sequence(str(i), [1, *generated], p, num_prompt_tokens=1) for i, p in enumerate(settings)]

    got = DeviceSampler(HostBuffers(torch.device("cpu"))).sample(logits.clone(), seqs()).tolist()
    assert got == sample(logits.clone(), seqs())
    assert got[0] not in generated and got[1] != logits[1].argmax() and got[2] == 17
    assert got[3] == logits[3].argmax()


def test_a_grammar_holds_whatever_the_bias(real_tokenizer):
    pytest.importorskip("llguidance")
    from fairway.engine.guided_decoding import Guides

    vocab = real_tokenizer.vocab_size
    guides = Guides(real_tokenizer, vocab)
    allowed = torch.zeros(1, vocab)
    adjust_rows(allowed, [_guided(guides, SamplingParams(temperature=0))])
    logits = torch.randn(1, vocab, generator=torch.Generator().manual_seed(2))
    refused = int(torch.where(allowed[0].isinf(), logits[0], -1e9).argmax())
    choice = int(torch.where(allowed[0].isinf(), -1e9, logits[0]).argmax())  # greedy under the grammar
    params = SamplingParams(temperature=0, logit_bias={refused: 100, choice: -100})
    (token,) = sample(logits.clone(), [_guided(guides, params)])
    assert token != choice and allowed[0, token] == 0  # the ban holds, and so does the grammar
    assert token == int(torch.where(allowed[0].isinf() | (torch.arange(vocab) == choice), -1e9, logits[0]).argmax())


def _guided(guides, params: SamplingParams) -> Sequence:
    seq = Sequence("g", [1], params)
    seq.guide = guides.matcher({"json_object": True})
    return seq


@pytest.mark.parametrize("field,kwargs", [
    ("presence_penalty", {"presence_penalty": 2.5}), ("frequency_penalty", {"frequency_penalty": -3}),
    ("frequency_penalty", {"frequency_penalty": float("nan")}), ("presence_penalty", {"presence_penalty": "1"}),
    ("logit_bias", {"logit_bias": {"a": 1}}), ("logit_bias", {"logit_bias": {"-1": 1}}),
    ("logit_bias", {"logit_bias": {"5": 101}}), ("logit_bias", {"logit_bias": {"5": True}}),
    ("logit_bias", {"logit_bias": {str(i): 1 for i in range(301)}}), ("logit_bias", {"logit_bias": [5]}),
])
def test_bad_penalties_and_biases_name_the_field(field, kwargs):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_the_job_carries_penalties_and_bias_to_the_replica(tiny_model):
    sampling = {"presence_penalty": -0.5, "frequency_penalty": 1.25, "logit_bias": {"5": -100.0, "17": 3.5}}
    job = GenerationJob("r", "m", [1, 2], sampling=sampling)
    back = GenerationJob.from_dict(json.loads(json.dumps(job.to_dict())))
    params = SamplingParams(**back.sampling)
    assert (params.presence_penalty, params.frequency_penalty, params.logit_bias) == (-0.5, 1.25, {5: -100.0, 17: 3.5})
    with pytest.raises(ValueError, match="logit_bias"):  # a token id past the model's vocabulary
        engine(tiny_model).add_request("v", [1, 2], SamplingParams(logit_bias={256: 1}))
