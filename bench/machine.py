"""What machine a benchmark ran on, for its results file.

Sessions land on different CPUs (Zen 4, Zen 5, Sapphire Rapids with AMX, Intel without it), and
the model's figures differ by 2x between them, so every result names the CPU precisely: the
model name alone ("AMD EPYC") does not tell Zen 4 from Zen 5, the family and model numbers do.
"""

from __future__ import annotations

import os
import platform
from pathlib import Path

# The instruction sets the model kernels choose between (fairway/models/cpu_kernels.py).
KERNEL_FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_tile")


def cpu_info() -> dict[str, str]:
    """The first processor's fields in /proc/cpuinfo (empty where there is none)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return {}
    fields: dict[str, str] = {}
    for line in text.split("\n\n", 1)[0].splitlines():
        key, _, value = line.partition(":")
        fields[key.strip()] = value.strip()
    return fields


def describe() -> dict[str, object]:
    info = cpu_info()
    flags = set(info.get("flags", "").split())
    return {
        "cpus": os.cpu_count(),
        "cpu_model": info.get("model name", platform.processor()),
        "cpu_vendor": info.get("vendor_id", ""),
        "cpu_family_model": f"{info.get('cpu family', '?')}/{info.get('model', '?')}",
        "kernel_flags": [f for f in KERNEL_FLAGS if f in flags],
        "platform": platform.platform(),
        "python": platform.python_version(),
    }


if __name__ == "__main__":
    print(describe())
