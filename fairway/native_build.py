"""Building Fairway's C sources with the system compiler, once per source, compiler and key.

The model's kernels (fairway/models/cpu_kernels.py), the relay's dispatcher
(fairway/redis_client/dispatch.py) and the gateway's token writer (fairway/gateway/token_writer.py)
are compiled on first use and kept under the Fairway cache directory, named by a hash of
everything that changes the binary, so a later start loads them at once.
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
import shutil
import subprocess
import sysconfig
import tempfile
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType

from fairway.cache_dir import cache_dir

log = logging.getLogger(__name__)

HEADERS = Path(__file__).parent / "csrc"  # the headers Fairway's extensions share


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


def native_extensions_enabled() -> bool:
    """FAIRWAY_NATIVE_RELAY=0 turns the streaming path's C extensions off (their Python twins run)."""
    return os.environ.get("FAIRWAY_NATIVE_RELAY", "1") != "0"


def load_extension(name: str, source: Path) -> ModuleType | None:
    """The CPython extension module `name` built from source (with the shared headers), or None
    (turned off, no compiler, or a failed build: the caller uses its Python twin)."""
    if not native_extensions_enabled():
        return None
    include = sysconfig.get_paths()["include"]
    suffix = sysconfig.get_config_var("EXT_SUFFIX") or ".so"
    headers = [header.read_text() for header in sorted(HEADERS.glob("*.h"))]
    try:
        path = build_cached(name, [source], ["-O2", "-fPIC", "-shared", "-std=c11", f"-I{include}", f"-I{HEADERS}"],
                            [suffix, include, *headers], suffix=suffix)
        spec = importlib.util.spec_from_file_location(name, path)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    except (OSError, ImportError, subprocess.CalledProcessError) as exc:
        detail = getattr(exc, "stderr", "") or str(exc)
        log.warning("%s was not built (%s): using its Python twin", name, detail[:500])
        return None
