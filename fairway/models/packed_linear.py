"""Linear layers with weights pre-packed for oneDNN on CPU.

A plain bf16 `F.linear` re-lays the weight out on every call; packing it once into oneDNN's
blocked format makes skinny decode matmuls ~1.5x and prefill ~1.2x faster on this class of CPU
(measured: 3072x576 bf16, M=1 400 -> 270 us, M=64 900 -> 680 us, M=512 5.6 -> 4.7 ms).
"""

from __future__ import annotations

import torch
from torch import nn

# oneDNN picks its blocking for this many rows; measured best for both M=1 and M=512 here.
_BATCH_HINT = 64


def packing_supported(dtype: torch.dtype, device: torch.device) -> bool:
    return (device.type == "cpu" and dtype == torch.bfloat16 and torch.backends.mkldnn.is_available()
            and torch.ops.mkldnn._is_mkldnn_bf16_supported())


class PackedLinear(nn.Module):
    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), _BATCH_HINT)
        self.register_buffer("packed", packed, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, None, "none", [], "")


def pack_linears(model: nn.Module) -> int:
    """Swap every bias-free nn.Linear in the model for a PackedLinear; returns how many."""
    swaps = [(parent, name, child) for parent in model.modules()
             for name, child in parent.named_children() if isinstance(child, nn.Linear) and child.bias is None]
    for parent, name, child in swaps:
        setattr(parent, name, PackedLinear(child.weight))
    return len(swaps)
