"""OpenAI's logprobs in the engine: the sampler's rows that ask get the log-softmax of the raw
logits (before bias, penalties and temperature), their top tokens best first, and no other row
gets any; the GPU's sampler gives the same; a reply's logprobs match the model's own distribution
at each position; a sequence asking for them does not speculate and its reply is unchanged."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from next_token import next_token_probs

from fairway.engine import EngineConfig, LLMEngine, SamplingParams
from fairway.engine.device_sampler import DeviceSampler
from fairway.engine.host_buffers import HostBuffers
from fairway.engine.sampler import sample
from fairway.engine.sequence import Sequence
from fairway.engine.spec_decode.config import SpeculativeConfig


def engine(model, **kw) -> LLMEngine:
    return LLMEngine(model, EngineConfig(**{"num_kv_blocks": 128, "bound_step_time": False, "speculative": None,
                                            **kw}))


def run(eng: LLMEngine, prompt: list[int], params: SamplingParams, rid: str = "r") -> list:
    eng.add_request(rid, prompt, params)
    outs = []
    while eng.has_unfinished():
        outs += [o for o in eng.step() if o.request_id == rid and o.token_id is not None]
    return outs


SETTINGS = [
    SamplingParams(temperature=0, logprobs=3),
    SamplingParams(temperature=0),  # asks for none
    SamplingParams(temperature=0.7, seed=3, logprobs=5, logit_bias={7: 100}, frequency_penalty=1.0),
    SamplingParams(temperature=1.3, top_k=20, seed=1, logprobs=0),
]


def seqs() -> list[Sequence]:
    return [Sequence(str(i), [1, 2, 7], p, num_prompt_tokens=2) for i, p in enumerate(SETTINGS)]


def test_the_sampler_gives_raw_logprobs_to_the_rows_that_ask_and_no_other():
    logits = torch.randn(4, 300, generator=torch.Generator().manual_seed(5)) * 3
    rows = seqs()
    tokens = sample(logits.clone(), rows)
    raw = logits.double().log_softmax(dim=-1)
    assert rows[1].step_logprobs is None
    assert tokens[2] == 7  # the bias forced it; its logprob is still the model's own
    for i, k in ((0, 3), (2, 5), (3, 0)):
        lp = rows[i].step_logprobs
        assert lp.token_id == tokens[i]
        assert lp.logprob == pytest.approx(float(raw[i, tokens[i]]), abs=1e-5)
        assert len(lp.top) == k
        assert [t for t, _ in lp.top] == raw[i].topk(k).indices.tolist()
        assert [v for _, v in lp.top] == pytest.approx(raw[i].topk(k).values.tolist(), abs=1e-5)
        assert all(a >= b for (_, a), (_, b) in zip(lp.top, lp.top[1:], strict=False))
    greedy = rows[0].step_logprobs
    assert greedy.token_id == greedy.top[0][0] and greedy.logprob == greedy.top[0][1]


def test_the_gpu_sampler_gives_the_host_samplers_logprobs():
    logits = torch.randn(4, 300, generator=torch.Generator().manual_seed(6)) * 3
    host, device = seqs(), seqs()
    got = DeviceSampler(HostBuffers(torch.device("cpu"))).sample(logits.clone(), device).tolist()
    want = sample(logits.clone(), host)
    for i in (0, 2):  # greedy and a biased row: the same token on both samplers
        assert got[i] == want[i]
        assert device[i].step_logprobs.logprob == pytest.approx(host[i].step_logprobs.logprob, abs=1e-6)
        assert device[i].step_logprobs.top == host[i].step_logprobs.top
    assert device[1].step_logprobs is None
    assert device[3].step_logprobs.token_id == got[3] and device[3].step_logprobs.top == []


def test_a_replys_logprobs_are_the_models_distribution_at_each_position(tiny_model):
    prompt = [5, 9, 12, 40, 3]
    for params in (SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=4),
                   SamplingParams(temperature=0.8, seed=2, max_tokens=6, ignore_eos=True, logprobs=2,
                                  presence_penalty=1.5)):
        outs = run(engine(tiny_model), prompt, params)
        assert len(outs) == 6
        context = list(prompt)
        for out in outs:
            probs = next_token_probs(tiny_model, context, 1.0)  # temperature 1: the raw distribution
            assert out.logprobs.token_id == out.token_id
            assert out.logprobs.logprob == pytest.approx(math.log(probs[out.token_id]), abs=1e-4)
            top = np.argsort(-probs)[:len(out.logprobs.top)]
            assert [t for t, _ in out.logprobs.top] == top.tolist()
            assert sum(math.exp(v) for _, v in out.logprobs.top) <= 1 + 1e-6
            if params.greedy:
                assert out.logprobs.top[0] == (out.token_id, out.logprobs.logprob)
            context.append(out.token_id)


def test_a_reply_without_logprobs_gets_none(tiny_model):
    outs = run(engine(tiny_model), [5, 9, 12], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    assert [o.logprobs for o in outs] == [None] * 4


def test_a_sequence_asking_for_logprobs_does_not_speculate(tiny_model, monkeypatch):
    prompt = [5, 9, 12, 40, 3, 5, 9, 12]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=1)
    off = run(engine(tiny_model), prompt, params)
    spec = LLMEngine(tiny_model, EngineConfig(num_kv_blocks=128, bound_step_time=False,
                                              speculative=SpeculativeConfig(method="draft_model")),
                     draft_model=tiny_model)
    monkeypatch.setattr(spec.speculator.policy, "draft_pays", lambda *args: True)  # draft at every step
    on = run(spec, prompt, params)
    assert spec.stats().spec_decode_num_draft_tokens == 0
    assert [(o.token_id, o.logprobs) for o in on] == [(o.token_id, o.logprobs) for o in off]
    without = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    assert [o.token_id for o in run(spec, prompt, without, "w")] == [o.token_id for o in off]
    assert spec.stats().spec_decode_num_draft_tokens > 0  # the same reply without logprobs speculates


def test_a_continuation_has_logprobs_for_its_new_tokens(tiny_model):
    prompt, params = [5, 9, 12, 40], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=2)
    whole = run(engine(tiny_model), prompt, params)
    eng = engine(tiny_model)
    eng.add_request("c", prompt, params, output_token_ids=[o.token_id for o in whole[:3]])
    rest = []
    while eng.has_unfinished():
        rest += [o for o in eng.step() if o.token_id is not None]
    assert [o.token_id for o in rest] == [o.token_id for o in whole[3:]]
    for a, b in zip(rest, whole[3:], strict=True):
        assert a.logprobs.logprob == pytest.approx(b.logprobs.logprob, abs=1e-5)


@pytest.mark.parametrize("value", [-1, 21, 2.0, True, "3"])
def test_bad_logprobs_name_the_field(value):
    with pytest.raises(ValueError, match="logprobs"):
        SamplingParams(logprobs=value)
