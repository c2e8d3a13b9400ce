"""Paged attention on the GPU in Triton: the step's K/V stored into their cache slots, decode rows
(one query each, the query heads that share a KV head in one tile) and prefill chunks (causal over
the cached prefix and the chunk itself), every key read through block tables.

The cache is paged_attention.py's: one layer's K (or V) is [kv_heads, num_blocks * block_size,
head_dim], slot = block * block_size + offset. The attention kernels gather BLOCK_N key positions
at a time whatever the block size: position n of a row is in slot
block_tables[row, n // block_size] * block_size + n % block_size. Scores and the online softmax
run in float32 whatever the dtypes of the queries and the cache.

Importing this module imports triton: only the GPU runner does (serving on a CPU never needs it).
Tested on the CPU under TRITON_INTERPRET=1 (tests/test_triton_attention.py) against the PyTorch
reference.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fairway.models.block_tables import BlockTableBatch

BLOCK_N = 32  # key positions per tile
BLOCK_M = 32  # prefill query rows per tile


@triton.jit
def _store_kv_kernel(k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
                     stride_kt, stride_kh, stride_vt, stride_vh, stride_ch, stride_cs,
                     HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr):
    t = tl.program_id(0)
    h = tl.program_id(1)
    slot = tl.load(slot_ptr + t)
    d = tl.arange(0, BLOCK_D)
    # slot -1: a padding row of a captured batch, stored nowhere.
    mask = (d < HEAD_DIM) & (slot >= 0)
    slot = tl.maximum(slot, 0).to(tl.int64)
    k = tl.load(k_ptr + t * stride_kt + h * stride_kh + d, mask=mask)
    v = tl.load(v_ptr + t * stride_vt + h * stride_vh + d, mask=mask)
    dst = h * stride_ch + slot * stride_cs + d
    tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _key_tile(q, k_cache_ptr, table_ptr, kv_head, start, length, scale, stride_ch, stride_cs,
              BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr):
    """Key positions start .. start + BLOCK_N of a sequence of `length` keys, read through its
    block table (table_ptr: its row): the positions, which exist, where their K/V lie in the
    caches, and q's scaled float32 scores against them (both kernels' inner step)."""
    n = start + tl.arange(0, BLOCK_N)
    n_mask = n < length
    block = tl.load(table_ptr + n // BLOCK_SIZE, mask=n_mask, other=0)
    slots = block.to(tl.int64) * BLOCK_SIZE + n % BLOCK_SIZE
    d = tl.arange(0, BLOCK_D)
    kv_mask = n_mask[:, None] & (d < HEAD_DIM)[None, :]
    offs = kv_head * stride_ch + slots[:, None] * stride_cs + d[None, :]
    k = tl.load(k_cache_ptr + offs, mask=kv_mask, other=0.0).to(q.dtype)
    return n, n_mask, kv_mask, offs, tl.dot(q, tl.trans(k)).to(tl.float32) * scale


@triton.jit
def _softmax_step(m, denom, acc, s, q, v_cache_ptr, offs, kv_mask):
    """One tile's scores s into each query row's running softmax (max m, denominator, V weighted
    in float32, V read at offs as q's dtype). A row that sees no key yet (a prefill's padding past
    its chunk) keeps m = -inf, without a NaN."""
    m_new = tl.maximum(m, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp(m - m_safe)
    p = tl.exp(s - m_safe[:, None])
    v = tl.load(v_cache_ptr + offs, mask=kv_mask, other=0.0).to(q.dtype)
    return m_new, denom * alpha + tl.sum(p, 1), acc * alpha[:, None] + tl.dot(p.to(q.dtype), v).to(tl.float32)


@triton.jit
def _decode_kernel(q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, block_tables_ptr, context_lens_ptr, scale,
                   stride_qt, stride_qh, stride_ot, stride_oh, stride_ch, stride_cs, stride_bt,
                   BLOCK_SIZE: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
                   BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr):
    """One program per (row, KV head): its GROUP query heads attend together, so each key tile is
    read once for all of them (tl.dot needs 16 rows: BLOCK_G pads the group)."""
    row = tl.program_id(0)
    kv_head = tl.program_id(1)
    ctx = tl.load(context_lens_ptr + row)  # 0: a padding row, whose output is zero
    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    qo_mask = (g < GROUP)[:, None] & (d < HEAD_DIM)[None, :]
    heads = kv_head * GROUP + g
    q = tl.load(q_ptr + row * stride_qt + heads[:, None] * stride_qh + d[None, :], mask=qo_mask, other=0.0)
    m = tl.full([BLOCK_G], float("-inf"), tl.float32)
    denom = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    for start in range(0, ctx, BLOCK_N):
        n, n_mask, kv_mask, offs, s = _key_tile(q, k_cache_ptr, block_tables_ptr + row * stride_bt, kv_head, start, ctx,
                                                scale, stride_ch, stride_cs, BLOCK_SIZE, HEAD_DIM, BLOCK_D, BLOCK_N)
        s = tl.where(n_mask[None, :], s, float("-inf"))
        m, denom, acc = _softmax_step(m, denom, acc, s, q, v_cache_ptr, offs, kv_mask)
    out = acc / tl.where(denom > 0, denom, 1.0)[:, None]
    tl.store(out_ptr + row * stride_ot + heads[:, None] * stride_oh + d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=qo_mask)


@triton.jit
def _prefill_kernel(q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, block_tables_ptr, query_start_ptr, seq_lens_ptr,
                    scale, stride_qt, stride_qh, stride_ot, stride_oh, stride_ch, stride_cs, stride_bt,
                    BLOCK_SIZE: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr):
    """One program per (chunk, query head, BLOCK_M queries). The chunk's own K/V are in the cache
    already (stored first), so every key, cached prefix or new, is read the same way."""
    seq = tl.program_id(0)
    head = tl.program_id(1)
    tile = tl.program_id(2)
    q_start = tl.load(query_start_ptr + seq)
    q_len = tl.load(query_start_ptr + seq + 1) - q_start
    seq_len = tl.load(seq_lens_ptr + seq)
    prefix = seq_len - q_len  # query i sits at position prefix + i
    i = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    d = tl.arange(0, BLOCK_D)
    qo_mask = (i < q_len)[:, None] & (d < HEAD_DIM)[None, :]
    rows = (q_start + i).to(tl.int64)
    q = tl.load(q_ptr + rows[:, None] * stride_qt + head * stride_qh + d[None, :], mask=qo_mask, other=0.0)
    kv_head = head // GROUP
    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    denom = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    # Keys up to the tile's last query; none for a tile past the chunk's end (shorter chunks share the grid).
    end = tl.minimum(seq_len, prefix + (tile + 1) * BLOCK_M)
    end = tl.where(tile * BLOCK_M < q_len, end, 0)
    for start in range(0, end, BLOCK_N):
        n, n_mask, kv_mask, offs, s = _key_tile(q, k_cache_ptr, block_tables_ptr + seq * stride_bt, kv_head, start,
                                                seq_len, scale, stride_ch, stride_cs, BLOCK_SIZE, HEAD_DIM, BLOCK_D,
                                                BLOCK_N)
        visible = n_mask[None, :] & (n[None, :] <= (prefix + i)[:, None])
        s = tl.where(visible, s, float("-inf"))
        m, denom, acc = _softmax_step(m, denom, acc, s, q, v_cache_ptr, offs, kv_mask)
    out = acc / tl.where(denom > 0, denom, 1.0)[:, None]
    tl.store(out_ptr + rows[:, None] * stride_ot + head * stride_oh + d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=qo_mask)


def store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """k, v: [T, Hkv, D] (rows may be strided, the last dim not); each row to its slot of the caches
    [Hkv, slots, D], rounded to the cache's dtype; slot -1 stores nothing."""
    t, hkv, d = k.shape
    if t == 0:
        return
    assert k.stride(-1) == 1 and v.stride(-1) == 1 and k_cache.stride(-1) == 1
    _store_kv_kernel[(t, hkv)](k, v, k_cache, v_cache, slot_mapping, k.stride(0), k.stride(1), v.stride(0),
                               v.stride(1), k_cache.stride(0), k_cache.stride(1),
                               HEAD_DIM=d, BLOCK_D=triton.next_power_of_2(d))


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                     context_lens: torch.Tensor, block_size: int, scale: float, out: torch.Tensor) -> None:
    """q, out: [n, Hq, D], one query per row; block_tables [n, W] int32; context_lens [n] int32, the
    row's own key included (0: a padding row)."""
    n, hq, d = q.shape
    if n == 0:
        return
    hkv = k_cache.shape[0]
    group = hq // hkv
    _decode_kernel[(n, hkv)](q, k_cache, v_cache, out, block_tables, context_lens, scale,
                             q.stride(0), q.stride(1), out.stride(0), out.stride(1), k_cache.stride(0),
                             k_cache.stride(1), block_tables.stride(0),
                             BLOCK_SIZE=block_size, GROUP=group, HEAD_DIM=d,
                             BLOCK_G=max(16, triton.next_power_of_2(group)),
                             BLOCK_D=max(16, triton.next_power_of_2(d)), BLOCK_N=BLOCK_N)


def prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                      query_start: torch.Tensor, seq_lens: torch.Tensor, max_query_len: int, block_size: int,
                      scale: float, out: torch.Tensor) -> None:
    """Chunk c's queries are rows [query_start[c], query_start[c + 1]) of q and out ([T, Hq, D]);
    seq_lens[c] counts its cached prefix and the chunk; block_tables [chunks, W] int32."""
    chunks = seq_lens.shape[0]
    if chunks == 0:
        return
    hq, d = q.shape[1], q.shape[2]
    group = hq // k_cache.shape[0]
    grid = (chunks, hq, triton.cdiv(max_query_len, BLOCK_M))
    _prefill_kernel[grid](q, k_cache, v_cache, out, block_tables, query_start, seq_lens, scale,
                          q.stride(0), q.stride(1), out.stride(0), out.stride(1), k_cache.stride(0),
                          k_cache.stride(1), block_tables.stride(0),
                          BLOCK_SIZE=block_size, GROUP=group, HEAD_DIM=d, BLOCK_M=BLOCK_M,
                          BLOCK_D=max(16, triton.next_power_of_2(d)), BLOCK_N=BLOCK_N)


class TritonAttention:
    """The attention backend of a step described by block tables (AttentionMetadata.backend)."""

    def __init__(self, batch: BlockTableBatch) -> None:
        self.batch = batch

    def write_kv(self, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
        store_kv(k, v, k_cache, v_cache, self.batch.slot_mapping)

    def attention(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, scale: float) -> torch.Tensor:
        b = self.batch
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        nd = b.num_decodes
        decode_attention(q[:nd], k_cache, v_cache, b.decode_block_tables, b.decode_context_lens, b.block_size,
                         scale, out[:nd])
        prefill_attention(q, k_cache, v_cache, b.prefill_block_tables, b.prefill_query_start, b.prefill_seq_lens,
                          b.max_prefill_len, b.block_size, scale, out)
        return out
