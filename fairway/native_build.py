"""Building Fairway's C sources with the system compiler, once per source, compiler and key.

The model's kernels (fairway/models/cpu_kernels.py) and the relay's per-event path
(fairway/relay/live_fast.py) are compiled on first use and kept under the Fairway cache directory,
named by a hash of everything that changes the binary, so a later start loads them at once.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import tempfile
from collections.abc import Sequence
from pathlib import Path

from fairway.cache_dir import cache_dir


def compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def build_cached(name: str, sources: Sequence[Path], flags: Sequence[str], key: Sequence[str] = (),
                 suffix: str = ".so", libs: Sequence[str] = ()) -> Path:
    """The shared object built from sources with flags (and key: whatever else changes it, such
    as the CPU it targets). Raises FileNotFoundError without a compiler and CalledProcessError
    (with the compiler's output) when the build fails."""
    cc = compiler()
    if cc is None:
        raise FileNotFoundError("no C compiler (set CC, or install cc)")
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, check=True).stdout
    digest = hashlib.sha256("\0".join([*(src.read_text() for src in sources), " ".join(flags), version,
                                       *key]).encode()).hexdigest()[:16]
    target = cache_dir() / "kernels" / f"{name}-{digest}{suffix}"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        out = Path(tmp) / target.name
        subprocess.run([cc, *flags, *map(str, sources), "-o", str(out), *libs], capture_output=True, text=True,
                       check=True)
        os.replace(out, target)  # atomic: concurrent builders each produce the same file
    return target
