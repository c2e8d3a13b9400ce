"""Builds one step's flat batch and attention metadata, runs the model, samples the next tokens."""

from __future__ import annotations

import time

import torch

from fairway.engine.sampler import sample
from fairway.engine.scheduler import ScheduledBatch
from fairway.engine.sequence import Sequence
from fairway.models.llama import LlamaModel
from fairway.models.paged_attention import AttentionMetadata, PagedKVCache, PrefillSpan


class ModelRunner:
    def __init__(self, model: LlamaModel, num_blocks: int, block_size: int) -> None:
        self.model = model
        cfg = model.cfg
        param = next(model.parameters())
        self.device = param.device
        self.kv = PagedKVCache(cfg.num_layers, num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim,
                               param.dtype, self.device)
        self.block_size = block_size
        self.group = cfg.num_heads // cfg.num_kv_heads
        self.forward_seconds = 0.0  # time inside the model forward and sampling, for the overhead figure

    def execute(self, batch: ScheduledBatch) -> dict[Sequence, int]:
        """Run one forward pass; returns the sampled token for each sequence that reached its end."""
        ids, positions, slots, meta, sample_rows, samplers = self._prepare(batch)
        t0 = time.perf_counter()
        hidden = self.model(ids, positions, self.kv, meta)
        tokens: dict[Sequence, int] = {}
        if samplers:
            logits = self.model.compute_logits(hidden[sample_rows])
            tokens = dict(zip(samplers, sample(logits.cpu(), samplers), strict=True))
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        self.forward_seconds += time.perf_counter() - t0
        return tokens

    def _prepare(self, batch: ScheduledBatch):
        bs = self.block_size
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        sample_rows: list[int] = []
        samplers: list[Sequence] = []
        decode_tables: list[list[int]] = []
        decode_lens: list[int] = []
        spans: list[tuple[int, int, Sequence]] = []
        for seq, n in zip(batch.seqs, batch.num_new_tokens, strict=True):
            start = seq.num_computed_tokens
            row = len(ids)
            ids.extend(seq.token_ids[start:start + n])
            positions.extend(range(start, start + n))
            table = [b.block_id for b in seq.blocks]
            slots.extend(table[p // bs] * bs + p % bs for p in range(start, start + n))
            if n == 1:
                decode_tables.append(table)
                decode_lens.append(start + 1)
            else:
                spans.append((row, row + n, seq))
            if start + n == seq.num_tokens:
                sample_rows.append(row + n - 1)
                samplers.append(seq)
        dev = self.device
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=dev),
            num_decode=len(decode_tables),
            prefills=[self._prefill_span(row, end, seq) for row, end, seq in spans],
        )
        if decode_tables:
            width = max(len(t) for t in decode_tables)
            tables = torch.tensor([t + [0] * (width - len(t)) for t in decode_tables], dtype=torch.long)
            slots_2d = (tables[:, :, None] * bs + torch.arange(bs)).view(len(decode_tables), width * bs)
            masked = torch.arange(width * bs)[None, :] >= torch.tensor(decode_lens)[:, None]
            meta.decode_slots = slots_2d.flatten().to(dev)
            meta.decode_width = width * bs
            meta.decode_masked = masked[None, :, None, :].to(dev)
        return (torch.tensor(ids, dtype=torch.long, device=dev),
                torch.tensor(positions, dtype=torch.long, device=dev), slots, meta,
                torch.tensor(sample_rows, dtype=torch.long, device=dev), samplers)

    def _prefill_span(self, row: int, end: int, seq: Sequence) -> PrefillSpan:
        n = end - row
        start = seq.num_computed_tokens
        ctx = start + n
        # Query i sits at position start + i and may see keys 0..start + i.
        mask = torch.arange(ctx)[None, :] <= (start + torch.arange(n))[:, None]
        mask = mask.repeat(self.group, 1).to(self.device)
        context_slots = None
        if start > 0:
            table = torch.tensor([b.block_id for b in seq.blocks], dtype=torch.long)
            offsets = torch.arange(self.block_size)
            context_slots = (table[:, None] * self.block_size + offsets).flatten()[:ctx].to(self.device)
        return PrefillSpan(start=row, end=end, mask=mask, context_slots=context_slots)
