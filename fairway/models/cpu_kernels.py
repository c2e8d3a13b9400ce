"""Native CPU kernels: built from fairway/models/csrc/ with the system C compiler on first use.

Six things portable PyTorch does badly on a CPU:
  * decode attention over a paged cache (paged_decode.c): PyTorch must first gather every
    context into a padded copy;
  * bf16 matmuls on a CPU with AVX512-BF16 (bf16_linear.c, VDPBF16PS on weights packed at load):
    at decode sizes oneDNN's bf16 GEMM is far from both the DRAM and the arithmetic bound. Without
    AVX512-BF16 it compiles to a stub that says so, and the bf16 layers keep oneDNN;
  * the same on a CPU with AMX (amx_linear.c, TDPBF16PS on the same packed weights) for the few
    dozen rows of a decode step, where oneDNN's AMX GEMM spends its time in per-call setup;
  * a matmul of a few rows with bf16 weights on a CPU without bf16 instructions
    (skinny_linear.c): PyTorch's emulation runs at a fraction of the memory bandwidth that
    bounds it;
  * the small ops of a decoder layer on a few rows (layer_ops.c: residual add + RMSNorm, SiLU
    gating, RoPE + the KV cache write), where PyTorch's per-op overhead dwarfs the arithmetic;
  * temperature sampling over a large vocabulary (sample.c): one pass per row instead of ~8 ops.
  * matmuls on weights kept as GGUF Q8_0/Q4_0/Q4_1 blocks (quant_linear.c, unpacked in registers;
    quant_vnni.c, integer dot products for a step of one or two sequences): reading 4-8 bits a weight
    instead of 16 is what bounds a decode step.
And one thing the interpreter does badly: calling those kernels ~9 times a layer at decode
(decode_forward.c runs a bf16 or float32 decode step's layers in one call; fairway/models/native_decode.py).
The measurements behind these choices are in bench/README.md ("CPU kernels").

The build takes a few seconds and is cached per source, compiler and CPU under the Fairway cache
directory; a machine without a compiler, or FAIRWAY_NATIVE_KERNELS=0, keeps the portable
PyTorch paths (same results, slower). PyTorch ships libgomp under the same soname,
so the loader reuses the copy already in the process: one OpenMP thread pool, not two.
"""

from __future__ import annotations

import ctypes
import logging
import os
import platform
import subprocess
from collections.abc import Callable
from functools import cache
from pathlib import Path
from typing import TypeVar

import torch

from fairway.native_build import build_cached, compiler

log = logging.getLogger(__name__)

_SOURCES = [Path(__file__).parent / "csrc" / name
            for name in ("paged_decode.c", "skinny_linear.c", "layer_ops.c", "bf16_linear.c", "amx_linear.c", "sample.c",
                         "decode_forward.c", "quant_linear.c",
                         "quant_amx.c", "quant_vnni.c")]
_FLAGS = ["-O3", "-march=native", "-ffast-math", "-fopenmp", "-fPIC", "-shared", "-std=c11"]
# The C side's fixed limits.
MAX_GROUP, MAX_HEAD_DIM, MAX_BLOCK = 16, 256, 64
SKINNY_MAX_ROWS = 8


def native_enabled() -> bool:
    return os.environ.get("FAIRWAY_NATIVE_KERNELS", "1") != "0"


@cache
def _intel() -> bool:
    try:
        return "GenuineIntel" in Path("/proc/cpuinfo").read_text()
    except OSError:
        return False


