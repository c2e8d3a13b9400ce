"""Engine mechanics on a tiny random Llama: chunked prefill, lanes, abort, preemption, sampling, bad input."""

from __future__ import annotations

import asyncio
import threading

import pytest
import torch

from fairway.engine import (
    AsyncEngine,
    EngineConfig,
    FinishReason,
    LLMEngine,
    Priority,
    RequestRejected,
    SamplingParams,
)
from fairway.engine.factory import build_engine
from fairway.engine.model_runner import _prefill_groups
from fairway.engine.sequence import Sequence
from fairway.engine.stop_checker import StopChecker
from fairway.models import cpu_kernels
from fairway.models.bundled import ModelFileError
from fairway.models.config import LlamaConfig
from fairway.models.llama import random_model

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def prompts(n: int, lo: int = 5, hi: int = 90) -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    lengths = torch.randint(lo, hi, (n,), generator=g).tolist()
    return [torch.randint(0, 256, (k,), generator=g).tolist() for k in lengths]


def engine(model=None, **kw) -> LLMEngine:
    """Steps bounded by tokens alone, so what each step schedules does not depend on how fast this
    machine is right now (the step-time bound has its own tests, test_step_time.py)."""
    config = EngineConfig(**{"num_kv_blocks": 128, "bound_step_time": False, **kw})
    return LLMEngine(model or random_model(LlamaConfig.tiny()), config)


def test_chunked_and_batched_prefill_match_one_at_a_time(tiny_model):
    ps = prompts(8)
    alone = [engine(tiny_model, max_num_batched_tokens=1024).generate([p], GREEDY)[0] for p in ps]
    chunked = engine(tiny_model, max_num_batched_tokens=16)
    assert chunked.generate(ps, GREEDY) == alone
    assert chunked.stats().num_steps > 12  # prompts really were split across steps
    # All at once (whole prompts of different lengths padded into shared attention calls), and
    # in 100-token steps (new prompts next to continued ones in the same step).
    assert engine(tiny_model, max_num_batched_tokens=1024).generate(ps, GREEDY) == alone
    assert engine(tiny_model, max_num_batched_tokens=100).generate(ps, GREEDY) == alone


def test_prefill_chunks_of_similar_size_share_one_attention_call():
    def span(row: int, n: int, computed: int = 0) -> tuple[int, int, Sequence]:
        seq = Sequence(f"s{row}", list(range(computed + n)), GREEDY)
        seq.num_computed_tokens = computed
        return row, row + n, seq

    fresh = [span(0, 40), span(40, 43), span(83, 41), span(124, 300)]
    continued = [span(424, 16, computed=16), span(440, 20, computed=32)]
    groups = _prefill_groups([*fresh, *continued])
    assert [[row for row, _, _ in g] for g in groups] == [[0, 83, 40], [124], [424, 440]]


def test_one_step_mixes_prefill_and_decode(tiny_model):
    eng = engine(tiny_model, max_num_batched_tokens=64)
    eng.add_request("a", [1, 2, 3], GREEDY)
    eng.step()
    eng.add_request("b", prompts(2)[1], GREEDY)
    batch = eng.scheduler.schedule()
    assert batch.num_new_tokens[0] == 1 and max(batch.num_new_tokens) > 1


def test_paid_lane_admitted_before_free_and_background(tiny_model):
    eng = engine(tiny_model, max_num_seqs=1)
    eng.add_request("bg", [1, 2, 3], GREEDY, priority=Priority.BACKGROUND)
    eng.add_request("free", [1, 2, 4], GREEDY, priority=Priority.FREE)
    eng.add_request("paid", [1, 2, 5], GREEDY, priority=Priority.PAID)
    order = []
    while eng.has_unfinished():
        for out in eng.step():
            if out.finished:
                order.append(out.request_id)
    assert order == ["paid", "free", "bg"]


def test_abort_frees_blocks_at_next_step(tiny_model):
    eng = engine(tiny_model)
    eng.add_request("x", prompts(1)[0], SamplingParams(temperature=0, max_tokens=100))
    eng.step()
    assert eng.stats().kv_blocks_used > 0
    eng.abort("x")
    outs = eng.step()
    assert [(o.request_id, o.finish_reason) for o in outs] == [("x", FinishReason.ABORT)]
    assert eng.stats().kv_blocks_used == 0 and not eng.has_unfinished()


