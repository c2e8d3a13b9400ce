"""Guided decoding in the engine, with the real bundled model: output held to a JSON Schema, to
any JSON object, and to one tool call of a named tool (the Lark grammar of fairway/tools/grammar.py);
the mask touches only the guided rows of a batch; each grammar is compiled once.

Temperature 1 with a seed, on purpose: left to itself the model writes anything, so every output
that parses and fits is the mask's doing."""

from __future__ import annotations

import json

import jsonschema
import pytest
import torch

from fairway.engine import EngineConfig, LLMEngine, SamplingParams
from fairway.engine.guided_decoding import GuidedDecodingError
from fairway.tools import parse_tools
from fairway.tools.grammar import call_grammar
from fairway.tools.parser import CallParser

pytest.importorskip("llguidance")
pytestmark = pytest.mark.slow

CITY = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24},
                                         "population": {"type": "integer", "minimum": 0}},
        "required": ["city", "population"], "additionalProperties": False}
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 24},
                                     "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"], "additionalProperties": False}}}


@pytest.fixture(scope="module")
def engine(real_tokenizer):
    from fairway.models.bundled import bundled_model_path
    from fairway.models.loader import load_model

    model = load_model(bundled_model_path(), torch.bfloat16)
    return LLMEngine(model, EngineConfig(num_kv_blocks=256, bound_step_time=False), tokenizer=real_tokenizer)


def _prompt(tokenizer, text: str) -> list[int]:
    return tokenizer.chat_prompt_ids([{"role": "user", "content": text}])


def _text(engine, out: list[int]) -> str:
    return engine.tokenizer.decode([t for t in out if t not in engine.tokenizer.stop_token_ids])


def test_json_schema_and_json_object(engine):
    prompt = _prompt(engine.tokenizer, "Tell me about a big city.")
    outs = engine.generate([prompt] * 3, [
        SamplingParams(temperature=1.0, seed=seed, max_tokens=80, guided_decoding={"json_schema": CITY})
        for seed in (1, 2)] + [SamplingParams(temperature=1.0, seed=3, max_tokens=80,
                                              guided_decoding={"json_object": True})])
    for out in outs[:2]:
        value = json.loads(_text(engine, out))
        jsonschema.validate(value, CITY)
        assert out[-1] in engine.tokenizer.stop_token_ids  # it ends when the grammar does
    assert isinstance(json.loads(_text(engine, outs[2])), dict)
    assert engine.guides.compiled == 2  # the schema once (two requests), json_object once


def test_a_named_tool_call(engine):
    tools = parse_tools([WEATHER], {"type": "function", "function": {"name": "get_weather"}})
    grammar = call_grammar(tools)
    prompt = _prompt(engine.tokenizer, "Is it cold outside?")
    for seed in (4, 5):
        (out,) = engine.generate([prompt], SamplingParams(temperature=1.0, seed=seed, max_tokens=80,
                                                         guided_decoding={"lark": grammar}))
        released, calls = CallParser().feed(_text(engine, out))
        assert released == "" and len(calls) == 1 and calls[0].error is None
        assert calls[0].name == "get_weather"
        jsonschema.validate(json.loads(calls[0].arguments), WEATHER["function"]["parameters"])


def test_the_mask_touches_only_the_guided_rows(engine):
    prompt = _prompt(engine.tokenizer, "Name three rivers.")
    free = SamplingParams(temperature=0, max_tokens=24)
    (alone,) = engine.generate([prompt], free)
    together = engine.generate([prompt, prompt], [free, SamplingParams(temperature=0, max_tokens=24,
                                                                       guided_decoding={"json_schema": CITY})])
    assert together[0] == alone
    assert together[1] != alone


def test_a_grammar_that_does_not_compile_is_refused(engine):
    with pytest.raises(GuidedDecodingError):
        engine.add_request("bad-grammar", [1, 2, 3], SamplingParams(guided_decoding={"lark": "start: nope"}))
    assert "bad-grammar" not in engine.requests
