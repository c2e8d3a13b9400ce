"""Which dtype the matmuls run in, given the dtype the weights were asked for and the hardware.

A CPU without native bfloat16 (or float16) matrix instructions (no AVX512-BF16/AMX, e.g. an
AVX2-only machine) runs PyTorch's bf16 matmuls through an emulation several times slower than its
float32 ones (bench/README.md, engine_vs_hf.py). There the weights are still rounded to
the requested dtype (the model is numerically the bf16 model) but held and multiplied in float32,
as llama.cpp does for bf16 on such CPUs. Machines with the instructions keep bf16 throughout.
"""

from __future__ import annotations

import logging
from functools import cache

import torch

log = logging.getLogger(__name__)


@cache
def cpu_half_matmul_supported(dtype: torch.dtype) -> bool:
    """True when oneDNN has native kernels for this half dtype on this CPU."""
    if not torch.backends.mkldnn.is_available():
        return False
    if dtype == torch.bfloat16:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    if dtype == torch.float16:
        return bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())
    return False


def compute_dtype(weights: torch.dtype, device: torch.device | str) -> torch.dtype:
    """The dtype to hold and multiply weights in for weights rounded to `weights`."""
    if torch.device(device).type != "cpu" or weights == torch.float32:
        return weights
    if cpu_half_matmul_supported(weights):
        return weights
    log.info("%s matmuls are not accelerated on this CPU: computing in float32 with %s-rounded weights",
             weights, weights)
    return torch.float32
