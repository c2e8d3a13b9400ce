"""Fairway's cache folder: dequantized weights, stored blocks laid out for the kernels and built
tokenizers (the models), compiled C sources (native_build), kept so a later start is fast. A
bottom module: both sides import it."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """FAIRWAY_CACHE_DIR, else ~/.cache/fairway; created on first use."""
    path = Path(os.environ.get("FAIRWAY_CACHE_DIR") or Path.home() / ".cache" / "fairway")
    path.mkdir(parents=True, exist_ok=True)
    return path
