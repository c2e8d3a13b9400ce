"""Build a ready engine from a model path (or the bundled model): weights, tokenizer, KV cache."""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import torch

from fairway.engine.device import GIB, DeviceError, check_device
from fairway.engine.llm_engine import EngineConfig, LLMEngine
from fairway.models.bundled import bundled_model_path
from fairway.models.loader import load_model
from fairway.models.tokenizer import Tokenizer

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def load_tokenizer(path: Path) -> Tokenizer:
    return Tokenizer.from_hf_folder(path) if path.is_dir() else Tokenizer.from_gguf(path)


T = TypeVar("T")


def in_passing_thread(fn: Callable[[], T]) -> T:
    """fn() in a thread that ends when it returns.

    OpenMP (PyTorch's libgomp) keeps a pool of worker threads for every thread that ever ran a
    parallel region, and once the pooled threads outnumber the CPUs it stops spin-waiting between
    regions, so every op of the engine thread pays a futex wake-up: loading in the main thread and
    stepping in the engine thread slowed every decode step (bench/README.md, engine_vs_hf.py). A
    thread that ends takes its pool with it, leaving the engine thread's as the only one. (An
    engine stepped in the thread that loaded it, as `fairway generate` and the benchmark do,
    needs none of this.)"""
    result: list[T] = []
    errors: list[BaseException] = []

    def run() -> None:
        try:
            result.append(fn())
        except BaseException as exc:  # re-raised in the caller
            errors.append(exc)

    thread = threading.Thread(target=run, name="fairway-load")
    thread.start()
    thread.join()
    if errors:
        raise errors[0]
    return result[0]


def build_engine(model: str | Path | None = None, dtype: str | torch.dtype = "bfloat16",
                 device: str = "cpu", config: EngineConfig | None = None, weights: str = "auto") -> LLMEngine:
    """weights: "native" runs a GGUF's quantized layers as stored where a kernel exists (dtype is then
    the activations' and the KV cache's), "auto" the same with a bf16 copy for steps of many rows
    where this CPU multiplies that faster (models/loader.py), "dequantized" rounds every weight to
    dtype at load."""
    dev = check_device(device)  # DeviceError: one line, before any weights load
    path = Path(model) if model else bundled_model_path()
    torch_dtype = DTYPES[dtype] if isinstance(dtype, str) else dtype
    try:
        loaded = load_model(path, torch_dtype, dev, weights=weights)
    except torch.OutOfMemoryError:
        if dev.type != "cuda":
            raise
        free, total = torch.cuda.mem_get_info(dev)
        raise DeviceError(f"the weights of {path.name} in {torch_dtype} do not fit on {torch.cuda.get_device_name(dev)} "
                          f"({total / GIB:.2f} GiB, {free / GIB:.2f} GiB free): use a smaller model or dtype") from None
    return LLMEngine(loaded, config, tokenizer=load_tokenizer(path))
