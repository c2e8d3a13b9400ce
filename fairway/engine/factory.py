"""Build a ready engine from a model path (or the bundled model): weights, tokenizer, KV cache."""

from __future__ import annotations

from pathlib import Path

import torch

from fairway.engine.llm_engine import EngineConfig, LLMEngine
from fairway.models.bundled import bundled_model_path
from fairway.models.loader import load_model
from fairway.models.tokenizer import Tokenizer

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def load_tokenizer(path: Path) -> Tokenizer:
    return Tokenizer.from_hf_folder(path) if path.is_dir() else Tokenizer.from_gguf(path)


def build_engine(model: str | Path | None = None, dtype: str | torch.dtype = "bfloat16",
                 device: str = "cpu", config: EngineConfig | None = None) -> LLMEngine:
    path = Path(model) if model else bundled_model_path()
    torch_dtype = DTYPES[dtype] if isinstance(dtype, str) else dtype
    return LLMEngine(load_model(path, torch_dtype, device), config, tokenizer=load_tokenizer(path))
