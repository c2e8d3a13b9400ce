"""Llama-architecture transformer (RMSNorm, RoPE, grouped-query attention, SwiGLU) over a paged KV cache.

Weights arrive as a Hugging Face-named state dict; Q/K/V and gate/up are fused into one matmul
each at load time, because on CPU the number of kernel launches per layer matters.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from fairway.models.config import LlamaConfig
from fairway.models.cpu_kernels import rms_norm
from fairway.models.paged_attention import AttentionMetadata, PagedKVCache, paged_attention


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps
        self.native = rms_norm()  # float32 on CPU: one call instead of six ops (decode is op-bound)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32 and x.device.type == "cpu" and self.native is not None and x.dim() == 2:
            return self.native(x.contiguous(), self.weight, self.eps)
        # Normalise in float32 as the reference implementation does, then cast back.
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


class RotaryEmbedding(nn.Module):
    """cos/sin tables for every position, gathered once per step for the batch's positions."""

    def __init__(self, head_dim: int, max_positions: int, theta: float) -> None:
        super().__init__()
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin(), persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        return self.cos[positions].to(dtype)[:, None, :], self.sin[positions].to(dtype)[:, None, :]


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

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        c = self.cfg
        qkv = self.qkv_proj(x)
        # Q and K sit side by side: rotate them in one go (each op costs microseconds at decode).
        qk = apply_rotary(qkv[:, :c.q_size + c.kv_size].view(-1, c.num_heads + c.num_kv_heads, c.head_dim), cos, sin)
        q, k = qk.split([c.num_heads, c.num_kv_heads], dim=1)
        v = qkv[:, c.q_size + c.kv_size:].reshape(-1, c.num_kv_heads, c.head_dim)
        out = paged_attention(q, k, v, k_cache, v_cache, meta, self.scale)
        return self.o_proj(out.view(-1, c.q_size))


class MLP(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, k_cache, v_cache, meta)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        # The KV cache's dtype when it differs from the weights' (bf16 weights held in float32 on a
        # CPU without bf16 matmuls keep a bf16 cache: half the bytes for decode attention to read).
        self.kv_cache_dtype: torch.dtype | None = None

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv: PagedKVCache,
                meta: AttentionMetadata) -> torch.Tensor:
        """input_ids, positions: [T]. Returns final hidden states [T, hidden]."""
        x = self.embed_tokens(input_ids)
        cos, sin = self.rotary(positions, x.dtype)
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, kv.k[i], kv.v[i], meta)
        return self.norm(x)

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
