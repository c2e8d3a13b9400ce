"""Shared fixtures: the real bundled model (loaded once per session) and a tiny random one."""

from __future__ import annotations

import pytest
import torch

from fairway.models.bundled import bundled_model_path
from fairway.models.config import LlamaConfig
from fairway.models.llama import random_model


@pytest.fixture(scope="session")
def model_path():
    return bundled_model_path()


@pytest.fixture(scope="session")
def real_tokenizer(model_path):
    from fairway.models.tokenizer import Tokenizer

    return Tokenizer.from_gguf(model_path)


@pytest.fixture(scope="session")
def real_model_fp32(model_path):
    from fairway.models.loader import load_model

    return load_model(model_path, torch.float32)


@pytest.fixture(scope="session")
def hf_model(model_path):
    """transformers' own Llama on the same GGUF: the reference for greedy tokens."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(model_path.parent), gguf_file=model_path.name,
                                                dtype=torch.float32).eval()


@pytest.fixture
def tiny_model():
    return random_model(LlamaConfig.tiny())
