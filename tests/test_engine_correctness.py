"""Greedy tokens of Fairway's engine equal transformers' on the real model, however the batch is formed."""

from __future__ import annotations

import pytest
import torch

from fairway.engine import EngineConfig, LLMEngine, SamplingParams

NEW_TOKENS = 32
QUESTIONS = [
    "What is the capital of France?",
    "Write a Python function that reverses a string.",
    "Explain photosynthesis to a ten year old.",
    "List three primary colors.",
    "Translate 'good morning' into Spanish and German.",
    "What is 17 times 23?",
    "Give me a haiku about autumn leaves.",
    "Why is the sky blue? Answer in two sentences.",
    "Name a famous physicist and one of their discoveries.",
    "Summarise the plot of Romeo and Juliet. " * 40,  # ~400 tokens: prefilled in chunks
]


@pytest.fixture(scope="module")
def prompts(real_tokenizer):
    out = [real_tokenizer.chat_prompt_ids([{"role": "user", "content": q}]) for q in QUESTIONS]
    assert len({len(p) for p in out}) > 5  # genuinely different lengths
    return out


def hf_greedy(hf_model, prompt: list[int], n: int = NEW_TOKENS) -> list[int]:
    """Plain greedy decoding with transformers' KV cache, no stop tokens."""
    with torch.no_grad():
        out = hf_model(torch.tensor([prompt]), use_cache=True)
        tokens = [int(out.logits[0, -1].argmax())]
        past = out.past_key_values
        for _ in range(n - 1):
            out = hf_model(torch.tensor([[tokens[-1]]]), past_key_values=past, use_cache=True)
            past = out.past_key_values
            tokens.append(int(out.logits[0, -1].argmax()))
    return tokens


def hf_greedy_from_guess(hf_model, prompt: list[int], guess: list[int], n: int = NEW_TOKENS) -> list[int]:
    """transformers' greedy n tokens after prompt, whatever the guess: one forward pass over prompt +
    guess gives transformers' greedy choice after each prefix of the guess, so its tokens are the
    guess's run that agrees with those choices plus the next choice, then plain decoding from there
    (a speculative verification, greedy). A right guess costs one pass instead of n steps that
    each read every weight."""
    guess = list(guess[:n - 1])
    with torch.no_grad():
        choices = hf_model(torch.tensor([prompt + guess])).logits[0, len(prompt) - 1:].argmax(-1).tolist()
    agree = next((i for i, (g, c) in enumerate(zip(guess, choices, strict=False)) if g != c), len(guess))
    tokens = choices[:agree + 1]
    return tokens + (hf_greedy(hf_model, prompt + tokens, n - len(tokens)) if len(tokens) < n else [])


@pytest.fixture(scope="module")
def reference(hf_model):
    """transformers' greedy tokens after a prompt, computed once per prompt, the engine's tokens as
    the guess: reference(prompt, engine_tokens)."""
    known: dict[tuple[int, ...], list[int]] = {}

    def greedy(prompt: list[int], guess: list[int]) -> list[int]:
        if tuple(prompt) not in known:
            known[tuple(prompt)] = hf_greedy_from_guess(hf_model, prompt, guess)
        return known[tuple(prompt)]

    return greedy


def expected(reference, prompts: list[list[int]], got: list[list[int]]) -> list[list[int]]:
    return [reference(p, g) for p, g in zip(prompts, got, strict=True)]


GREEDY = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)


def engine(model, **kw) -> LLMEngine:
    cfg = dict(num_kv_blocks=512, max_num_batched_tokens=256)
    cfg.update(kw)
    return LLMEngine(model, EngineConfig(**cfg))


def test_one_request_at_a_time(real_model_fp32, prompts, reference):
    # A sequence alone: the shortest and longest short prompts, and the long one prefilled in chunks
    # (every prompt is checked in a batch below; alone, each costs a step per token here).
    eng = engine(real_model_fp32, enable_prefix_caching=False)
    short = sorted(prompts[:-1], key=len)
    for p in (short[0], short[-1], prompts[-1]):
        got = eng.generate([p], GREEDY)[0]
        assert got == reference(p, got)


def test_all_together_in_one_batch(real_model_fp32, prompts, reference):
    eng = engine(real_model_fp32)
    got = eng.generate(prompts, GREEDY)
    assert got == expected(reference, prompts, got)
    assert eng.stats().kv_blocks_used == 0  # everything freed


def test_with_prefix_cache_hits(real_model_fp32, prompts, reference):
    eng = engine(real_model_fp32)
    # The chat template's system text fills the first block of every prompt: later prompts reuse it.
    first = eng.generate(prompts[:1], GREEDY)
    rest = eng.generate(prompts[1:], GREEDY)
    assert eng.stats().prefix_cache_hits >= 9 * 16
    assert first + rest == expected(reference, prompts, first + rest)
    hits = eng.stats().prefix_cache_hits
    again = eng.generate(prompts, GREEDY)  # now every prompt is cached but for its last block
    assert eng.stats().prefix_cache_hits - hits >= sum(len(p) - 16 for p in prompts)
    assert again == expected(reference, prompts, again)


def test_after_forced_preemption(real_model_fp32, prompts, reference):
    # Room for the prompts, but not for all of them to grow: the newest get preempted and recomputed.
    need = sum(-(-len(p) // 16) for p in prompts)
    eng = engine(real_model_fp32, num_kv_blocks=need + 6, reserve_blocks=1)
    got = eng.generate(prompts, GREEDY)
    assert eng.stats().num_preemptions > 0
    assert got == expected(reference, prompts, got)


def test_the_reference_is_plain_greedy_decoding_whatever_the_guess(hf_model, prompts):
    # The guess only saves transformers' steps: right, wrong from its third token, or none.
    prompt, n = prompts[0], 8
    plain = hf_greedy(hf_model, prompt, n)
    wrong = plain[:2] + [(t + 1) % 1000 for t in plain[2:]]
    for guess in (plain, wrong, []):
        assert hf_greedy_from_guess(hf_model, prompt, guess, n) == plain
