"""Builds one step's flat batch and attention metadata, runs the model, samples the next tokens."""

from __future__ import annotations

import time

import torch

from fairway.engine.rejection_sampler import sample_and_verify
from fairway.engine.scheduler import ScheduledBatch
from fairway.engine.sequence import Sequence
from fairway.engine.step_plan import plan_step, slots_of
from fairway.models.cpu_kernels import DecodeKernels, decode_kernels
from fairway.models.llama import LlamaModel
from fairway.models.paged_attention import (
    AttentionMetadata,
    DecodeGroup,
    DecodeTables,
    PagedKVCache,
    PrefillGroup,
)
from fairway.models.quant_linear import STEP_ROWS


class ModelRunner:
    def __init__(self, model: LlamaModel, num_blocks: int, block_size: int) -> None:
        self.model = model
        cfg = model.cfg
        param = next(model.parameters())
        self.device = param.device
        kv_dtype = model.kv_cache_dtype or param.dtype
        self.kv = PagedKVCache(cfg.num_layers, num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim,
                               kv_dtype, self.device)
        self.block_size = block_size
        self.group = cfg.num_heads // cfg.num_kv_heads
        self.decode_kernels = _native_decode(param.dtype, kv_dtype, self.device, self.group, cfg.head_dim,
                                             block_size)
        self.forward_seconds = 0.0  # time inside the model forward and sampling, for the overhead figure

    def execute(self, batch: ScheduledBatch) -> dict[Sequence, list[int]]:
        """Run one forward pass; returns the tokens each sequence that reached its end emits: one,
        or for a sequence with draft tokens, the accepted ones and the target's next."""
        ids, positions, meta, sample_rows, samplers, num_rows = self._prepare(batch)
        t0 = time.perf_counter()
        # The step's weights are chosen by its rows without the draft tokens (quant_linear.STEP_ROWS).
        rows = STEP_ROWS.set(len(ids) - batch.draft_rows)
        try:
            hidden = self.model(ids, positions, self.kv, meta)
            tokens: dict[Sequence, list[int]] = {}
            if samplers:
                logits = self.model.compute_logits(hidden[sample_rows])
                tokens = dict(zip(samplers, sample_and_verify(logits.cpu(), samplers, num_rows), strict=True))
        finally:
            STEP_ROWS.reset(rows)
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        self.forward_seconds += time.perf_counter() - t0
        return tokens

    def _prepare(self, batch: ScheduledBatch):
        plan = plan_step(batch, self.block_size)
        dev = self.device
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(plan.slots, dtype=torch.long, device=dev),
            prefills=[self._prefill_group(group) for group in _prefill_groups(plan.prefills)],
        )
        decode_rows = plan.decode_rows
        if self.decode_kernels is not None:
            meta.decode_tables = self._decode_tables(decode_rows) if decode_rows else None
        else:
            meta.decodes = [self._decode_group(decode_rows, a, b)
                            for a, b in _length_groups(decode_rows, self.block_size)]
        return (torch.tensor(plan.input_ids, dtype=torch.long, device=dev),
                torch.tensor(plan.positions, dtype=torch.long, device=dev), meta,
                torch.tensor(plan.sample_rows, dtype=torch.long, device=dev), plan.samplers, plan.num_rows)

    def _decode_tables(self, rows: list[tuple[Sequence, int]]) -> DecodeTables:
        tables, lens = _padded_block_tables(rows, torch.int32)
        return DecodeTables(self.decode_kernels, tables, lens, self.block_size)

    def _decode_group(self, rows: list[tuple[Sequence, int]], a: int, b: int) -> DecodeGroup:
        bs = self.block_size
        tables, lens = _padded_block_tables(rows[a:b], torch.long)
        width = tables.shape[1]
        group_slots = (tables[:, :, None] * bs + torch.arange(bs)).flatten()
        masked = torch.arange(width * bs)[None, :] >= lens[:, None]
        return DecodeGroup(start=a, end=b, slots=group_slots.to(self.device), width=width * bs,
                           masked=masked[None, :, None, :].to(self.device))

    def _prefill_group(self, spans: list[tuple[int, int, Sequence]]) -> PrefillGroup:
        """Chunks (rows [row, end) of the flat batch, of seq) padded to one attention call."""
        n = max(end - row for row, end, _ in spans)
        starts = [seq.num_computed_tokens for _, _, seq in spans]
        fresh = all(start == 0 for start in starts)
        ctx = n if fresh else max(start + end - row for start, (row, end, _) in zip(starts, spans, strict=True))
        rows: list[int] = []
        real: list[int] = []
        out_rows: list[int] = []
        slots: list[int] = []
        masks: list[torch.Tensor] = []
        queries, keys = torch.arange(n), torch.arange(ctx)[None, :]
        for i, ((row, end, seq), start) in enumerate(zip(spans, starts, strict=True)):
            size = end - row
            rows += [*range(row, end), *[end - 1] * (n - size)]
            real += range(i * n, i * n + size)
            out_rows += range(row, end)
            # Query j sits at position start + j and may see keys 0..start + j; a padding query sees key 0
            # (a row with no key at all would be NaN).
            mask = keys <= torch.where(queries < size, start + queries, 0)[:, None]
            masks.append(mask.repeat(self.group, 1))
            if not fresh:
                context = start + size
                slots += [*slots_of(seq, 0, context, self.block_size), *[0] * (ctx - context)]
        dev = self.device

        def longs(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.long, device=dev)

        return PrefillGroup(len(spans), n, ctx, longs(rows), longs(real), longs(out_rows),
                            torch.stack(masks)[:, None].to(dev), None if fresh else longs(slots))


