"""Attention that reads K/V through block tables (a paged KV cache), in portable PyTorch.

The cache of one layer is [kv_heads, num_blocks * block_size, head_dim]: a slot is
block * block_size + offset, and gathering a sequence's slots along dim 1 yields each head's
keys contiguous, ready for batched matmuls without another copy.

The batch is flat: T tokens of many sequences. Sequences with exactly one new token (decode,
or the last token of a prefill) come first, sorted by context length. On the CPU they go to the
native kernel (fairway/models/cpu_kernels.py), which reads each context in place through its
block table. Elsewhere (CUDA, or no C compiler) they are handled in a few groups of similar
length, one padded gather each, so short contexts don't pay for the longest one. Sequences with
several new tokens (prefill chunks) follow, one attention call each. Grouped-query attention is
done without repeating K/V: the G query heads that share a KV head are folded into the
query-length dimension.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from fairway.models.cpu_kernels import DecodeKernels


@dataclass
class PrefillSpan:
    start: int  # first index of this sequence's tokens in the flat batch
    end: int
    mask: torch.Tensor  # [G * n, context_len] bool: causal, offset by the cached prefix
    # Cache slots of the whole context (cached prefix + these tokens); None when the chunk starts
    # at position 0, where its own K/V are the whole context and nothing needs gathering.
    context_slots: torch.Tensor | None


@dataclass
class DecodeGroup:
    """Single-token sequences of similar context length, attended to with one padded gather."""

    start: int  # rows [start, end) of the flat batch
    end: int
    slots: torch.Tensor  # [(end - start) * width] long: each sequence's context slots, padded with slot 0
    width: int  # longest context in the group, in slots (a multiple of the block size)
    masked: torch.Tensor  # [1, end - start, 1, width] bool: True = padding


@dataclass
class DecodeTables:
    """All single-token sequences (rows [0, n) of the flat batch), for the native kernel."""

    kernels: DecodeKernels
    block_tables: torch.Tensor  # [n, max_blocks] int32, padded with block 0
    context_lens: torch.Tensor  # [n] int32: tokens each row attends to, its new one included
    block_size: int


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] long: cache slot of each new token
    decodes: list[DecodeGroup] = field(default_factory=list)  # portable path
    decode_tables: DecodeTables | None = None  # native path (instead of decodes)
    prefills: list[PrefillSpan] = field(default_factory=list)


class PagedKVCache:
    """K and V for every layer: [layers, kv_heads, num_blocks * block_size, head_dim]."""

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype, device: torch.device | str) -> None:
        shape = (num_layers, num_kv_heads, num_blocks * block_size, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.block_size = block_size
        self.num_blocks = num_blocks


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Store the step's K and V ([T, Hkv, D]) at their slots (portable path; the native one is
    fused with RoPE in layer_ops.c). The cache may be narrower than the compute dtype (bf16 cache,
    float32 compute): round on write."""
    k_cache.index_copy_(1, slot_mapping, k.transpose(0, 1).to(k_cache.dtype))
    v_cache.index_copy_(1, slot_mapping, v.transpose(0, 1).to(v_cache.dtype))


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                    v_cache: torch.Tensor, meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """q: [T, Hq, D]; k, v: [T, Hkv, D], already written to the caches [Hkv, slots, D].
    Returns [T, Hq, D]."""
    kv_heads = k_cache.shape[0]
    group = q.shape[1] // kv_heads
    out = torch.empty_like(q)
    if (dt := meta.decode_tables) is not None:
        n = dt.context_lens.shape[0]
        out[:n] = dt.kernels.decode_attention(q[:n], k_cache, v_cache, dt.block_tables, dt.context_lens,
                                              dt.block_size, scale)
    for dg in meta.decodes:
        out[dg.start:dg.end] = _decode_attention(q[dg.start:dg.end], k_cache, v_cache, dg, group, scale)
    for span in meta.prefills:
        s = slice(span.start, span.end)
        out[s] = _prefill_attention(q[s], k[s], v[s], k_cache, v_cache, span, group, scale)
    return out


def _decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, dg: DecodeGroup,
                      group: int, scale: float) -> torch.Tensor:
    nd, hq, d = q.shape
    hkv = hq // group
    keys = k_cache.index_select(1, dg.slots).view(hkv, nd, dg.width, d).to(q.dtype)
    values = v_cache.index_select(1, dg.slots).view(hkv, nd, dg.width, d).to(q.dtype)
    qd = q.view(nd, hkv, group, d).transpose(0, 1)  # [Hkv, nd, G, D]
    # Plain matmuls beat the fused CPU kernel here: 3 query rows per head are too few for it.
    scores = torch.matmul(qd, keys.transpose(-1, -2)).float() * scale
    probs = scores.masked_fill_(dg.masked, float("-inf")).softmax(dim=-1).to(q.dtype)
    return torch.matmul(probs, values).transpose(0, 1).reshape(nd, hq, d)


def _prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                       v_cache: torch.Tensor, span: PrefillSpan, group: int, scale: float) -> torch.Tensor:
    n, hq, d = q.shape
    hkv = hq // group
    # [n, Hkv, G, D] -> [Hkv, G * n, D]: the G query heads of a KV head become extra query rows.
    qf = q.view(n, hkv, group, d).permute(1, 2, 0, 3).reshape(hkv, group * n, d)
    if span.context_slots is None:
        keys, values = k.transpose(0, 1), v.transpose(0, 1)
    else:
        keys = k_cache.index_select(1, span.context_slots).to(q.dtype)
        values = v_cache.index_select(1, span.context_slots).to(q.dtype)
    # 4-D inputs: PyTorch's fused CPU kernel takes only those; 3-D ones fall back to the slow math path.
    o = F.scaled_dot_product_attention(qf[None], keys[None], values[None], attn_mask=span.mask, scale=scale)
    return o.view(hkv, group, n, d).permute(2, 0, 1, 3).reshape(n, hq, d)
