"""Shape of a Llama-architecture model, read from GGUF metadata or a Hugging Face config.json."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

# vLLM's VLLM_ALLOW_LONG_MAX_MODEL_LEN: a window past the model's trained positions, asked for knowingly.
ALLOW_LONG_MAX_MODEL_LEN = "FAIRWAY_ALLOW_LONG_MAX_MODEL_LEN"


@dataclass(frozen=True)
class LlamaConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = True

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def window(self, requested: int | None, option: str = "max_model_len") -> int:
        """The context window: requested, else the model's. A window past the positions the model
        was trained on (its RoPE table's size) is a ValueError unless ALLOW_LONG_MAX_MODEL_LEN=1:
        past them the table was read out of its bounds, and the replies were garbage."""
        trained = self.max_position_embeddings
        if requested is None:
            return trained
        if requested > trained and os.environ.get(ALLOW_LONG_MAX_MODEL_LEN) != "1":
            raise ValueError(f"{option} {requested} is longer than the model's context length of {trained} tokens "
                             f"(its trained positions, the size of its RoPE table): use at most {trained}, or set "
                             f"{ALLOW_LONG_MAX_MODEL_LEN}=1 to run past it, with replies likely garbage there")
        return requested

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> LlamaConfig:
        heads = cfg["num_attention_heads"]
        # Newer transformers write rope settings under rope_parameters; older ones at the top level.
        rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
        if rope.get("rope_type", "default") not in ("default", None):
            raise ValueError(f"rope scaling {rope.get('rope_type')!r} is not supported yet")
        theta = rope.get("rope_theta", cfg.get("rope_theta", 10000.0))
        return cls(
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads", heads),
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            rope_theta=float(theta),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-5)),
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        )

    @classmethod
    def tiny(cls, vocab_size: int = 256) -> LlamaConfig:
        """A few-layer random model for tests of engine mechanics (not of correctness)."""
        return cls(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_layers=2,
                   num_heads=4, num_kv_heads=2, head_dim=16, max_position_embeddings=4096)