def _prefill_groups(spans: list[tuple[int, int, Sequence]], growth: float = 1.5,
                    slack: int = 32) -> list[list[tuple[int, int, Sequence]]]:
    """Prefill chunks in groups for one attention call each: chunks that start a sequence apart
    from those that continue one (read from the cache), and, by size, only chunks whose padding
    stays small (the longest at most growth times, or slack tokens more than, the shortest)."""
    def size(span: tuple[int, int, Sequence]) -> tuple[int, int]:
        row, end, seq = span
        return end - row, seq.num_computed_tokens + end - row  # (new tokens, whole context)

    groups: list[list[tuple[int, int, Sequence]]] = []
    for continuing in (False, True):
        group: list[tuple[int, int, Sequence]] = []
        for span in sorted((s for s in spans if (s[2].num_computed_tokens > 0) == continuing), key=size):
            if group and not all(big <= max(growth * small, small + slack)
                                 for small, big in zip(size(group[0]), size(span), strict=True)):
                groups.append(group)
                group = []
            group.append(span)
        if group:
            groups.append(group)
    return groups


def _padded_block_tables(rows: list[tuple[Sequence, int]], dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Decode rows' block tables padded with block 0 to the longest, and each row's context length
    (its own token included)."""
    width = max(len(s.blocks) for s, _ in rows)
    tables = torch.tensor([[blk.block_id for blk in s.blocks] + [0] * (width - len(s.blocks)) for s, _ in rows],
                          dtype=dtype)
    return tables, torch.tensor([context for _, context in rows], dtype=dtype)


def _native_decode(dtype: torch.dtype, kv_dtype: torch.dtype, device: torch.device, group: int,
                   head_dim: int, block_size: int) -> DecodeKernels | None:
    """The native decode kernel where it applies (CPU, a supported shape), else None (portable path)."""
    if device.type != "cpu":
        return None
    kernels = decode_kernels()
    return kernels if kernels is not None and kernels.supports(dtype, kv_dtype, group, head_dim, block_size) else None


def _length_groups(rows: list[tuple[Sequence, int]], block_size: int, min_group: int = 8,
                   growth: float = 1.5) -> list[tuple[int, int]]:
    """Split length-sorted decode rows into [a, b) groups whose longest context is at most `growth`
    times their shortest (in blocks), so padding stays small; tiny groups are not worth a separate call."""
    blocks = [-(-context // block_size) for _, context in rows]
    groups: list[tuple[int, int]] = []
    a = 0
    for i in range(1, len(rows) + 1):
        if i == len(rows) or (i - a >= min_group and blocks[i] > growth * blocks[a]):
            groups.append((a, i))
            a = i
    return groups
