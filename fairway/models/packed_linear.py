"""Linear layers with weights pre-packed once at load, for oneDNN or the native bf16 kernels, on CPU.

A plain `F.linear` re-lays the weight out (bf16) or goes through MKL's generic GEMM (float32) on
every call; packing it once into oneDNN's blocked format was faster at every batch size measured.

Where a CPU has AVX512-BF16, bf16 weights go instead to the native kernel (cpu_kernels.bf16_linear,
csrc/bf16_linear.c), packed into 16-column panels; it beat oneDNN at every row count, so the
layer keeps no oneDNN copy. A CPU with AMX is different: oneDNN multiplies bf16 on its tile units
and wins from a few dozen rows (prefill), while the few rows of a decode step go to the AMX
kernel (cpu_kernels.amx_linear, csrc/amx_linear.c, the same panels). There the layer keeps both
copies (twice the weight memory) and gives the AMX kernel up to AMX_KERNEL_MAX_ROWS rows, oneDNN
the rest; without the AMX kernel (a weight width not a multiple of 32) the AVX512-BF16 kernel
takes up to NATIVE_ROWS_WITH_AMX. The measurements behind the thresholds are in bench/README.md
("CPU kernels").
"""

from __future__ import annotations

import torch
from torch import nn

from fairway.models.cpu_kernels import SKINNY_MAX_ROWS, amx_linear, bf16_linear, skinny_linear
from fairway.models.precision import cpu_half_matmul_supported

# oneDNN picks its blocking for this many rows; measured best for both M=1 and M=512 here.
_BATCH_HINT = 64
# On an AMX CPU, the most rows the native kernel takes (crossover measured between 8 and 16) ...
NATIVE_ROWS_WITH_AMX = 8
# ... and the AMX kernel (even with oneDNN at 40-64 rows, which leads from there).
AMX_KERNEL_MAX_ROWS = 64
# Up to this many rows the bf16 copy (when there is one) beats the packed float32 weights: a few
# rows are bound by reading the weights, and the copy is half the bytes.
SKINNY_ROWS = SKINNY_MAX_ROWS


def amx_available() -> bool:
    """Whether oneDNN can multiply bf16 on AMX tiles here (Intel Sapphire Rapids and later)."""
    return bool(getattr(torch.cpu, "_is_amx_tile_supported", lambda: False)())


def packing_supported(dtype: torch.dtype, device: torch.device) -> bool:
    if device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    return dtype == torch.float32 or (dtype == torch.bfloat16 and cpu_half_matmul_supported(dtype))


class PackedLinear(nn.Module):
    """A bias-free linear layer on packed weights: native 16-column panels for bf16 weights on an
    AVX512-BF16 CPU, oneDNN's blocked format otherwise. Given `bf16_copy` (float32 weights that
    were rounded from bf16, on a CPU without bf16 matmuls), it also keeps them in bf16 for batches
    of a few rows, which are bound by reading the weights: half the bytes through the native kernel."""

    def __init__(self, weight: torch.Tensor, bf16_copy: bool = False) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.native, self.skinny = None, None
        self.native_max_rows: int | None = None  # None: the native kernel takes every row count
        kernel = bf16_linear() if weight.dtype == torch.bfloat16 else None
        if kernel is not None and kernel.supports(self.in_features):
            self.native = kernel
            self.register_buffer("panels", kernel.pack(weight), persistent=False)
            if amx_available():  # oneDNN on AMX wins above a few rows: keep its copy too
                amx = amx_linear()
                if amx is not None and amx.supports(self.in_features):
                    self.native, self.native_max_rows = amx, AMX_KERNEL_MAX_ROWS
                else:
                    self.native_max_rows = NATIVE_ROWS_WITH_AMX
                self._pack_for_onednn(weight, False)
        else:
            self._pack_for_onednn(weight, bf16_copy)

    def _pack_for_onednn(self, weight: torch.Tensor, bf16_copy: bool) -> None:
        packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), _BATCH_HINT)
        self.register_buffer("packed", packed, persistent=False)
        kernel = skinny_linear() if bf16_copy and weight.dtype == torch.float32 else None
        if kernel is not None and kernel.supports(1, self.in_features):
            self.skinny = kernel
            self.register_buffer("weight_bf16", weight.detach().to(torch.bfloat16).contiguous(), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.native is not None and (self.native_max_rows is None
                                        or x.numel() <= self.native_max_rows * self.in_features):
            return self.native(x, self.panels, self.out_features)
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