def _cpu_signature() -> str:
    """The compiled code is -march=native: tie the cache entry to this CPU's model and flags."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor()
    lines = [ln for ln in info.splitlines() if ln.startswith(("model name", "flags"))]
    return "\n".join(sorted(set(lines)))


class DecodeKernels:
    """ctypes binding of paged_decode.c. Supported (query, cache) dtypes: (bf16, bf16),
    (float32, float32), and (float32, bf16) for float32 compute over a bf16 cache."""

    PAIRS = {(torch.bfloat16, torch.bfloat16), (torch.float32, torch.float32), (torch.float32, torch.bfloat16)}

    def __init__(self, lib: ctypes.CDLL) -> None:
        fn = lib.paged_decode_attention
        fn.argtypes = ([ctypes.c_void_p] * 6 + [ctypes.c_int] * 4
                       + [ctypes.c_int64, ctypes.c_int, ctypes.c_int, ctypes.c_float] + [ctypes.c_int] * 3)
        fn.restype = ctypes.c_int
        self._fn = fn

    def supports(self, q_dtype: torch.dtype, kv_dtype: torch.dtype, group: int, head_dim: int,
                 block_size: int) -> bool:
        return ((q_dtype, kv_dtype) in self.PAIRS and group <= MAX_GROUP and head_dim <= MAX_HEAD_DIM
                and head_dim % 8 == 0 and block_size <= MAX_BLOCK)

    def decode_attention(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                         block_tables: torch.Tensor, context_lens: torch.Tensor, block_size: int,
                         scale: float) -> torch.Tensor:
        """q: [n, Hq, D]; caches: [Hkv, slots, D]; block_tables: int32 [n, max_blocks];
        context_lens: int32 [n]. Returns [n, Hq, D] in q's dtype."""
        n, hq, d = q.shape
        hkv, slots, _ = k_cache.shape
        q = q.contiguous()
        assert k_cache.is_contiguous() and v_cache.is_contiguous() and k_cache.dtype == v_cache.dtype
        assert block_tables.dtype == torch.int32 and context_lens.dtype == torch.int32
        out = torch.empty_like(q)
        rc = self._fn(q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), block_tables.data_ptr(),
                      context_lens.data_ptr(), out.data_ptr(), n, hkv, hq // hkv, d, slots, block_size,
                      block_tables.shape[1], scale, q.dtype == torch.bfloat16, k_cache.dtype == torch.bfloat16,
                      torch.get_num_threads())
        if rc != 0:
            raise RuntimeError(f"paged decode kernel: unsupported shape or dtypes ({q.dtype}, {k_cache.dtype})")
        return out


