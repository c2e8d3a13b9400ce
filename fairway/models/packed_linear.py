"""Linear layers with weights pre-packed for oneDNN on CPU.

A plain `F.linear` re-lays the weight out (bf16) or goes through MKL's generic GEMM (float32) on
every call; packing it once into oneDNN's blocked format is faster for every batch size measured.
bf16 on an AVX512-BF16 CPU, 3072x576: M=1 400 -> 270 us, M=64 900 -> 680 us, M=512 5.6 -> 4.7 ms.
float32 on an AVX2 CPU, 3072x576: M=16 2.4 -> 0.69 ms, M=64 4.3 -> 2.3 ms, M=512 20 -> 14 ms.
"""

from __future__ import annotations

import torch
from torch import nn

from fairway.models.cpu_kernels import SKINNY_MAX_ROWS, skinny_linear
from fairway.models.precision import cpu_half_matmul_supported

# oneDNN picks its blocking for this many rows; measured best for both M=1 and M=512 here.
_BATCH_HINT = 64
# Up to this many rows the bf16 copy (when there is one) beats the packed float32 weights: measured
# on 30 distinct 3072x576 weights (DRAM-bound, as in decode), 1 row 8.9 vs 20 ms, 8 rows 20 vs 26 ms.
SKINNY_ROWS = SKINNY_MAX_ROWS


def packing_supported(dtype: torch.dtype, device: torch.device) -> bool:
    if device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    return dtype == torch.float32 or (dtype == torch.bfloat16 and cpu_half_matmul_supported(dtype))


class PackedLinear(nn.Module):
    """A bias-free linear layer on packed weights. Given `bf16_copy` (float32 weights that were
    rounded from bf16, on a CPU without bf16 matmuls), it also keeps them in bf16 for batches of a
    few rows, which are bound by reading the weights: half the bytes through the native kernel."""

    def __init__(self, weight: torch.Tensor, bf16_copy: bool = False) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), _BATCH_HINT)
        self.register_buffer("packed", packed, persistent=False)
        self.skinny = None
        kernel = skinny_linear() if bf16_copy and weight.dtype == torch.float32 else None
        if kernel is not None and kernel.supports(1, self.in_features):
            self.skinny = kernel
            self.register_buffer("weight_bf16", weight.detach().to(torch.bfloat16).contiguous(), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.skinny is not None and x.dim() == 2 and x.shape[0] <= SKINNY_ROWS:
            return self.skinny(x.contiguous(), self.weight_bf16)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, None, "none", [], "")


def pack_linears(model: nn.Module, bf16_copy: bool = False) -> int:
    """Swap every bias-free nn.Linear in the model for a PackedLinear; returns how many."""
    swaps = [(parent, name, child) for parent in model.modules()
             for name, child in parent.named_children() if isinstance(child, nn.Linear) and child.bias is None]
    for parent, name, child in swaps:
        setattr(parent, name, PackedLinear(child.weight, bf16_copy))
    return len(swaps)
