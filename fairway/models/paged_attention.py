"""Attention that reads K/V through block tables (a paged KV cache), in portable PyTorch.

The cache of one layer is [kv_heads, num_blocks * block_size, head_dim]: a slot is
block * block_size + offset, and gathering a sequence's slots along dim 1 yields each head's
keys contiguous, ready for batched matmuls without another copy.

The batch is flat: T tokens of many sequences. Sequences with exactly one new token (decode,
or the last token of a prefill) come first, sorted by context length. On the CPU they go to the
native kernel (fairway/models/cpu_kernels.py), which reads each context in place through its
block table. Elsewhere (CUDA, or no C compiler) they are handled in a few groups of similar
length, one padded gather each, so short contexts don't pay for the longest one. Sequences with
several new tokens (prefill chunks) follow, in groups of similar size, one padded attention call
per group. Grouped-query attention is
done without repeating K/V: the G query heads that share a KV head are folded into the
query-length dimension.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch
import torch.nn.functional as F

from fairway.models import huge_pages
from fairway.models.cpu_kernels import DecodeKernels


@dataclass
class PrefillGroup:
    """Prefill chunks of similar size, attended to in one padded call ([B, Hkv, G * n, D] queries
    against [B, Hkv, ctx, D] keys): a burst of new prompts costs one attention call per layer, not
    one per prompt (on the CPU a call's fixed cost exceeds the arithmetic of a short one)."""

    batch: int  # B chunks
    n: int  # the longest chunk, in tokens: every chunk's queries are padded to it
    ctx: int  # the longest context (cached prefix + chunk): every chunk's keys are padded to it
    rows: torch.Tensor  # [B * n] long: each chunk's rows of the flat batch, padded by repeating its last
    real: torch.Tensor  # [R] long: which of those B * n are real rows ...
    out_rows: torch.Tensor  # [R] long: ... and where they go in the flat batch
    mask: torch.Tensor  # [B, 1, G * n, ctx] bool: causal, offset by each cached prefix
    # [B * ctx] long: each chunk's whole context in the cache, padded with slot 0; None when every
    # chunk starts at position 0, where a chunk's own K/V rows are its whole context.
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


class AttentionBackend(Protocol):
    """A step's attention done elsewhere (the GPU runner's block-table kernels, block_tables.py):
    it stores the step's K/V and attends, in place of write_kv and the groups below."""

    def write_kv(self, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> None: ...

    def attention(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  scale: float) -> torch.Tensor: ...


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] long: cache slot of each new token
    decodes: list[DecodeGroup] = field(default_factory=list)  # portable path
    decode_tables: DecodeTables | None = None  # native path (instead of decodes)
    prefills: list[PrefillGroup] = field(default_factory=list)
    backend: AttentionBackend | None = None  # the GPU runner's (instead of all the above)


class PagedKVCache:
    """K and V for every layer: [layers, kv_heads, num_blocks * block_size, head_dim]."""

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype, device: torch.device | str) -> None:
        shape = (num_layers, num_kv_heads, num_blocks * block_size, head_dim)
        # On 2 MB pages where the host lends them: a step's reads of scattered blocks (huge_pages.py).
        self.k = huge_pages.zeros(shape, dtype, device)
        self.v = huge_pages.zeros(shape, dtype, device)
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
    if meta.backend is not None:
        return meta.backend.attention(q, k_cache, v_cache, scale)
    kv_heads = k_cache.shape[0]
    group = q.shape[1] // kv_heads
    out = torch.empty_like(q)
    if (dt := meta.decode_tables) is not None:
        n = dt.context_lens.shape[0]
        out[:n] = dt.kernels.decode_attention(q[:n], k_cache, v_cache, dt.block_tables, dt.context_lens,
                                              dt.block_size, scale)
    for dg in meta.decodes:
        out[dg.start:dg.end] = _decode_attention(q[dg.start:dg.end], k_cache, v_cache, dg, group, scale)
    attend_prefills(out, q, k, v, k_cache, v_cache, meta.prefills, group, scale)
    return out


def attend_prefills(out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                    v_cache: torch.Tensor, prefills: list[PrefillGroup], group: int, scale: float) -> None:
    """Each prefill group's attention into its rows of out ([T, Hq, D]); the arguments as
    paged_attention's. The native pass (native_decode.py) calls it from inside its layers."""
    for pg in prefills:
        out.index_copy_(0, pg.out_rows, _prefill_attention(q, k, v, k_cache, v_cache, pg, group, scale)
                        .index_select(0, pg.real))


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
                       v_cache: torch.Tensor, pg: PrefillGroup, group: int, scale: float) -> torch.Tensor:
    """The group's padded output rows, [B * n, Hq, D]."""
    hq, d = q.shape[1], q.shape[2]
    hkv = hq // group
    b, n = pg.batch, pg.n
    # [B * n, Hkv, G, D] -> [B, Hkv, G * n, D]: the G query heads of a KV head become extra query rows.
    qg = q.index_select(0, pg.rows).view(b, n, hkv, group, d).permute(0, 2, 3, 1, 4).reshape(b, hkv, group * n, d)
    if pg.context_slots is None:
        keys = k.index_select(0, pg.rows).view(b, n, hkv, d).transpose(1, 2)
        values = v.index_select(0, pg.rows).view(b, n, hkv, d).transpose(1, 2)
    else:
        keys = k_cache.index_select(1, pg.context_slots).view(hkv, b, pg.ctx, d).transpose(0, 1).to(q.dtype)
        values = v_cache.index_select(1, pg.context_slots).view(hkv, b, pg.ctx, d).transpose(0, 1).to(q.dtype)
    # 4-D inputs: PyTorch's fused CPU kernel takes only those; 3-D ones fall back to the slow math path.
    o = F.scaled_dot_product_attention(qg, keys, values, attn_mask=pg.mask, scale=scale)
    return o.view(b, hkv, group, n, d).permute(0, 3, 1, 2, 4).reshape(b * n, hq, d)
