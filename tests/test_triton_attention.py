"""The Triton kernels (fairway/models/triton_attention.py) on the CPU, under Triton's interpreter,
against the PyTorch reference (paged_attention.py) and the block-table twin (block_tables.py).

TRITON_INTERPRET must be set before triton is imported and before the kernels are decorated:
@triton.jit reads it then, for ours and for triton's own helpers (tl.zeros, ...), and returns
interpreted kernels, which run on CPU tensors. It is set only while this module imports them and
while its tests run (a fixture), so no other test, and no process another test starts, inherits
the variable. What stays is triton itself, imported interpreted for the rest of this process: a
compiled kernel could not be built in it afterwards (test_triton_compile.py compiles in a child
process; nothing else in the suite imports triton). The interpreter's bf16 tl.dot is wrong, and
it truncates float32 to bf16 where the GPU rounds: the kernels cast keys to the queries' dtype,
so a bf16 cache is tested under float32 queries, with values bf16 holds exactly. Shapes are
tiny: the interpreter runs each program in numpy.
"""

from __future__ import annotations

import importlib
import os
import sys

import pytest

_before = os.environ.get("TRITON_INTERPRET")
os.environ["TRITON_INTERPRET"] = "1"
try:
    triton = pytest.importorskip("triton")
    import torch

    if "Interpreted" not in type(triton.language.zeros).__name__:
        raise RuntimeError("triton was imported in this process before TRITON_INTERPRET was set: its helpers are "
                           "compiled ones, which cannot run on the CPU; import it nowhere before this module")

    from fairway.models import triton_attention
    if not type(triton_attention._decode_kernel).__name__.startswith("Interpreted"):
        # Imported earlier without the interpreter (compiled kernels cannot run on CPU tensors).
        triton_attention = importlib.reload(sys.modules["fairway.models.triton_attention"])
finally:
    if _before is None:
        del os.environ["TRITON_INTERPRET"]
    else:
        os.environ["TRITON_INTERPRET"] = _before

from fairway.models.block_tables import BlockTableBatch, TorchBlockAttention  # noqa: E402
from fairway.models.paged_attention import (  # noqa: E402
    AttentionMetadata,
    DecodeGroup,
    PrefillGroup,
    paged_attention,
    write_kv,
)

HEAD_DIM = 16
KV_HEADS = 2


