"""Llama-architecture transformer (RMSNorm, RoPE, grouped-query attention, SwiGLU) over a paged KV cache.

Weights arrive as a Hugging Face-named state dict; Q/K/V and gate/up are fused into one matmul
each at load time, because on CPU the number of kernel launches per layer matters.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from fairway.models.config import LlamaConfig
from fairway.models.cpu_kernels import layer_ops
from fairway.models.native_decode import NativeDecode
from fairway.models.paged_attention import AttentionMetadata, PagedKVCache, paged_attention, write_kv


class RMSNorm(nn.Module):
    """RMSNorm with the residual add folded in (as vLLM does): given a residual, it normalises
    x + residual and hands the sum back as the next residual, one native call on the CPU."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps
        self.native = layer_ops()

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (RMSNorm(x [+ residual]), x [+ residual])."""
        if self.native is not None and self.native.supports(x):
            return self.native.rms_norm(x.contiguous(), self.weight, self.eps,
                                        None if residual is None else residual.contiguous())
        if residual is not None:
            x = x + residual
        # Normalise in float32 as the reference implementation does, then cast back.
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype), x


class RotaryEmbedding(nn.Module):
    """cos/sin tables for every position (float32, or the model's dtype once it is cast)."""

    def __init__(self, head_dim: int, max_positions: int, theta: float) -> None:
        super().__init__()
        self.theta = theta
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin(), persistent=False)

    @property
    def positions(self) -> int:
        return self.cos.shape[0]

    def covering(self, positions: int) -> RotaryEmbedding:
        """These tables, or longer ones (same dtype and device) with at least `positions` rows: a
        window past the trained positions (LlamaConfig.window's override) is never read out of bounds."""
        if positions <= self.positions:
            return self
        longer = RotaryEmbedding(self.cos.shape[1], positions, self.theta)
        return longer.to(device=self.cos.device, dtype=self.cos.dtype)

    def batch(self, positions: torch.Tensor, dtype: torch.dtype, native: bool) -> RopeBatch:
        if native:  # the kernel reads the tables by position itself
            return RopeBatch(positions, self.cos, self.sin, native=True)
        return RopeBatch(positions, self.cos[positions].to(dtype)[:, None, :],
                         self.sin[positions].to(dtype)[:, None, :], native=False)


