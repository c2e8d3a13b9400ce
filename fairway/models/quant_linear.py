"""Linear layers whose weights stay GGUF Q8_0, Q4_0 or Q4_1 blocks, multiplied by native kernels.

A decode step reads every weight once, so its time is the bytes it reads: 4.5-5 bits a weight
(Q4_0/Q4_1) or 8.5 (Q8_0) instead of bf16's 16. The kernels (cpu_kernels.quant_kernels,
csrc/quant_linear.c) unpack the blocks in registers; the activations keep the model's dtype
(--dtype), the sums are float32. Here the blocks are only reordered, once at load, into panels of 16
output columns (the layout is in quant_linear.c), the same bytes as in the file.
"""

from __future__ import annotations

from contextvars import ContextVar

import numpy as np
import torch
from torch import nn

from fairway.models.cpu_kernels import QuantKernels, bf16_linear, quant_kernels
from fairway.models.packed_linear import PackedLinear

QK = 32  # values per ggml block
PANEL = 16  # output columns per panel
# bytes of one ggml block of each type: fp16 scale (+ fp16 min, Q4_1) and the values
BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34}
# A step of many rows is bound by its products, not by reading the weights, and where a CPU's
# stored-block products cost more than its bf16 ones (each block's scales, 4-bit codes unpacked
# for every few rows), a bf16 copy of the weights serves such steps faster: from DENSE_FROM_ROWS
# rows, where this CPU has a native bf16 kernel and no AMX (bench/quant.py measures the
# crossover). A fixed count, not one timed at load: which weights a step uses changes its greedy
# tokens, and a reply must not change from one start to the next with how busy the machine was
# while it loaded. From 12 rows: one sequence's speculative verification (1 + 8 draft rows) keeps
# the stored blocks' sums, as its decode row alone does.
DENSE_FROM_ROWS = 12
# The rows of the step being computed, its draft rows left out (the engine's model runner sets
# it): what decides between the stored blocks and a bf16 copy, so that a speculative
# verification's rows are computed as the step without its drafts would compute them, and
# speculation never changes a greedy reply. Unset: the rows a layer is given.
STEP_ROWS: ContextVar[int | None] = ContextVar("fairway_step_rows", default=None)


# Steps of up to this many rows (step_rows: drafts left out) multiply bf16 activations by integer
# dot products where this CPU has AVX512-VNNI (csrc/quant_vnni.c): at one and two rows they beat
# the AMX and VDPBF16PS paths, from three they cost more (bench/README.md, "Integer products").
# Chosen by the step's rows, as the bf16 copies are, so a speculative verification's rows are
# computed as its decode rows alone would be.
VNNI_ROWS = 2


def step_rows(rows: int) -> int:
    """The rows that pick a step's weights (STEP_ROWS, else these)."""
    step = STEP_ROWS.get()
    return rows if step is None else step


def native_types(dtype: torch.dtype) -> frozenset[str]:
    """The GGUF types this CPU multiplies as stored with activations of this dtype (none without
    the kernels, or without a path for the dtype: an AVX2-only CPU has float32's alone)."""
    kernel = quant_kernels()
    return frozenset(BLOCK_BYTES) if kernel is not None and kernel.isa_for(dtype) else frozenset()


def unpack_blocks(raw: np.ndarray, qtype: str) -> tuple[np.ndarray, np.ndarray | None, np.ndarray]:
    """ggml blocks [n, k/32 * block bytes] (uint8) -> (d [n, nb] fp16, m [n, nb] fp16 or None,
    values [n, nb, 32]: int8 for Q8_0, the 4-bit codes 0..15 for Q4_0/Q4_1)."""
    n = raw.shape[0]
    blocks = np.ascontiguousarray(raw).reshape(n, -1, BLOCK_BYTES[qtype])
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0]
    if qtype == "Q8_0":
        return d, None, blocks[..., 2:].view(np.int8)
    m = blocks[..., 2:4].copy().view(np.float16)[..., 0] if qtype == "Q4_1" else None
    qs = blocks[..., 4:] if qtype == "Q4_1" else blocks[..., 2:]
    return d, m, np.concatenate([qs & 0x0F, qs >> 4], axis=-1)  # ggml: value j low nibble, j + 16 high


