"""The model runner of a GPU replica: the step's inputs uploaded from pinned host buffers without
waiting, decode steps replayed from CUDA graphs (cuda_graphs.py), attention in Triton through block
tables (fairway/models/triton_attention.py), sampling on the device (device_sampler.py). Per step
the host waits once: for the sampled ids.

Its interface is ModelRunner's (execute, kv, device, forward_seconds), so LLMEngine, the scheduler
and the speculator do not know which runs. What differs from the CPU path:

* Speculative verification works: draft rows are decode rows with their own context lengths
  (step_plan.py), attended to by the decode kernel (captured too: a decode-only step of n rows is
  n rows whatever they verify) and verified on the host after the one copy of sampled ids. A
  draft model's proposer still runs its own ModelRunner (portable PyTorch attention, no graphs).
* A GGUF's native quantized layers do not: their kernels are the CPU's (AVX2/AVX512/AMX C code),
  so on a GPU the loader dequantizes every layer to --dtype.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from fairway.engine.cuda_graphs import Capture, CudaGraphCapture, DecodeGraphs, capture_sizes
from fairway.engine.device import cuda_memory_plan
from fairway.engine.device_sampler import DeviceSampler
from fairway.engine.host_buffers import HostBuffers
from fairway.engine.rejection_sampler import sample_and_verify
from fairway.engine.scheduler import ScheduledBatch
from fairway.engine.sequence import Sequence
from fairway.engine.step_plan import StepPlan, plan_step
from fairway.models.block_tables import BlockTableBatch
from fairway.models.llama import LlamaModel
from fairway.models.paged_attention import AttentionBackend, AttentionMetadata, PagedKVCache

AttentionFactory = Callable[[BlockTableBatch], AttentionBackend]


def triton_attention() -> AttentionFactory:
    from fairway.models.triton_attention import TritonAttention  # imports triton: the GPU path only

    return TritonAttention


class GPUModelRunner:
    def __init__(self, model: LlamaModel, num_blocks: int, block_size: int, max_num_seqs: int = 256,
                 max_model_len: int | None = None, capture: Capture | None = None,
                 attention: AttentionFactory | None = None, max_num_batched_tokens: int = 512) -> None:
        """capture: how decode steps are recorded (CudaGraphCapture on a GPU by default; None there
        or EagerCapture runs them eagerly). attention: the step's attention backend (Triton's by default)."""
        self.model = model
        cfg = model.cfg
        param = next(model.parameters())
        self.device = param.device
        kv_dtype = model.kv_cache_dtype or param.dtype
        if self.device.type == "cuda":  # DeviceError naming the sizes, not an out-of-memory traceback
            cuda_memory_plan(model, cfg, num_blocks, block_size, kv_dtype, max_num_seqs, max_num_batched_tokens,
                             self.device).check(torch.cuda.get_device_name(self.device))
        self.kv = PagedKVCache(cfg.num_layers, num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim, kv_dtype,
                               self.device)
        self.block_size = block_size
        self.attention = attention or triton_attention()
        self.host = HostBuffers(self.device)
        self.sampler = DeviceSampler(self.host)
        self.forward_seconds = 0.0
        if capture is None and self.device.type == "cuda":
            capture = CudaGraphCapture()
        self.graphs: DecodeGraphs | None = None
        if capture is not None:
            max_blocks = -(-(max_model_len or cfg.max_position_embeddings) // block_size)
            self.graphs = DecodeGraphs(capture, capture_sizes(max_num_seqs), max_blocks, block_size, cfg.vocab_size,
                                       self.host, self.device)
            self.graphs.capture(self._forward)
            self._warm_up_prefill()

    def _warm_up_prefill(self) -> None:
        """One prefill chunk that stores nothing (slot -1), so the prefill kernel compiles now,
        not during the first request's TTFT."""
        n, dev = 16, self.device
        i32 = {"dtype": torch.int32, "device": dev}
        batch = BlockTableBatch(
            slot_mapping=torch.full((n,), -1, dtype=torch.long, device=dev), num_decodes=0,
            decode_block_tables=torch.zeros(0, 1, **i32), decode_context_lens=torch.zeros(0, **i32),
            prefill_query_start=torch.tensor([0, n], **i32), prefill_seq_lens=torch.tensor([n], **i32),
            prefill_block_tables=torch.zeros(1, -(-n // self.block_size), **i32), max_prefill_len=n,
            block_size=self.block_size)
        self._forward(torch.zeros(n, dtype=torch.long, device=dev), torch.arange(n, device=dev), batch)

    def execute(self, batch: ScheduledBatch) -> dict[Sequence, list[int]]:
        """Run one forward pass; returns the tokens each sequence that reached its end emits."""
        plan = plan_step(batch, self.block_size)
        t0 = time.perf_counter()
        rows = len(plan.input_ids)
        tokens: dict[Sequence, list[int]] = {}
        tables = _tables(plan.decode_rows)
        if (self.graphs is not None and plan.decode_only
                and self.graphs.takes(rows, max((len(t) for t in tables), default=0))):
            logits = self._sample_rows(self.graphs.run(plan.input_ids, plan.positions, plan.slots, tables,
                                                       [ctx for _, ctx in plan.decode_rows]), plan)
        else:
            logits = self._eager(plan, tables)
        if plan.samplers:
            tokens = dict(zip(plan.samplers, sample_and_verify(logits, plan.samplers, plan.num_rows, self._sample),
                              strict=True))
        else:  # no sampled ids to wait for: wait here before the next step refills the pinned buffers
            self.host.settle()
        self.forward_seconds += time.perf_counter() - t0
        return tokens

    def _sample(self, logits: torch.Tensor, seqs: list[Sequence]) -> list[int]:
        return self.sampler.sample(logits, seqs).tolist()  # the step's one wait for the GPU

    def _forward(self, input_ids: torch.Tensor, positions: torch.Tensor, batch: BlockTableBatch) -> torch.Tensor:
        meta = AttentionMetadata(slot_mapping=batch.slot_mapping, backend=self.attention(batch))
        return self.model.compute_logits(self.model(input_ids, positions, self.kv, meta))

    def _eager(self, plan: StepPlan, decode_tables: list[list[int]]) -> torch.Tensor:
        """A step with prefill chunks (or more decode rows than any captured size): uploaded and run
        as it is. Returns the logits of its sample rows."""
        host, up = self.host, self.host.upload
        prefills = plan.prefills
        starts = [row for row, _, _ in prefills] + [prefills[-1][1]] if prefills else [len(plan.decode_rows)]
        prefill_tables = [[b.block_id for b in seq.blocks] for _, _, seq in prefills]
        width = max((len(t) for t in decode_tables + prefill_tables), default=1)
        batch = BlockTableBatch(
            slot_mapping=up(host.stage("slots", plan.slots, torch.long)),
            num_decodes=len(plan.decode_rows),
            decode_block_tables=up(host.stage_rows("decode_tables", decode_tables, width, torch.int32)),
            decode_context_lens=up(host.stage("context_lens", [ctx for _, ctx in plan.decode_rows], torch.int32)),
            prefill_query_start=up(host.stage("query_start", starts, torch.int32)),
            prefill_seq_lens=up(host.stage("seq_lens", [seq.num_computed_tokens + end - row
                                                        for row, end, seq in prefills], torch.int32)),
            prefill_block_tables=up(host.stage_rows("prefill_tables", prefill_tables, width, torch.int32)),
            max_prefill_len=max((end - row for row, end, _ in prefills), default=0),
            block_size=self.block_size)
        ids = up(host.stage("ids", plan.input_ids, torch.long))
        positions = up(host.stage("positions", plan.positions, torch.long))
        meta = AttentionMetadata(slot_mapping=batch.slot_mapping, backend=self.attention(batch))
        return self.model.compute_logits(self._sample_rows(self.model(ids, positions, self.kv, meta), plan))

    def _sample_rows(self, rows: torch.Tensor, plan: StepPlan) -> torch.Tensor:
        """The sampled rows of a step's rows (all of them, in order, unless a prompt's chunk does
        not reach its end: a one-token chunk is a decode row, even mid-prompt)."""
        if len(plan.sample_rows) == rows.shape[0]:
            return rows
        return rows[self.host.upload(self.host.stage("sample_rows", plan.sample_rows, torch.long))]


def _tables(rows: list[tuple[Sequence, int]]) -> list[list[int]]:
    return [[b.block_id for b in seq.blocks] for seq, _ in rows]
