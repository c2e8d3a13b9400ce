"""One step's flat batch described by block tables, as the GPU kernels read it, and the same
attention in plain PyTorch.

The GPU runner describes a step this way (its decode part fits CUDA graphs: fixed-size tensors,
no host-side lists). triton_attention.py runs it on the GPU; TorchBlockAttention here runs it
anywhere, for the GPU runner's tests on the CPU and as the kernels' second oracle.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fairway.models.paged_attention import write_kv


@dataclass
class BlockTableBatch:
    """Rows [0, num_decodes) of the flat batch are decode rows (one query each); prefill chunk c
    is rows [prefill_query_start[c], prefill_query_start[c + 1]), after them."""

    slot_mapping: torch.Tensor  # [T] long: each row's cache slot; -1 for a padding row (stored nowhere)
    num_decodes: int
    decode_block_tables: torch.Tensor  # [num_decodes, W] int32
    decode_context_lens: torch.Tensor  # [num_decodes] int32: keys each row sees, its own included; 0 = padding
    prefill_query_start: torch.Tensor  # [chunks + 1] int32
    prefill_seq_lens: torch.Tensor  # [chunks] int32: cached prefix + chunk
    prefill_block_tables: torch.Tensor  # [chunks, W] int32
    max_prefill_len: int  # the longest chunk (the prefill kernel's grid)
    block_size: int


class TorchBlockAttention:
    """The attention backend of a BlockTableBatch in PyTorch: a padded gather per part. Reads the
    prefill metadata on the host (a sync): for tests and the CPU, not for speed."""

    def __init__(self, batch: BlockTableBatch) -> None:
        self.batch = batch

    def write_kv(self, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
        keep = self.batch.slot_mapping >= 0
        write_kv(k[keep], v[keep], k_cache, v_cache, self.batch.slot_mapping[keep])

    def attention(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, scale: float) -> torch.Tensor:
        b = self.batch
        out = torch.zeros(q.shape, dtype=q.dtype, device=q.device)
        nd = b.num_decodes
        if nd:
            lens = b.decode_context_lens.long()
            out[:nd] = _attend(q[:nd, None], k_cache, v_cache, b.decode_block_tables, lens, (lens - 1)[:, None], b.block_size,
                               scale)[:, 0]
        starts = b.prefill_query_start.tolist()
        for c, seq_len in enumerate(b.prefill_seq_lens.tolist()):
            a, e = starts[c], starts[c + 1]
            positions = torch.arange(seq_len - (e - a), seq_len, device=q.device)
            out[a:e] = _attend(q[None, a:e], k_cache, v_cache, b.prefill_block_tables[c:c + 1],
                               torch.tensor([seq_len], device=q.device), positions[None], b.block_size, scale)[0]
        return out


def _attend(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, tables: torch.Tensor,
            seq_lens: torch.Tensor, positions: torch.Tensor, block_size: int, scale: float) -> torch.Tensor:
    """q: [B, n, Hq, D] at positions [B, n]; each of the B sequences' keys through its table row.
    Query i sees the keys at positions <= its own. Returns [B, n, Hq, D] (zero for a row that sees none)."""
    bsz, n, hq, d = q.shape
    hkv = k_cache.shape[0]
    width = tables.shape[1] * block_size
    pos = torch.arange(width, device=q.device)
    slots = (tables.long()[:, pos // block_size] * block_size + pos % block_size).flatten()
    keys = k_cache.index_select(1, slots).view(hkv, bsz, width, d).transpose(0, 1).float()
    values = v_cache.index_select(1, slots).view(hkv, bsz, width, d).transpose(0, 1).float()
    qg = q.float().view(bsz, n, hkv, hq // hkv, d).permute(0, 2, 3, 1, 4)  # [B, Hkv, G, n, D]
    scores = torch.einsum("bhgnd,bhkd->bhgnk", qg, keys) * scale
    visible = (pos[None, None, :] <= positions[:, :, None]) & (pos[None, None, :] < seq_lens[:, None, None])
    scores = scores.masked_fill(~visible[:, None, None], float("-inf"))
    probs = scores.softmax(-1).nan_to_num(0.0)
    o = torch.einsum("bhgnk,bhkd->bhgnd", probs, values)
    return o.permute(0, 3, 1, 2, 4).reshape(bsz, n, hq, d).to(q.dtype)
