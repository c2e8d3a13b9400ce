"""A step's decoder layers in one native call (csrc/decode_forward.c).

The layer-by-layer path (llama.py) calls ~9 kernels a layer from Python; at decode, with a few
rows, the interpreter, module calls, ctypes and allocations around them cost about as much as the
kernels (bench/README.md, "CPU kernels"). A step qualifies when every row is either a sequence's
new token read through the native attention kernel or a row of a prefill chunk, the model and its
cache are bf16 and every linear runs on one native kernel for this many rows: AMX or AVX512-BF16
on bf16 panels, or the quantized-weight kernel on GGUF blocks of one type (quant_linear.py); or
the model is float32 (a CPU without bf16 arithmetic), its cache float32 or bf16 (the bf16 model
run there), and the linears are GGUF blocks, which the quantized kernel takes with float32
activations. Prefill chunks attend through
a callback into the layer-by-layer path's own attention (paged_attention.attend_prefills), once a
layer. The C side calls the same kernels in
the same order, so hidden states are bit-identical to the layer-by-layer path; anything else
keeps that path.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from fairway.models.cpu_kernels import (
    AmxLinear,
    DecoderWeights,
    DecodeShape,
    PrefillAttention,
    decode_forward,
    layer_ops,
)
from fairway.models.packed_linear import PackedLinear
from fairway.models.paged_attention import AttentionMetadata, PagedKVCache, attend_prefills
from fairway.models.quant_linear import QuantLinear, step_rows


class NativeDecode:
    """Built once per model (see `for_model`); call it with a step's inputs, or ask `takes` first."""

    def __init__(self, model: torch.nn.Module, linears: list[torch.nn.Module],
                 pick: Callable[[torch.nn.Module], torch.nn.Module] = lambda linear: linear) -> None:
        """linears: pick(each of _linears(model)), each a PackedLinear with a native kernel or a
        QuantLinear (for_model checks); pick: the module whose weights a model's linear lends."""
        self.model = model
        self.dtype = model.embed_tokens.weight.dtype  # the activations' and norms' (the KV cache: this or bf16)
        self.kernel = decode_forward()
        first = linears[0]
        self.quant = first.qtype_id if isinstance(first, QuantLinear) else 0
        self.quant_linear = first if isinstance(first, QuantLinear) else None  # its path is every linear's
        self.amx = not self.quant and isinstance(first.native, AmxLinear)
        self.down_proj = pick(model.layers[0].mlp.down_proj)  # (its tile, for bf16 panels)
        limits = {getattr(lin, "native_max_rows", None) for lin in linears}
        self.max_rows = None if limits == {None} else min(r for r in limits if r is not None)
        # The weights' pointers, read once: the model's tensors stay where they are while it serves.
        self.layers = (DecoderWeights * len(model.layers))(*(
            DecoderWeights(layer.input_layernorm.weight.data_ptr(), pick(layer.self_attn.qkv_proj).panels.data_ptr(),
                           pick(layer.self_attn.o_proj).panels.data_ptr(),
                           layer.post_attention_layernorm.weight.data_ptr(),
                           pick(layer.mlp.gate_up_proj).panels.data_ptr(), pick(layer.mlp.down_proj).panels.data_ptr())
            for layer in model.layers))
        # Stored-block layers with bf16 copies (QuantLinear.keep_dense): steps of dense_from_rows
        # rows or more run the pass on the copies, as their layers do on the layer-by-layer path.
        self.dense: NativeDecode | None = None
        self.dense_from_rows = 0

    @staticmethod
    def for_model(model: torch.nn.Module) -> NativeDecode | None:
        """The native pass for this model, or None when its weights or this build don't allow one."""
        dtype = model.embed_tokens.weight.dtype
        if decode_forward() is None or layer_ops() is None or dtype not in (torch.bfloat16, torch.float32):
            return None
        linears = _linears(model)
        quantized = all(isinstance(lin, QuantLinear) for lin in linears)
        if quantized:
            if len({(lin.qtype_id, lin.isa) for lin in linears}) != 1:  # one type and path for every linear
                return None
            if dtype != torch.bfloat16 and any(lin.dense is not None for lin in linears):  # (copies are bf16 panels)
                return None
        elif dtype != torch.bfloat16 or not _one_native_kernel(linears):  # (bf16 panels take bf16 only)
            return None
        norms = [n.weight for layer in model.layers for n in (layer.input_layernorm, layer.post_attention_layernorm)]
        if not all(w.dtype == dtype and w.is_contiguous() for w in [*norms, model.norm.weight]):
            return None
        native = NativeDecode(model, linears)
        copies = [lin.dense for lin in linears] if quantized and dtype == torch.bfloat16 else []
        if copies and _one_native_kernel(copies) and len({lin.dense_from_rows for lin in linears}) == 1:
            native.dense = NativeDecode(model, copies, lambda linear: linear.dense)
            native.dense_from_rows = linears[0].dense_from_rows
        return native

    def _for(self, tokens: int) -> NativeDecode:
        """The pass a step of this many rows runs: on the bf16 copies from dense_from_rows (of
        the step's rows without its drafts, as each layer would choose: quant_linear.step_rows)."""
        return self.dense if self.dense is not None and step_rows(tokens) >= self.dense_from_rows else self

    def takes(self, tokens: int, kv: PagedKVCache, meta: AttentionMetadata) -> bool:
        prefill_rows = sum(pg.out_rows.shape[0] for pg in meta.prefills)
        max_rows = self._for(tokens).max_rows
        return (meta.backend is None and not meta.decodes and tokens > 0
                and _decode_rows(meta) + prefill_rows == tokens
                and (max_rows is None or tokens <= max_rows)
                and kv.k.dtype in (self.dtype, torch.bfloat16) and kv.k.is_contiguous() and kv.v.is_contiguous())

    def __call__(self, x: torch.Tensor, positions: torch.Tensor, kv: PagedKVCache,
                 meta: AttentionMetadata) -> torch.Tensor:
        """x: [T, hidden] embeddings of the step's tokens in the model's dtype (overwritten).
        Returns the final norm's output, as LlamaModel.forward does."""
        if (run := self._for(x.shape[0])) is not self:
            return run(x, positions, kv, meta)
        c, dt = self.model.cfg, meta.decode_tables
        tables, lens = (None, None) if dt is None else (dt.block_tables, dt.context_lens)
        tokens = x.shape[0]
        nv, mr, prefetch = (0, 0, 0) if self.amx or self.quant else self.down_proj.native.tile_for(tokens)
        rotary = self.model.rotary
        shape = DecodeShape(tokens, c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim, c.intermediate_size,
                            c.num_layers, c.rms_norm_eps, c.head_dim ** -0.5, kv.k.shape[2], kv.block_size,
                            0 if tables is None else tables.shape[1], rotary.cos.dtype == torch.bfloat16,
                            self.amx, nv, mr, prefetch, torch.get_num_threads(), self.quant,
                            self.quant_linear.path(tokens) if self.quant_linear is not None else 0,
                            _decode_rows(meta), self.dtype == torch.float32, kv.k.dtype == torch.bfloat16)
        return self.kernel(x.contiguous(), self.layers, self.model.norm.weight, shape, rotary.cos, rotary.sin,
                           positions, meta.slot_mapping, kv.k, kv.v, tables, lens,
                           self._prefill_attention(kv, meta) if meta.prefills else None)

    def _prefill_attention(self, kv: PagedKVCache, meta: AttentionMetadata) -> PrefillAttention:
        """The step's prefill groups attended to as llama.py's Attention does (its own head split
        and scale), from the pass's rotated qkv rows (their K/V already in the layer's cache) into
        its attention output rows."""
        c = self.model.cfg
        group = c.num_heads // c.num_kv_heads

        def attend(layer: int, qkv: torch.Tensor, attn: torch.Tensor) -> None:
            module = self.model.layers[layer].self_attn
            q, k, v = module.split_heads(qkv)
            attend_prefills(attn.view(-1, c.num_heads, c.head_dim), q, k, v, kv.k[layer], kv.v[layer],
                            meta.prefills, group, module.scale)

        return attend


def _one_native_kernel(linears: list[torch.nn.Module | None]) -> bool:
    """Every one a PackedLinear on a native kernel, the same kernel for all."""
    return (all(isinstance(lin, PackedLinear) and lin.native is not None for lin in linears)
            and len({type(lin.native) for lin in linears}) == 1)


def _decode_rows(meta: AttentionMetadata) -> int:
    """Rows read through the native decode attention (the step's first ones)."""
    return 0 if meta.decode_tables is None else meta.decode_tables.context_lens.shape[0]


def _linears(model: torch.nn.Module) -> list[torch.nn.Module]:
    return [lin for layer in model.layers
            for lin in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj)]