def pack_blocks(raw: np.ndarray, qtype: str) -> torch.Tensor:
    """ggml blocks of a weight [n, k] -> the kernels' panels: [ceil(n/16), k/32, block bytes * 16]
    uint8, 64-byte aligned, per block [16 scales][16 mins, Q4_1][the 16 columns' values] (layout in
    quant_linear.c)."""
    d, m, q = unpack_blocks(raw, qtype)
    n, nb = d.shape
    panels = -(-n // PANEL)
    pad = panels * PANEL - n  # missing columns: scale 0, min 0, value 0
    if pad:
        d = np.concatenate([d, np.zeros((pad, nb), np.float16)])
        m = None if m is None else np.concatenate([m, np.zeros((pad, nb), np.float16)])
        q = np.concatenate([q, np.full((pad, nb, QK), 8 if qtype == "Q4_0" else 0, q.dtype)])
    parts = [_by_panel(d), *(() if m is None else (_by_panel(m),))]
    q = q.reshape(panels, PANEL, nb, QK).transpose(0, 2, 1, 3)  # [panel, block, column, k]
    if qtype == "Q8_0":  # k-pairs: byte 2c + o is column c at 2g + o
        values = q.reshape(panels, nb, PANEL, 16, 2).transpose(0, 1, 3, 2, 4).view(np.uint8)
    else:  # 4 groups of 64 bytes: group h's word 2c + o holds column c at 8h + 2i + o in nibble i
        nibbles = q.reshape(panels, nb, PANEL, 4, 4, 2).transpose(0, 1, 3, 2, 5, 4).astype(np.uint16)
        words = nibbles[..., 0] | nibbles[..., 1] << 4 | nibbles[..., 2] << 8 | nibbles[..., 3] << 12
        values = words.astype("<u2").view(np.uint8)
    parts.append(np.ascontiguousarray(values).reshape(panels, nb, -1))
    joined = np.concatenate(parts, axis=-1)
    # torch's allocator aligns to 64 bytes (numpy's to 16): the kernels' 64-byte loads then stay
    # within one cache line
    out = torch.empty(joined.shape, dtype=torch.uint8)
    out.numpy()[...] = joined
    return out


def _by_panel(scales: np.ndarray) -> np.ndarray:
    """[n, nb] fp16 -> [panels, nb, 32 bytes]: each block's 16 columns side by side."""
    n, nb = scales.shape
    return scales.reshape(n // PANEL, PANEL, nb).transpose(0, 2, 1).copy().view(np.uint8).reshape(n // PANEL, nb, -1)


class QuantLinear(nn.Module):
    """A bias-free linear layer on a GGUF-quantized weight [out_features, in_features], given as
    its ggml blocks (one row of blocks per output feature)."""

    def __init__(self, panels: torch.Tensor, qtype: str, out_features: int, in_features: int,
                 dtype: torch.dtype) -> None:
        """panels: the weight's blocks as pack_blocks lays them out (from_blocks packs them)."""
        super().__init__()
        kernel = quant_kernels()
        isa = kernel.isa_for(dtype) if kernel is not None else 0
        if kernel is None or not isa or qtype not in BLOCK_BYTES or in_features % QK:
            raise ValueError(f"no native kernel for {qtype} weights of width {in_features} and {dtype} activations here")
        expected = (-(-out_features // PANEL), in_features // QK, BLOCK_BYTES[qtype] * PANEL)
        if tuple(panels.shape) != expected or panels.dtype != torch.uint8:
            raise ValueError(f"panels of shape {tuple(panels.shape)} ({panels.dtype}) for a {qtype} weight "
                             f"[{out_features}, {in_features}]: expected {expected} uint8")
        self.kernel: QuantKernels = kernel
        self.qtype, self.qtype_id = qtype, QuantKernels.TYPES[qtype]
        self.out_features, self.in_features = out_features, in_features
        self.isa = isa
        self.register_buffer("panels", panels, persistent=False)
        # A bf16 copy of the weight for steps of dense_from_rows rows or more (keep_dense), or None.
        self.dense: PackedLinear | None = None
        self.dense_from_rows = 0

    @classmethod
    def from_blocks(cls, raw: np.ndarray, qtype: str, in_features: int, dtype: torch.dtype) -> QuantLinear:
        """A layer on a weight's ggml blocks [out_features, bytes of a row of blocks]."""
        return cls(pack_blocks(raw, qtype), qtype, raw.shape[0], in_features, dtype)

    @property
    def weight_bytes(self) -> int:
        """Bytes one pass reads: the blocks as stored."""
        return self.out_features * self.in_features // QK * BLOCK_BYTES[self.qtype]

    def keep_dense(self, dense: PackedLinear, from_rows: int) -> None:
        """Multiply steps of from_rows rows or more (step_rows) by dense, the weight dequantized
        (its outputs are then the dequantized model's)."""
        self.dense, self.dense_from_rows = dense, from_rows

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 2:
            return self(x.reshape(-1, x.shape[-1])).view(*x.shape[:-1], self.out_features)
        if self.dense is not None and step_rows(x.shape[0]) >= self.dense_from_rows:
            return self.dense(x)
        return self.stored(x)

    def stored(self, x: torch.Tensor) -> torch.Tensor:
        """x [rows, in_features] by the blocks as stored, whatever the rows."""
        return self.kernel(x.contiguous(), self.panels, self.out_features, self.qtype_id, self.path(x.shape[0]))

    def path(self, rows: int) -> int:
        """The kernel path a step of these rows takes (step_rows): integer products for steps of up
        to VNNI_ROWS where this CPU has them and the activations are bf16, else self.isa."""
        bf16 = self.isa in (QuantKernels.AMX, QuantKernels.AVX512_BF16)
        if bf16 and self.kernel.isas & QuantKernels.VNNI and step_rows(rows) <= VNNI_ROWS:
            return QuantKernels.VNNI
        return self.isa


def dense_from_rows(linear: QuantLinear) -> int | None:
    """The rows from which a step would multiply a bf16 copy of linear's weight rather than the
    stored blocks: DENSE_FROM_ROWS where the copy would run on the native bf16 kernel and the blocks
    do not run on AMX tiles, which sum many rows as fast as bf16 does; else None (oneDNN's bf16 is
    no faster than the blocks at any row count measured). Decided before a copy is made, so none is
    packed to be thrown away."""
    kernel = bf16_linear()
    if kernel is None or not kernel.supports(linear.in_features) or linear.isa == QuantKernels.AMX:
        return None
    return DENSE_FROM_ROWS