def test_preemption_recomputes_newest_and_output_is_unchanged(tiny_model):
    ps = prompts(6, 20, 40)
    roomy = engine(tiny_model).generate(ps, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    tight = engine(tiny_model, num_kv_blocks=sum(-(-len(p) // 16) for p in ps) + 3, reserve_blocks=1)
    got = tight.generate(ps, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    assert tight.stats().num_preemptions > 0
    assert got == roomy


def test_prefix_cache_reuses_blocks_and_full_hit_still_computes_last_token(tiny_model):
    eng = engine(tiny_model)
    p = list(range(64))  # exactly 4 full blocks
    first = eng.generate([p], GREEDY)
    assert eng.stats().prefix_cache_hits == 0
    second = eng.generate([p], GREEDY)
    assert second == first
    assert eng.stats().prefix_cache_hits == 48  # 3 blocks reused, the last recomputed for its logits


def test_length_and_context_window_finish(tiny_model):
    eng = engine(tiny_model, max_model_len=40)
    eng.add_request("w", list(range(30)), SamplingParams(temperature=0, max_tokens=100, ignore_eos=True))
    outs = []
    while eng.has_unfinished():
        outs += eng.step()
    assert outs[-1].finish_reason == FinishReason.LENGTH and len(outs) == 10


def test_seeded_sampling_is_reproducible(tiny_model):
    eng = engine(tiny_model)
    p = prompts(1)[0]
    a = eng.generate([p], SamplingParams(temperature=1.0, seed=7, max_tokens=20, ignore_eos=True))
    b = eng.generate([p], SamplingParams(temperature=1.0, seed=7, max_tokens=20, ignore_eos=True))
    c = eng.generate([p], SamplingParams(temperature=1.0, seed=8, max_tokens=20, ignore_eos=True))
    assert a == b and a != c
    top1 = eng.generate([p], SamplingParams(temperature=1.0, top_k=1, seed=3, max_tokens=20, ignore_eos=True))
    tiny_p = eng.generate([p], SamplingParams(temperature=1.0, top_p=1e-6, seed=3, max_tokens=20, ignore_eos=True))
    assert top1 == tiny_p == eng.generate([p], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))


def test_counters_and_latencies(tiny_model):
    eng = engine(tiny_model, speculative=None)  # one token a step
    eng.add_request("t", [1, 2, 3], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))
    outs = []
    while eng.has_unfinished():
        outs += eng.step()
    assert outs[0].ttft is not None and outs[0].ttft > 0
    assert len(outs[-1].inter_token_times) == 4
    s = eng.stats()
    assert s.num_steps == 5 and s.prefix_cache_queries == 3 and s.forward_seconds <= s.step_seconds


@pytest.mark.parametrize("field,kwargs", [
    ("max_tokens", {"max_tokens": 0}), ("temperature", {"temperature": -0.1}),
    ("top_p", {"top_p": 0.0}), ("top_p", {"top_p": 1.5}), ("top_k", {"top_k": -1}),
])
def test_bad_sampling_params_name_the_field(field, kwargs):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_prompts_that_can_never_run_are_rejected_before_admission(tiny_model):
    eng = engine(tiny_model, num_kv_blocks=8, max_model_len=4096)
    with pytest.raises(RequestRejected, match="KV cache"):
        eng.add_request("big", list(range(200)), GREEDY)
    eng = engine(tiny_model, max_model_len=32)
    with pytest.raises(RequestRejected, match="context window"):
        eng.add_request("long", list(range(40)), GREEDY)
    with pytest.raises(RequestRejected, match="empty"):
        eng.add_request("empty", [], GREEDY)
    assert not eng.has_unfinished()


def test_stop_strings_cut_text_and_hold_back_partial_matches(real_tokenizer):
    ids = real_tokenizer.encode("The answer is 42. END of story")
    checker = StopChecker(SamplingParams(stop=["END"]), real_tokenizer)
    emitted, hit = "", False
    for t in ids:
        text, hit = checker.add(t)
        emitted += text
        if hit:
            break
    assert hit and emitted == "The answer is 42. "
    checker = StopChecker(SamplingParams(stop=["ENDX"]), real_tokenizer)
    emitted = "".join(checker.add(t)[0] for t in ids) + checker.flush()
    assert emitted == "The answer is 42. END of story"


async def test_async_engine_streams_concurrently_and_leaving_early_aborts(tiny_model):
    aeng = AsyncEngine(engine(tiny_model))
    try:
        async def collect(rid, n):
            return [o async for o in aeng.generate(rid, prompts(2)[1], SamplingParams(
                temperature=0, max_tokens=n, ignore_eos=True))]

        a, b = await asyncio.gather(collect("a", 8), collect("b", 5))
        assert len(a) == 8 and len(b) == 5 and a[-1].finish_reason == FinishReason.LENGTH

        async for _ in aeng.generate("c", [1, 2, 3], SamplingParams(temperature=0, max_tokens=1000)):
            break  # the consumer walks away: the request is aborted and its blocks freed
        for _ in range(100):
            if aeng.last_stats.kv_blocks_used == 0 and not aeng.engine.has_unfinished():
                break
            await asyncio.sleep(0.02)
        assert aeng.engine.stats().kv_blocks_used == 0
        with pytest.raises(RequestRejected):
            await anext(aeng.generate("d", [], GREEDY))
    finally:
        aeng.shutdown()


@pytest.mark.parametrize("kv_dtype", [None, torch.bfloat16], ids=["kv-as-weights", "kv-bf16"])
@pytest.mark.parametrize("native", [True, False], ids=["native-kernel", "portable-groups"])
def test_decode_groups_by_length_match_one_at_a_time(tiny_model, monkeypatch, native, kv_dtype):
    if not native:
        monkeypatch.setenv("FAIRWAY_NATIVE_KERNELS", "0")
    monkeypatch.setattr(tiny_model, "kv_cache_dtype", kv_dtype)  # float32 compute over a bf16 cache
    ps = prompts(24, 3, 200)  # lengths spread widely: several decode groups per step
    alone = [engine(tiny_model, num_kv_blocks=512).generate([p], GREEDY)[0] for p in ps[:6]]
    eng = engine(tiny_model, num_kv_blocks=512, max_num_batched_tokens=2048)
    got = eng.generate(ps, GREEDY)
    assert got[:6] == alone
    for p in ps:
        eng.add_request(f"again-{len(p)}-{p[0]}", p, GREEDY)
    eng.step()
    eng.step()
    batch = eng.scheduler.schedule()
    _, _, meta, _, _, _ = eng.runner._prepare(batch)
    assert eng.runner.kv.k.dtype == (kv_dtype or torch.float32)
    if native:  # every decode row goes to the kernel in one call
        assert meta.decode_tables is not None and not meta.decodes
        assert meta.decode_tables.context_lens.shape[0] == sum(n == 1 for n in batch.num_new_tokens)
    else:
        assert meta.decode_tables is None and len(meta.decodes) > 1


def test_sampler_draws_in_proportion_and_never_a_filtered_token():
    from fairway.engine.sampler import _draw

    probs = torch.tensor([[0.5, 0.0, 0.3, 0.2, 0.0]])
    gen = torch.Generator().manual_seed(0)
    draws = torch.cat([_draw(probs, [gen]) for _ in range(20000)])
    freq = torch.bincount(draws, minlength=5).double() / len(draws)
    assert freq[1] == 0 and freq[4] == 0  # zero probability is never drawn, even at the edges
    torch.testing.assert_close(freq, probs[0].double(), atol=0.015, rtol=0)


def test_a_seeded_row_draws_the_same_token_whatever_shares_its_batch():
    from fairway.engine.sampler import _draw

    probs = torch.rand(3, 1000).softmax(dim=-1)
    alone = _draw(probs[1:2], [torch.Generator().manual_seed(42)])
    batched = _draw(probs, [torch.Generator().manual_seed(1), torch.Generator().manual_seed(42), None])
    assert batched[1] == alone[0]


native_sampler = cpu_kernels.temperature_sampler()
needs_native_sampler = pytest.mark.skipif(native_sampler is None, reason="no C compiler: PyTorch sampling only")


@needs_native_sampler
@pytest.mark.parametrize("temperature", [1.0, 0.5])
def test_native_sampler_draws_in_proportion_and_never_a_zero_probability_token(temperature):
    probs = torch.tensor([0.5, 0.0, 0.3, 0.2, 0.0])
    logits = probs.log().repeat(20000, 1)  # zero probability: -inf
    gen = torch.Generator().manual_seed(0)
    uniforms = torch.rand(20000, generator=gen, dtype=torch.float64)
    draws = native_sampler(logits, torch.full((20000,), temperature), uniforms)
    freq = torch.bincount(draws, minlength=5).double() / len(draws)
    want = (probs.log() / temperature).softmax(dim=-1).double()
    assert freq[1] == 0 and freq[4] == 0
    torch.testing.assert_close(freq, want, atol=0.015, rtol=0)


@needs_native_sampler
def test_native_sampler_agrees_with_the_pytorch_draw_and_survives_bad_rows():
    logits = torch.randn(6, 49152, generator=torch.Generator().manual_seed(1)) * 3
    uniforms = torch.rand(6, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    native = native_sampler(logits, torch.full((6,), 0.7), uniforms)
    # The same uniforms against PyTorch's softmax and float64 cumulative sum pick the same tokens
    # (a uniform within rounding of a boundary could pick the neighbour; these seeds don't).
    cdf = (logits / 0.7).softmax(-1).double().cumsum(-1)
    pytorch = torch.searchsorted(cdf, (uniforms * cdf[:, -1])[:, None], right=True).squeeze(1)
    assert native.tolist() == pytorch.tolist()
    nan_row = torch.full((1, 8), float("nan"))
    assert 0 <= native_sampler(nan_row, torch.ones(1), torch.tensor([0.5], dtype=torch.float64)).item() < 8
    with pytest.raises(RuntimeError, match="temperature"):
        native_sampler(logits[:1], torch.zeros(1), uniforms[:1])


def test_sample_routes_each_row_to_its_kind_and_keeps_the_order():
    from fairway.engine.sampler import sample

    logits = torch.full((4, 10), -30.0)
    for row, token in enumerate([3, 7, 1, 9]):
        logits[row, token] = 30.0  # each row certain of its token, whatever the sampler
    params = [SamplingParams(temperature=0), SamplingParams(temperature=0.8),
              SamplingParams(temperature=0.8, top_p=0.5), SamplingParams(temperature=1.2, top_k=3)]
    seqs = [Sequence(f"r{i}", [1], p) for i, p in enumerate(params)]
    assert sample(logits, seqs) == [3, 7, 1, 9]


def test_greedy_takes_the_first_of_tied_maxima_as_torch_does():
    from fairway.engine.sampler import sample

    torch.manual_seed(0)
    logits = torch.randn(5, 49152)
    logits[0, [7, 40000]] = 99.0  # a tie: the lower token id, as torch.argmax and every replica before
    logits[1] = float("-inf")
    logits[1, 123] = 0.0  # a grammar's mask leaves one token
    logits[2, 11] = float("nan")  # a broken row picks its NaN, as torch.argmax does
    seqs = [Sequence(f"r{i}", [1], SamplingParams(temperature=0)) for i in range(5)]
    expected = logits.argmax(dim=-1).tolist()
    assert expected[:3] == [7, 123, 11]
    assert sample(logits, seqs) == expected
    assert sample(logits[3:4], seqs[3:4]) == expected[3:4]  # one row, as a single stream samples


def test_in_passing_thread_returns_and_raises_like_a_call():
    from fairway.engine.factory import in_passing_thread

    assert in_passing_thread(lambda: threading.current_thread().name) == "fairway-load"
    with pytest.raises(ModelFileError):
        in_passing_thread(lambda: build_engine("/no/such/model.gguf"))