class SkinnyLinear:
    """ctypes binding of skinny_linear.c: y = x @ w.T for up to SKINNY_MAX_ROWS rows of float32 x
    and bf16 w."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        fn = lib.linear_bf16_weights
        fn.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int] * 4
        fn.restype = ctypes.c_int
        self._fn = fn

    def supports(self, rows: int, in_features: int) -> bool:
        return 1 <= rows <= SKINNY_MAX_ROWS and in_features % 8 == 0

    def __call__(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        m, k = x.shape
        assert x.dtype == torch.float32 and x.is_contiguous() and weight.dtype == torch.bfloat16
        assert weight.is_contiguous() and weight.shape[1] == k
        y = torch.empty(m, weight.shape[0], dtype=torch.float32)
        if self._fn(x.data_ptr(), weight.data_ptr(), y.data_ptr(), m, weight.shape[0], k,
                    torch.get_num_threads()) != 0:
            raise RuntimeError(f"skinny linear kernel: unsupported shape {tuple(x.shape)} x {tuple(weight.shape)}")
        return y


class Bf16Linear:
    """ctypes binding of bf16_linear.c: y = x @ w.T in bf16 on AVX512-BF16, with w packed once by
    pack() into panels of PANEL output columns, each [k/2][PANEL][2] (the VDPBF16PS operand)."""

    PANEL = 16

    def __init__(self, lib: ctypes.CDLL) -> None:
        fn = lib.bf16_linear
        fn.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int] * 7
        fn.restype = ctypes.c_int
        self._fn = fn
        self.available = bool(lib.bf16_linear_available())

    def supports(self, in_features: int) -> bool:
        return self.available and in_features >= 2 and in_features % 2 == 0

    def pack(self, weight: torch.Tensor) -> torch.Tensor:
        """[n, k] bf16 -> [ceil(n/16), k/2, 16, 2]: column j's k-pair q at [j // 16, q, j % 16]."""
        n, k = weight.shape
        panels = -(-n // self.PANEL)
        padded = weight.detach().to(torch.bfloat16)
        if n % self.PANEL:  # the last panel's missing columns are zeros
            padded = torch.cat([padded, padded.new_zeros(panels * self.PANEL - n, k)])
        return padded.reshape(panels, self.PANEL, k // 2, 2).transpose(1, 2).contiguous()

    @staticmethod
    def tile_for(rows: int) -> tuple[int, int, bool]:
        """(panels, rows, prefetch) of a tile for this many rows, the fastest measured on the model's
        linears (bench/README.md, "CPU kernels"). Up to 3 rows the weights are only streamed, one
        panel a tile, which the hardware prefetcher follows best there; an Intel core does better
        with 2x12 tiles that prefetch. From 4 rows the arithmetic counts and the next panels are
        prefetched while the current ones are multiplied; up to 14 rows fit one 2-panel tile, past
        that 4x4 tiles lead."""
        if rows <= 3:
            return (2, 12, True) if _intel() else (1, 16, False)
        if rows <= 14:
            return 2, 14, True
        return 4, 4, True

    def __call__(self, x: torch.Tensor, panels: torch.Tensor, out_features: int,
                 tile: tuple[int, int, bool] | None = None) -> torch.Tensor:
        """x: [..., k] bf16; panels: pack()'s output for a [out_features, k] weight. Returns
        [..., out_features] bf16. `tile` overrides tile_for() (the tests reach every tile so).
        Lean on purpose: it runs 121 times a decode step, where each microsecond here is 0.1 ms."""
        if x.dim() != 2:
            flat = self(x.reshape(-1, x.shape[-1]), panels, out_features, tile)
            return flat.view(*x.shape[:-1], out_features)
        rows, k = x.shape
        if x.dtype != torch.bfloat16 or panels.dtype != torch.bfloat16 or panels.shape[1] * 2 != k:
            raise ValueError(f"bf16 linear: x {tuple(x.shape)} {x.dtype} for panels {tuple(panels.shape)}")
        if not x.is_contiguous() or x.data_ptr() % 4:  # the kernel reads x as aligned 32-bit pairs
            x = x.clone(memory_format=torch.contiguous_format)
        y = torch.empty(rows, out_features, dtype=torch.bfloat16)
        if rows:
            self._multiply(x, panels, y, tile)
        return y

    def _multiply(self, x: torch.Tensor, panels: torch.Tensor, y: torch.Tensor,
                  tile: tuple[int, int, bool] | None) -> None:
        (rows, k), out_features = x.shape, y.shape[1]
        nv, mr, prefetch = tile or self.tile_for(rows)
        if self._fn(x.data_ptr(), panels.data_ptr(), y.data_ptr(), rows, out_features, k, nv, mr, prefetch,
                    torch.get_num_threads()) != 0:
            raise RuntimeError(f"bf16 linear kernel: unsupported shape {tuple(x.shape)} or tile {nv}x{mr}")


class AmxLinear(Bf16Linear):
    """ctypes binding of amx_linear.c: Bf16Linear's product on AMX tiles, over the same panels
    (pack() and the call are Bf16Linear's; a tile means nothing here); in_features a multiple of 32."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        fn = lib.amx_linear
        fn.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int] * 4
        fn.restype = ctypes.c_int
        self._fn = fn
        self.available = bool(lib.amx_linear_available())  # (asks Linux for the tile state)

    def supports(self, in_features: int) -> bool:
        return self.available and in_features >= 32 and in_features % 32 == 0

    def _multiply(self, x: torch.Tensor, panels: torch.Tensor, y: torch.Tensor,
                  tile: tuple[int, int, bool] | None) -> None:
        (rows, k), out_features = x.shape, y.shape[1]
        if self._fn(x.data_ptr(), panels.data_ptr(), y.data_ptr(), rows, out_features, k,
                    torch.get_num_threads()) != 0:
            raise RuntimeError(f"AMX linear kernel: unsupported shape {tuple(x.shape)}, or out of memory")


class QuantKernels:
    """ctypes binding of quant_linear.c: y = x @ w.T for w in GGUF Q8_0/Q4_0/Q4_1 blocks repacked
    into 16-column panels (fairway/models/quant_linear.py), x float32 or bf16."""

    # ggml's type ids, the C side's too
    TYPES = {"Q4_0": 2, "Q4_1": 3, "Q8_0": 8}
    # quant_isas() bits: AVX2 + FMA, AVX512F/BW, AVX512-BF16, AMX (bf16 activations; Q8_0's one
    # and two rows go to AVX512F), AVX512-VNNI (bf16 activations as integers: QuantLinear.path)
    AVX2, AVX512, AVX512_BF16, AMX, VNNI = 1, 2, 4, 8, 16

    def __init__(self, lib: ctypes.CDLL) -> None:
        fn = lib.quant_linear
        fn.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int] * 7
        fn.restype = ctypes.c_int
        self._fn = fn
        self.isas = int(lib.quant_isas())

    def isa_for(self, dtype: torch.dtype) -> int:
        """The fastest path this CPU offers for activations of this dtype, or 0 for none. float32
        activations stay float32 (FMA). bf16 ones: AMX where there is some (Q8_0's one and two
        rows still on FMA); on an Intel core otherwise widened to float32 for FMA on two ports, which beat
        VDPBF16PS there (bench/README.md, "Quantized weights"); on an AMD core VDPBF16PS."""
        if dtype not in (torch.float32, torch.bfloat16):
            return 0
        if dtype == torch.bfloat16:
            if self.isas & self.AMX:
                return self.AMX
            if self.isas & self.AVX512_BF16 and not _intel():
                return self.AVX512_BF16
        if self.isas & self.AVX512:
            return self.AVX512
        return self.AVX2 if dtype == torch.float32 and self.isas & self.AVX2 else 0

    def __call__(self, x: torch.Tensor, panels: torch.Tensor, out_features: int, qtype: int,
                 isa: int) -> torch.Tensor:
        """x: [rows, k] float32 or bf16, contiguous. Returns [rows, out_features] in x's dtype."""
        rows, k = x.shape
        y = torch.empty(rows, out_features, dtype=x.dtype)
        if rows and self._fn(x.data_ptr(), panels.data_ptr(), y.data_ptr(), rows, out_features, k, qtype,
                             x.dtype == torch.bfloat16, isa, torch.get_num_threads()) != 0:
            raise RuntimeError(f"quant linear kernel: unsupported x {tuple(x.shape)} {x.dtype}, type {qtype}, "
                               f"path {isa}")
        return y


class DecoderWeights(ctypes.Structure):
    """decode_forward.c's decoder_weights: one layer's norms and packed linears."""

    _fields_ = [(name, ctypes.c_void_p) for name in ("input_norm", "qkv", "o", "post_norm", "gate_up", "down")]


class DecodeShape(ctypes.Structure):
    """decode_forward.c's decode_shape."""

    _fields_ = ([(name, ctypes.c_int) for name in ("tokens", "hidden", "heads_q", "heads_kv", "head_dim", "inter",
                                                    "num_layers")]
                + [("eps", ctypes.c_float), ("scale", ctypes.c_float), ("cache_slots", ctypes.c_int64)]
                + [(name, ctypes.c_int) for name in ("block_size", "max_blocks", "table_bf16", "amx", "nv", "mr",
                                                      "prefetch", "num_threads", "quant", "isa", "decode_tokens", "f32",
                                                      "cache_bf16")])


# decode_forward.c's prefill_attention_fn: called with a layer's index.
_PREFILL_ATTENTION = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_int)
_NO_PREFILL_ATTENTION = _PREFILL_ATTENTION()  # NULL: a step without prefill rows
# (layer, qkv [tokens, (heads_q + 2 heads_kv) * head_dim], attn [tokens, heads_q * head_dim]): writes
# the prefill rows of attn from qkv, both views of the pass's scratch (in the pass's dtype).
PrefillAttention = Callable[[int, torch.Tensor, torch.Tensor], None]


class DecodeForward:
    """ctypes binding of decode_forward.c: every decoder layer of a decode step in one call.
    The caller (fairway/models/native_decode.py) holds the weights' pointers and the shapes."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        fn = lib.decode_forward
        fn.argtypes = ([ctypes.c_void_p] * 3 + [ctypes.c_void_p, ctypes.POINTER(DecodeShape)] + [ctypes.c_void_p] * 9
                       + [_PREFILL_ATTENTION])
        fn.restype = ctypes.c_int
        scratch = lib.decode_forward_scratch
        scratch.argtypes = [ctypes.POINTER(DecodeShape)]
        scratch.restype = ctypes.c_int64
        self._fn, self._scratch = fn, scratch

    def __call__(self, x: torch.Tensor, layers: ctypes.Array, final_norm: torch.Tensor, shape: DecodeShape,
                 cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
                 k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor | None,
                 context_lens: torch.Tensor | None, prefill_attention: PrefillAttention | None = None) -> torch.Tensor:
        """x: [tokens, hidden] embeddings, bf16 (float32 with shape.f32), overwritten. Returns the
        final norm's output. The first shape.decode_tokens rows attend through block_tables;
        prefill_attention attends for the others, layer by layer."""
        out = torch.empty_like(x)
        scratch = torch.empty(self._scratch(ctypes.byref(shape)), dtype=x.dtype)
        failures: list[BaseException] = []
        callback = _NO_PREFILL_ATTENTION if prefill_attention is None else _PREFILL_ATTENTION(
            _scratch_callback(prefill_attention, scratch, shape, failures))
        rc = self._fn(x.data_ptr(), out.data_ptr(), ctypes.addressof(layers), final_norm.data_ptr(),
                      ctypes.byref(shape), cos.data_ptr(), sin.data_ptr(), positions.data_ptr(), slots.data_ptr(),
                      k_cache.data_ptr(), v_cache.data_ptr(), _ptr(block_tables), _ptr(context_lens),
                      scratch.data_ptr(), callback)
        if failures:  # the callback's own error, not the code it returned for it
            raise failures[0]
        if rc != 0:
            raise RuntimeError(f"decode_forward kernel failed (rc {rc})")
        return out


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def _scratch_callback(attend: PrefillAttention, scratch: torch.Tensor, s: DecodeShape,
                      failures: list[BaseException]) -> Callable[[int], int]:
    """attend, called with views of the qkv and attn buffers in decode_forward.c's scratch (its
    layout: residual and h [tokens, hidden] each, then qkv, then q and attn [tokens, q width]). An
    exception cannot cross the C frames: it is kept for the caller and the pass stops."""
    t = s.tokens
    q_width, qkv_width = s.heads_q * s.head_dim, (s.heads_q + 2 * s.heads_kv) * s.head_dim
    at = 2 * t * s.hidden
    qkv = scratch[at:at + t * qkv_width].view(t, qkv_width)
    at += t * (qkv_width + q_width)
    attn = scratch[at:at + t * q_width].view(t, q_width)

    def call(layer: int) -> int:
        try:
            attend(layer, qkv, attn)
        except BaseException as exc:  # noqa: BLE001 (re-raised by the caller)
            failures.append(exc)
            return 1
        return 0

    return call


class LayerOps:
    """ctypes binding of layer_ops.c: float32 or bf16 tensors on the CPU, contiguous."""

    DTYPES = (torch.float32, torch.bfloat16)

    def __init__(self, lib: ctypes.CDLL) -> None:
        norm = lib.rms_norm
        norm.argtypes = [ctypes.c_void_p] * 5 + [ctypes.c_int] * 2 + [ctypes.c_float] + [ctypes.c_int] * 2
        silu = lib.silu_mul
        silu.argtypes = [ctypes.c_void_p] * 2 + [ctypes.c_int] * 4
        rope = lib.rope_store
        rope.argtypes = ([ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int]
                         + [ctypes.c_void_p] * 6 + [ctypes.c_int64] + [ctypes.c_int] * 4)
        for fn in (norm, silu, rope):
            fn.restype = ctypes.c_int
        self._norm, self._silu, self._rope = norm, silu, rope

    def supports(self, x: torch.Tensor) -> bool:
        return x.device.type == "cpu" and x.dtype in self.DTYPES and x.dim() == 2

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float,
                 residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """RMSNorm(x), or with a residual RMSNorm(x + residual). Returns (normed, the sum or x)."""
        _check(x, weight, *(() if residual is None else (residual,)))
        out = torch.empty_like(x)
        total = x if residual is None else torch.empty_like(x)
        rc = self._norm(x.data_ptr(), None if residual is None else residual.data_ptr(), weight.data_ptr(),
                        out.data_ptr(), total.data_ptr(), x.shape[0], x.shape[1], eps,
                        x.dtype == torch.bfloat16, torch.get_num_threads())
        if rc != 0:
            raise RuntimeError(f"rms_norm kernel: unsupported shape {tuple(x.shape)}")
        return out, total

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up for gate_up = [gate | up] along the last dim."""
        _check(gate_up)
        rows, width = gate_up.shape
        out = torch.empty(rows, width // 2, dtype=gate_up.dtype)
        if self._silu(gate_up.data_ptr(), out.data_ptr(), rows, width // 2, gate_up.dtype == torch.bfloat16,
                      torch.get_num_threads()) != 0:
            raise RuntimeError(f"silu_mul kernel: unsupported shape {tuple(gate_up.shape)}")
        return out

    def rope_store(self, qkv: torch.Tensor, heads_q: int, heads_kv: int, cos: torch.Tensor, sin: torch.Tensor,
                   positions: torch.Tensor, slots: torch.Tensor, k_cache: torch.Tensor,
                   v_cache: torch.Tensor) -> None:
        """Rotate the Q and K heads of qkv [T, (Hq + 2 Hkv) * D] in place and write K and V at
        `slots` of the caches [Hkv, slots, D]. cos/sin: [positions, D] tables, float32 or bf16."""
        _check(qkv)
        assert cos.dtype == sin.dtype and cos.dtype in self.DTYPES and cos.is_contiguous() and sin.is_contiguous()
        assert positions.dtype == slots.dtype == torch.int64 and k_cache.dtype == v_cache.dtype
        assert k_cache.is_contiguous() and v_cache.is_contiguous() and k_cache.dtype in self.DTYPES
        head_dim = k_cache.shape[2]
        assert qkv.shape[1] == (heads_q + 2 * heads_kv) * head_dim and cos.shape[1] == head_dim
        rc = self._rope(qkv.data_ptr(), qkv.shape[0], heads_q, heads_kv, head_dim, cos.data_ptr(), sin.data_ptr(),
                        positions.data_ptr(), slots.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(),
                        k_cache.shape[1], qkv.dtype == torch.bfloat16, cos.dtype == torch.bfloat16,
                        k_cache.dtype == torch.bfloat16, torch.get_num_threads())
        if rc != 0:
            raise RuntimeError(f"rope_store kernel: bad shape or slot (rc {rc})")


class TemperatureSampler:
    """ctypes binding of sample.c: one token per row of float32 logits, by inverse CDF against the
    row's own uniform draw."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        fn = lib.sample_temperature
        fn.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int] + [ctypes.c_void_p] * 3 + [ctypes.c_int]
        fn.restype = ctypes.c_int
        self._fn = fn

    def __call__(self, logits: torch.Tensor, temperatures: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
        """logits: [rows, vocab] float32; temperatures: [rows] float32 > 0; uniforms: [rows] float64."""
        assert logits.dtype == torch.float32 and logits.is_contiguous() and logits.device.type == "cpu"
        assert temperatures.dtype == torch.float32 and uniforms.dtype == torch.float64
        rows, vocab = logits.shape
        out = torch.empty(rows, dtype=torch.int64)
        if self._fn(logits.data_ptr(), rows, vocab, temperatures.data_ptr(), uniforms.data_ptr(), out.data_ptr(),
                    torch.get_num_threads()) != 0:
            raise RuntimeError("sample kernel: a temperature <= 0, or out of memory")
        return out


def _check(*tensors: torch.Tensor) -> None:
    first = tensors[0]
    for t in tensors:
        assert t.device.type == "cpu" and t.dtype == first.dtype and t.dtype in LayerOps.DTYPES and t.is_contiguous()


Binding = TypeVar("Binding", DecodeKernels, SkinnyLinear, Bf16Linear, AmxLinear, LayerOps, TemperatureSampler,
                  DecodeForward, QuantKernels)


def decode_kernels() -> DecodeKernels | None:
    """The decode attention kernel, or None when FAIRWAY_NATIVE_KERNELS=0 or it can't be built here."""
    return _bound(DecodeKernels) if native_enabled() else None


def skinny_linear() -> SkinnyLinear | None:
    """The few-row bf16-weight matmul, or None when FAIRWAY_NATIVE_KERNELS=0 or it can't be built."""
    return _bound(SkinnyLinear) if native_enabled() else None


def bf16_linear() -> Bf16Linear | None:
    """The AVX512-BF16 matmul, or None when FAIRWAY_NATIVE_KERNELS=0, it can't be built, or this CPU
    lacks AVX512-BF16 (the bf16 layers then use oneDNN)."""
    kernel = _bound(Bf16Linear) if native_enabled() else None
    return kernel if kernel is not None and kernel.available else None


def amx_linear() -> AmxLinear | None:
    """The AMX matmul, or None when FAIRWAY_NATIVE_KERNELS=0, it can't be built, or this CPU (or
    its kernel) offers no AMX tiles."""
    kernel = _bound(AmxLinear) if native_enabled() else None
    return kernel if kernel is not None and kernel.available else None


def quant_kernels() -> QuantKernels | None:
    """The quantized-weight matmuls, or None when FAIRWAY_NATIVE_KERNELS=0, they can't be built, or
    this CPU has none of their paths (the loader then dequantizes)."""
    kernel = _bound(QuantKernels) if native_enabled() else None
    return kernel if kernel is not None and kernel.isas else None


def decode_forward() -> DecodeForward | None:
    """The whole-step decode pass, or None when FAIRWAY_NATIVE_KERNELS=0 or it can't be built."""
    return _bound(DecodeForward) if native_enabled() else None


def temperature_sampler() -> TemperatureSampler | None:
    """The temperature sampler, or None when FAIRWAY_NATIVE_KERNELS=0 or it can't be built."""
    return _bound(TemperatureSampler) if native_enabled() else None


def layer_ops() -> LayerOps | None:
    """A decoder layer's small ops, or None when FAIRWAY_NATIVE_KERNELS=0 or they can't be built."""
    return _bound(LayerOps) if native_enabled() else None


@cache
def _bound(kind: type[Binding]) -> Binding | None:
    """One binding per kernel for the process (every norm and linear layer shares it)."""
    lib = _library()
    return kind(lib) if lib is not None else None


@cache
def _library() -> ctypes.CDLL | None:
    if compiler() is None:
        log.warning("no C compiler found: the portable PyTorch paths are used")
        return None
    try:
        return ctypes.CDLL(str(build_cached("fairway_kernels", _SOURCES, _FLAGS, [_cpu_signature(), torch.__version__],
                                            libs=["-lm"])))
    except (OSError, subprocess.CalledProcessError) as exc:
        detail = getattr(exc, "stderr", "") or str(exc)
        log.warning("native kernels not built (%s): using the portable PyTorch paths", detail[:500])
        return None
