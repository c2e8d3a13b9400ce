"""Where dequantized weights and built tokenizers are kept so later loads are fast."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """FAIRWAY_CACHE_DIR, else ~/.cache/fairway; created on first use."""
    path = Path(os.environ.get("FAIRWAY_CACHE_DIR") or Path.home() / ".cache" / "fairway")
    path.mkdir(parents=True, exist_ok=True)
    return path