@dataclass
class RopeBatch:
    """One step's rotary inputs: the native kernel takes the whole tables and the positions; the
    portable path takes cos/sin already gathered per token ([T, 1, D])."""

    positions: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor
    native: bool


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class Attention(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.qkv_proj = nn.Linear(cfg.hidden_size, cfg.q_size + 2 * cfg.kv_size, bias=False)
        self.o_proj = nn.Linear(cfg.q_size, cfg.hidden_size, bias=False)
        self.scale = cfg.head_dim ** -0.5
        self.native = layer_ops()

    def forward(self, x: torch.Tensor, rope: RopeBatch, k_cache: torch.Tensor, v_cache: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        c = self.cfg
        qkv = self.qkv_proj(x)
        if rope.native:  # rotate in place and write the cache in one call
            self.native.rope_store(qkv, c.num_heads, c.num_kv_heads, rope.cos, rope.sin, rope.positions,
                                   meta.slot_mapping, k_cache, v_cache)
            q, k, v = self.split_heads(qkv)
        else:
            # Q and K sit side by side: rotate them in one go (each op costs microseconds at decode).
            qk = apply_rotary(qkv[:, :c.q_size + c.kv_size].view(-1, c.num_heads + c.num_kv_heads, c.head_dim),
                              rope.cos, rope.sin)
            q, k = qk.split([c.num_heads, c.num_kv_heads], dim=1)
            v = qkv[:, c.q_size + c.kv_size:].reshape(-1, c.num_kv_heads, c.head_dim)
            if meta.backend is not None:
                meta.backend.write_kv(k, v, k_cache, v_cache)
            else:
                write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        out = paged_attention(q, k, v, k_cache, v_cache, meta, self.scale)
        return self.o_proj(out.view(-1, c.q_size))

    def split_heads(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q [T, Hq, D], k and v [T, Hkv, D]: views of the rows of qkv_proj's output (rotated in place
        by the native RoPE kernel, or the native decode pass's scratch of the same layout)."""
        c = self.cfg
        heads = qkv.view(-1, c.num_heads + 2 * c.num_kv_heads, c.head_dim)
        return heads.split([c.num_heads, c.num_kv_heads, c.num_kv_heads], dim=1)


class MLP(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)
        self.native = layer_ops()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if self.native is not None and self.native.supports(gate_up):
            return self.down_proj(self.native.silu_mul(gate_up.contiguous()))
        gate, up = gate_up.chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, rope: RopeBatch, k_cache: torch.Tensor,
                v_cache: torch.Tensor, meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """x: the previous layer's output, not yet added to the residual stream (the next norm adds
        it). Returns this layer's output and the residual stream."""
        h, residual = self.input_layernorm(x, residual)
        h = self.self_attn(h, rope, k_cache, v_cache, meta)
        h, residual = self.post_attention_layernorm(h, residual)
        return self.mlp(h), residual


class LlamaModel(nn.Module):
    def __init__(self, cfg: LlamaConfig, rotary: RotaryEmbedding | None = None) -> None:
        """rotary: the tables, made elsewhere (a model built on the meta device to be loaded gets
        real ones: computed there they would be empty, and meta ops import torch._dynamo)."""
        super().__init__()
        self.cfg = cfg
        # Its weights are always written after (loaded, or drawn by random_model): no random init,
        # whose normal_ on the meta device imports torch._dynamo, the slowest part of a load.
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size,
                                         _weight=torch.empty(cfg.vocab_size, cfg.hidden_size))
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary = rotary or RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        # The KV cache's dtype when it differs from the weights' (bf16 weights held in float32 on a
        # CPU without bf16 matmuls keep a bf16 cache: half the bytes for decode attention to read).
        self.kv_cache_dtype: torch.dtype | None = None
        self.native = layer_ops()
        # The whole-step native decode pass, once the weights are final (see use_native_decode).
        self.native_decode: NativeDecode | None = None

    def use_native_decode(self) -> bool:
        """Run qualifying decode steps in one native call from now on (after the loader packed the
        weights; nothing may move them afterwards). Returns whether this model and build allow it."""
        self.native_decode = NativeDecode.for_model(self)
        return self.native_decode is not None

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv: PagedKVCache,
                meta: AttentionMetadata) -> torch.Tensor:
        """input_ids, positions: [T]. Returns final hidden states [T, hidden]."""
        x = self.embed_tokens(input_ids)
        if self.native_decode is not None and self.native_decode.takes(x.shape[0], kv, meta):
            return self.native_decode(x, positions, kv, meta)
        # A backend stores K/V itself (the native RoPE kernel would store them too).
        native = (meta.backend is None and self.native is not None and self.native.supports(x)
                  and kv.k.dtype in self.native.DTYPES)
        rope = self.rotary.batch(positions, x.dtype, native)
        residual = None
        for i, layer in enumerate(self.layers):
            x, residual = layer(x, residual, rope, kv.k[i], kv.v[i], meta)
        return self.norm(x, residual)[0]

    def num_parameters(self) -> int:
        """Weights counted from the shape (packed linears hold theirs as buffers), tied embedding once."""
        c = self.cfg
        per_layer = (c.hidden_size * (c.q_size + 2 * c.kv_size) + c.q_size * c.hidden_size
                     + 3 * c.hidden_size * c.intermediate_size + 2 * c.hidden_size)
        head = 0 if c.tie_word_embeddings else c.vocab_size * c.hidden_size
        return c.num_layers * per_layer + c.vocab_size * c.hidden_size + c.hidden_size + head

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()

    def load_hf_state_dict(self, sd: dict[str, torch.Tensor]) -> None:
        """Load Hugging Face Llama names (model.layers.N.self_attn.q_proj.weight, ...), fusing as we go."""
        own = self.state_dict()
        fused: dict[str, torch.Tensor] = {}
        for i in range(self.cfg.num_layers):
            p = f"model.layers.{i}."
            fused[f"layers.{i}.self_attn.qkv_proj.weight"] = torch.cat(
                [sd[p + f"self_attn.{n}_proj.weight"] for n in ("q", "k", "v")])
            fused[f"layers.{i}.self_attn.o_proj.weight"] = sd[p + "self_attn.o_proj.weight"]
            fused[f"layers.{i}.mlp.gate_up_proj.weight"] = torch.cat(
                [sd[p + "mlp.gate_proj.weight"], sd[p + "mlp.up_proj.weight"]])
            fused[f"layers.{i}.mlp.down_proj.weight"] = sd[p + "mlp.down_proj.weight"]
            fused[f"layers.{i}.input_layernorm.weight"] = sd[p + "input_layernorm.weight"]
            fused[f"layers.{i}.post_attention_layernorm.weight"] = sd[p + "post_attention_layernorm.weight"]
        fused["embed_tokens.weight"] = sd["model.embed_tokens.weight"]
        fused["norm.weight"] = sd["model.norm.weight"]
        if not self.cfg.tie_word_embeddings:
            fused["lm_head.weight"] = sd["lm_head.weight"]
        missing = set(own) - set(fused) - ({"lm_head.weight"} if self.cfg.tie_word_embeddings else set())
        if missing:
            raise ValueError(f"weights missing for: {sorted(missing)[:5]}")
        with torch.no_grad():
            for name, tensor in fused.items():
                own[name].copy_(tensor)


def random_model(cfg: LlamaConfig, seed: int = 0, dtype: torch.dtype = torch.float32,
                 device: str | torch.device = "cpu") -> LlamaModel:
    """Random weights of a given shape: for engine-mechanics tests and shape-only benchmarks."""
    gen = torch.Generator().manual_seed(seed)
    model = LlamaModel(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.fill_(1.0)
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.2)
    return model.to(device=device, dtype=dtype).eval()


def truncated(model: LlamaModel, num_layers: int) -> LlamaModel:
    """The model's first num_layers decoder layers under its own embedding, final norm and head, all
    shared (no copy): a draft model of the same tokenizer for speculative decoding."""
    if not 0 < num_layers < model.cfg.num_layers:
        raise ValueError(f"a truncated draft needs 1..{model.cfg.num_layers - 1} layers, got {num_layers}")
    cfg = dataclasses.replace(model.cfg, num_layers=num_layers)
    with torch.device("meta"):
        draft = LlamaModel(cfg, model.rotary)
    draft.embed_tokens, draft.norm, draft.lm_head = model.embed_tokens, model.norm, model.lm_head
    draft.layers = nn.ModuleList(model.layers[:num_layers])
    draft.kv_cache_dtype = model.kv_cache_dtype
    if model.native_decode is not None:
        draft.use_native_decode()
    return draft.eval()