@pytest.fixture(autouse=True)
def interpreted(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # read again at launch by some of triton's helpers


def make_step(block_size: int, group: int, decode_lens: list[int], chunks: list[tuple[int, int]],
              q_dtype: torch.dtype, kv_dtype: torch.dtype, seed: int = 0):
    """A step of decode rows (their context lengths, own key included) then prefill chunks
    (cached prefix, new tokens): random caches (the prefixes' keys), random step K/V and queries,
    each sequence's blocks scattered over the pool. Returns the inputs and both metadata forms."""
    gen = torch.Generator().manual_seed(seed)
    seqs = [(n - 1, 1) for n in decode_lens] + chunks  # (prefix, new)
    need = [-(-(p + n) // block_size) for p, n in seqs]
    width = max(need)
    num_blocks = sum(need) + 3
    order = torch.randperm(num_blocks, generator=gen).tolist()
    tables = torch.zeros(len(seqs), width, dtype=torch.int32)
    k_cache = torch.randn(KV_HEADS, num_blocks * block_size, HEAD_DIM, generator=gen).to(kv_dtype)
    v_cache = torch.randn(KV_HEADS, num_blocks * block_size, HEAD_DIM, generator=gen).to(kv_dtype)
    slots: list[int] = []
    used = 0
    for s, ((prefix, new), blocks) in enumerate(zip(seqs, need, strict=True)):
        tables[s, :blocks] = torch.tensor(order[used:used + blocks])
        used += blocks
        slots += [int(tables[s, p // block_size]) * block_size + p % block_size for p in range(prefix, prefix + new)]
    t = len(slots)
    hq = KV_HEADS * group
    q = torch.randn(t, hq, HEAD_DIM, generator=gen).to(q_dtype)
    # Values the cache's dtype holds exactly: the interpreter truncates float32 to bf16 where the
    # GPU (and torch) round, so a rounding store would differ here and nowhere else.
    k = torch.randn(t, KV_HEADS, HEAD_DIM, generator=gen).to(kv_dtype).to(q_dtype)
    v = torch.randn(t, KV_HEADS, HEAD_DIM, generator=gen).to(kv_dtype).to(q_dtype)
    nd = len(decode_lens)
    starts = [nd]
    for _, new in chunks:
        starts.append(starts[-1] + new)
    batch = BlockTableBatch(
        slot_mapping=torch.tensor(slots, dtype=torch.long), num_decodes=nd,
        decode_block_tables=tables[:nd].contiguous(), decode_context_lens=torch.tensor(decode_lens, dtype=torch.int32),
        prefill_query_start=torch.tensor(starts, dtype=torch.int32),
        prefill_seq_lens=torch.tensor([p + n for p, n in chunks], dtype=torch.int32),
        prefill_block_tables=tables[nd:].contiguous(), max_prefill_len=max((n for _, n in chunks), default=0),
        block_size=block_size)
    return q, k, v, k_cache, v_cache, batch, reference_meta(batch, group)


def reference_meta(b: BlockTableBatch, group: int) -> AttentionMetadata:
    """The same step as paged_attention.py's groups: one padded decode group, one group per chunk."""
    bs = b.block_size
    meta = AttentionMetadata(slot_mapping=b.slot_mapping)
    nd = b.num_decodes
    if nd:
        tables = b.decode_block_tables.long()
        width = tables.shape[1] * bs
        lens = b.decode_context_lens.long()
        meta.decodes = [DecodeGroup(start=0, end=nd, slots=(tables[:, :, None] * bs + torch.arange(bs)).flatten(),
                                    width=width, masked=(torch.arange(width)[None, :] >= lens[:, None])[None, :, None])]
    starts = b.prefill_query_start.tolist()
    for c, ctx in enumerate(b.prefill_seq_lens.tolist()):
        row, end = starts[c], starts[c + 1]
        n = end - row
        prefix = ctx - n
        positions = torch.arange(ctx)
        table = b.prefill_block_tables[c].long()
        mask = positions[None, :] <= prefix + torch.arange(n)[:, None]
        meta.prefills.append(PrefillGroup(
            batch=1, n=n, ctx=ctx, rows=torch.arange(row, end), real=torch.arange(n), out_rows=torch.arange(row, end),
            mask=mask.repeat(group, 1)[None, None], context_slots=table[positions // bs] * bs + positions % bs))
    return meta


def run_reference(q, k, v, k_cache, v_cache, meta):
    k_cache, v_cache = k_cache.clone(), v_cache.clone()
    write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
    return paged_attention(q, k, v, k_cache, v_cache, meta, HEAD_DIM ** -0.5), k_cache, v_cache


def run_backend(backend, q, k, v, k_cache, v_cache):
    k_cache, v_cache = k_cache.clone(), v_cache.clone()
    backend.write_kv(k, v, k_cache, v_cache)
    return backend.attention(q, k_cache, v_cache, HEAD_DIM ** -0.5), k_cache, v_cache


# (block size, group, decode rows' context lengths, prefill chunks (cached prefix, new tokens), dtypes):
# ragged lengths, last blocks partly full, contexts over several key tiles (32), a chunk over two
# query tiles (32), a fresh chunk and ones after a cached prefix.
CASES = [
    (16, 1, [1, 17, 40], [(0, 7), (13, 20)], torch.float32, torch.float32),
    (16, 4, [3, 33], [(32, 1), (5, 40)], torch.float16, torch.float16),
    (8, 2, [9, 2, 64], [(0, 33)], torch.float32, torch.bfloat16),
    (64, 2, [70, 1], [(64, 5), (0, 3)], torch.float16, torch.float16),
    (32, 3, [31], [(1, 2)], torch.float32, torch.float16),
]


@pytest.mark.parametrize(("block_size", "group", "decode_lens", "chunks", "q_dtype", "kv_dtype"), CASES)
def test_kernels_match_the_reference(block_size, group, decode_lens, chunks, q_dtype, kv_dtype):
    q, k, v, k_cache, v_cache, batch, meta = make_step(block_size, group, decode_lens, chunks, q_dtype, kv_dtype)
    want, want_k, want_v = run_reference(q, k, v, k_cache, v_cache, meta)
    got, got_k, got_v = run_backend(triton_attention.TritonAttention(batch), q, k, v, k_cache, v_cache)
    assert torch.equal(got_k, want_k) and torch.equal(got_v, want_v)  # stored exactly, rounded to the cache's dtype
    tol = 2e-3 if q_dtype == torch.float16 else 1e-4
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)
    # The PyTorch twin of the same metadata agrees too (the GPU runner's tests run on it).
    twin, _, _ = run_backend(TorchBlockAttention(batch), q, k, v, k_cache, v_cache)
    torch.testing.assert_close(twin.float(), want.float(), atol=tol, rtol=tol)


def test_padding_rows_store_nothing_and_attend_to_nothing():
    """A captured batch's padding rows: slot -1, context length 0."""
    q, k, v, k_cache, v_cache, batch, _ = make_step(16, 2, [5, 20], [], torch.float32, torch.float32)
    batch.slot_mapping[1] = -1
    batch.decode_context_lens[1] = 0
    got, got_k, got_v = run_backend(triton_attention.TritonAttention(batch), q, k, v, k_cache, v_cache)
    assert torch.equal(got[1], torch.zeros_like(got[1]))
    changed = (got_k != k_cache).any(dim=(0, 2))
    assert changed.nonzero().flatten().tolist() == [batch.slot_mapping[0].item()]
    assert torch.equal(got_v.ne(v_cache).any(dim=(0, 2)), changed)


def test_the_gpu_runner_on_the_kernels_gives_the_cpu_runners_tokens():
    """The whole GPU path but the device: the runner's eager and padded decode steps on the
    interpreted kernels, a tiny model in float32, greedy."""
    from fairway.engine.cuda_graphs import EagerCapture
    from fairway.engine.gpu_model_runner import GPUModelRunner
    from fairway.engine.llm_engine import EngineConfig, LLMEngine
    from fairway.engine.sampling_params import SamplingParams
    from fairway.models.config import LlamaConfig
    from fairway.models.llama import random_model

    model = random_model(LlamaConfig.tiny(), seed=1)
    config = EngineConfig(num_kv_blocks=16, max_num_seqs=4, max_num_batched_tokens=16, speculative=None)
    prompts = [[20, 21, 22, 23, 24], list(range(30, 50)), [7, 8, 9]]
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    want = LLMEngine(model, config).generate(prompts, params)
    runner = GPUModelRunner(model, config.num_kv_blocks, config.block_size, config.max_num_seqs, 256,
                            capture=EagerCapture(), attention=triton_attention.TritonAttention)
    assert LLMEngine(model, config, runner=runner).generate(prompts, params) == want
