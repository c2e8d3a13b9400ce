"""Guided decoding (vLLM's name): output held to a grammar by a token mask per step, from
llguidance (a well-kept structured-generation library: Rust, CPU, no torch.compile).

A request asks for it in SamplingParams.guided_decoding: {"json_schema": {...}}, {"json_object":
true} or {"lark": "..."} (a Lark grammar, which may embed JSON schemas: the tool-call grammar of
fairway/tools/grammar.py). Each grammar is compiled once per engine and cached (LRU); a sequence
gets a copy of the compiled matcher, advanced by every token it appends. The sampler masks the
logits of guided rows only, so the rest of the batch pays nothing.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from typing import Any

import numpy as np
import torch

CACHE_SIZE = 64  # compiled grammars kept per engine
# JSON as json.dumps writes it, no free whitespace: left free, a model may spend its tokens on
# newlines and spaces between the values.
JSON_FORMAT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class GuidedDecodingError(ValueError):
    """The grammar does not compile, or llguidance is not installed: the request is refused."""


def grammar_of(spec: dict[str, Any]) -> str:
    """The spec as llguidance's grammar text."""
    import llguidance

    if "json_schema" in spec:
        return llguidance.LLMatcher.grammar_from_json_schema(json.dumps(spec["json_schema"]), defaults=JSON_FORMAT)
    if spec.get("json_object"):
        return llguidance.LLMatcher.grammar_from_json_schema(json.dumps({"type": "object"}), defaults=JSON_FORMAT)
    if "lark" in spec:
        return llguidance.LLMatcher.grammar_from_lark(spec["lark"])
    raise GuidedDecodingError(f"unknown guided decoding {sorted(spec)}: use json_schema, json_object or lark")


class Guides:
    """One engine's compiled grammars, and the tokenizer llguidance matches them against."""

    def __init__(self, tokenizer: Any, vocab_size: int) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._lltokenizer: Any = None  # built on first use (~0.5 s): most engines never guide
        self._compiled: OrderedDict[str, Any] = OrderedDict()

    def matcher(self, spec: dict[str, Any]) -> Any:
        """A fresh matcher for the spec (a copy of the compiled one)."""
        key = json.dumps(spec, sort_keys=True)
        template = self._compiled.get(key)
        if template is None:
            template = self._compile(spec)
            self._compiled[key] = template
            if len(self._compiled) > CACHE_SIZE:
                self._compiled.popitem(last=False)
        else:
            self._compiled.move_to_end(key)
        return template.deep_copy()

    def _compile(self, spec: dict[str, Any]) -> Any:
        try:
            import llguidance
        except ImportError as exc:
            raise GuidedDecodingError("guided decoding needs llguidance (pip install llguidance)") from exc
        if self._lltokenizer is None:
            backend = getattr(self.tokenizer, "backend_json", None)
            if backend is None:
                raise GuidedDecodingError("this model's tokenizer cannot drive guided decoding")
            self._lltokenizer = llguidance.LLTokenizer(backend(), n_vocab=self.vocab_size,
                                                       eos_token=self.tokenizer.eos_token_id)
        try:
            matcher = llguidance.LLMatcher(self._lltokenizer, grammar_of(spec), log_level=0)
        except (ValueError, TypeError, RuntimeError) as exc:
            raise GuidedDecodingError(f"the grammar does not compile: {exc}") from None
        if matcher.is_error():
            raise GuidedDecodingError(f"the grammar does not compile: {matcher.get_error()}")
        return matcher

    @property
    def compiled(self) -> int:
        return len(self._compiled)


def mask_logits(logits: torch.Tensor, rows: list[int], matchers: list[Any]) -> None:
    """Each listed row's logits, in place, -inf wherever its matcher refuses the token."""
    vocab = logits.shape[-1]
    with torch.inference_mode():  # the model's logits are inference tensors: updated in place here only
        for row, matcher in zip(rows, matchers, strict=True):
            bits = np.unpackbits(np.frombuffer(matcher.compute_bitmask(), dtype=np.uint8), bitorder="little")
            refused = np.ones(vocab, dtype=bool)
            n = min(vocab, bits.size)
            refused[:n] = bits[:n] == 0
            logits[row].masked_fill_(torch.from_numpy(refused).to(logits.device), float("-inf"))
