"""Decode steps replayed from CUDA graphs, one per batch-size bucket.

A decode step launches hundreds of small kernels, each of which a small model's GPU can finish
before Python has launched the next. A graph records the step once per bucket size and replays
it with one launch. The recorded step reads only static buffers (token ids, positions, slots,
block tables, context lengths, sized for the largest bucket) and copies its logits into one
static output (each recording's own output would stay allocated, a [size, vocab] tensor for
every size): a step of n rows fills the first n of the smallest bucket >= n, pads the rest
(slot -1: stored nowhere; context 0: attends to nothing), replays, and reads n rows back.

`Capture` is the seam: CudaGraphCapture records, EagerCapture runs the function again at every
replay, so the buckets, the padding and the static buffers are tested on the CPU
(tests/test_gpu_model_runner.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from fairway.engine.host_buffers import HostBuffers
from fairway.models.block_tables import BlockTableBatch

Forward = Callable[[torch.Tensor, torch.Tensor, BlockTableBatch], torch.Tensor]  # ids, positions -> logits


class Capture(Protocol):
    def capture(self, fn: Callable[[], torch.Tensor]) -> Callable[[], torch.Tensor]:
        """Record fn, which reads and writes only static tensors; the returned callable replays it
        and returns its output (the same tensor every time when recorded)."""
        ...


class EagerCapture:
    """Runs the function at every replay: the bookkeeping without a GPU."""

    def capture(self, fn: Callable[[], torch.Tensor]) -> Callable[[], torch.Tensor]:
        return fn


class CudaGraphCapture:
    """Records into CUDA graphs that share one memory pool (captured largest first, so the smaller
    ones fit in what the largest used)."""

    def __init__(self) -> None:
        self.pool = torch.cuda.graph_pool_handle()
        self.graphs: list[torch.cuda.CUDAGraph] = []

    def capture(self, fn: Callable[[], torch.Tensor]) -> Callable[[], torch.Tensor]:
        # Run once outside the graph first, on a side stream as PyTorch asks: Triton compiles its
        # kernels and cuBLAS picks its algorithms then, not while recording.
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            fn()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            out = fn()
        self.graphs.append(graph)

        def replay() -> torch.Tensor:
            graph.replay()
            return out

        return replay


def capture_sizes(max_num_seqs: int) -> list[int]:
    """Bucket sizes, vLLM's: 1, 2, 4, then every multiple of 8 up to the largest batch. A step
    pads to the next one, so at most 7 rows of a large batch are padding."""
    sizes = [s for s in (1, 2, 4) if s < max_num_seqs] + list(range(8, max_num_seqs + 1, 8))
    if not sizes or sizes[-1] < max_num_seqs:
        sizes.append(max_num_seqs)
    return sizes


@dataclass
class StaticInputs:
    """The buffers every recorded step reads, sized for the largest bucket."""

    input_ids: torch.Tensor  # [N] long
    positions: torch.Tensor  # [N] long
    slot_mapping: torch.Tensor  # [N] long
    block_tables: torch.Tensor  # [N, max_blocks] int32
    context_lens: torch.Tensor  # [N] int32
    logits: torch.Tensor  # [N, vocab] float32: what every recording writes

    @classmethod
    def allocate(cls, rows: int, max_blocks: int, vocab: int, device: torch.device) -> StaticInputs:
        def zeros(*shape: int, dtype: torch.dtype = torch.long) -> torch.Tensor:
            return torch.zeros(shape, dtype=dtype, device=device)

        return cls(zeros(rows), zeros(rows), zeros(rows).fill_(-1), zeros(rows, max_blocks, dtype=torch.int32),
                   zeros(rows, dtype=torch.int32), zeros(rows, vocab, dtype=torch.float32))

    def batch(self, rows: int, block_size: int) -> BlockTableBatch:
        """The first `rows` as a decode-only step: views, so a replay sees what was copied in."""
        device = self.input_ids.device
        no_chunks = torch.zeros(0, self.block_tables.shape[1], dtype=torch.int32, device=device)
        return BlockTableBatch(
            slot_mapping=self.slot_mapping[:rows], num_decodes=rows, decode_block_tables=self.block_tables[:rows],
            decode_context_lens=self.context_lens[:rows],
            prefill_query_start=torch.zeros(1, dtype=torch.int32, device=device),
            prefill_seq_lens=torch.zeros(0, dtype=torch.int32, device=device), prefill_block_tables=no_chunks,
            max_prefill_len=0, block_size=block_size)


class DecodeGraphs:
    def __init__(self, capture: Capture, sizes: list[int], max_blocks: int, block_size: int, vocab: int,
                 host: HostBuffers, device: torch.device) -> None:
        self.capture_impl = capture
        self.sizes = sorted(sizes)
        self.max_blocks = max_blocks
        self.block_size = block_size
        self.host = host
        self.static = StaticInputs.allocate(self.sizes[-1], max_blocks, vocab, device)
        self.replays: dict[int, Callable[[], torch.Tensor]] = {}

    def capture(self, forward: Forward) -> None:
        """Record forward over the static buffers for every size, largest first. The buffers hold
        padding meanwhile: the recording stores nothing in the KV cache."""
        s = self.static
        for size in reversed(self.sizes):
            batch = s.batch(size, self.block_size)

            def step(size: int = size, batch: BlockTableBatch = batch) -> torch.Tensor:
                out = s.logits[:size]
                out.copy_(forward(s.input_ids[:size], s.positions[:size], batch))
                return out

            self.replays[size] = self.capture_impl.capture(step)

    def bucket(self, rows: int) -> int | None:
        """The smallest captured size that holds rows, None when none does (the step runs eagerly)."""
        return next((size for size in self.sizes if size >= rows), None)

    def takes(self, rows: int, width: int) -> bool:
        """Whether a decode step of rows, whose longest block table is width blocks, fits a recording."""
        return self.bucket(rows) is not None and width <= self.max_blocks

    def run(self, input_ids: list[int], positions: list[int], slots: list[int], tables: list[list[int]],
            context_lens: list[int]) -> torch.Tensor:
        """One decode step of len(input_ids) rows (at most the largest size). Returns its logits,
        [rows, V]: a view of the static output, valid until the next replay."""
        rows = len(input_ids)
        size = self.bucket(rows)
        assert size is not None and size in self.replays, f"no captured decode step holds {rows} rows"
        s, host, up = self.static, self.host, self.host.upload
        up(host.stage("g_ids", input_ids, torch.long, size), s.input_ids[:size])
        up(host.stage("g_positions", positions, torch.long, size), s.positions[:size])
        up(host.stage("g_slots", slots, torch.long, size, pad=-1), s.slot_mapping[:size])
        up(host.stage("g_context", context_lens, torch.int32, size), s.context_lens[:size])
        # Only the columns some row reads: a row never reads past its own context's blocks.
        width = max(len(t) for t in tables)
        up(host.stage_rows("g_tables", tables, width, torch.int32, size), s.block_tables[:size, :width])
        return self.replays[size]()[:rows]
