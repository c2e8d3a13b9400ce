"""The native CPU kernels against PyTorch references, and their fallback when they can't be built."""

from __future__ import annotations

import ctypes
import logging
import platform
import subprocess
from pathlib import Path

import pytest
import torch

from fairway.models import cpu_kernels
from fairway.models.llama import RMSNorm, RotaryEmbedding, apply_rotary, random_model
from fairway.models.paged_attention import write_kv
from fairway.native_build import compiler

kernels = cpu_kernels.decode_kernels()
needs_kernel = pytest.mark.skipif(kernels is None, reason="no C compiler: the portable path is used")


def scattered_case(dtype, head_dim, group, lens, kv_heads=3, block_size=16, seed=0, kv_dtype=None):
    """Caches with each sequence's blocks spread at random over the pool, as after churn."""
    kv_dtype = kv_dtype or dtype
    gen = torch.Generator().manual_seed(seed)
    widths = [(n + block_size - 1) // block_size for n in lens]
    num_blocks = sum(widths) + 7
    k = torch.randn(kv_heads, num_blocks * block_size, head_dim, generator=gen).to(kv_dtype)
    v = torch.randn(kv_heads, num_blocks * block_size, head_dim, generator=gen).to(kv_dtype)
    order = torch.randperm(num_blocks, generator=gen)
    tables = torch.zeros(len(lens), max(widths), dtype=torch.int32)
    used = 0
    for i, w in enumerate(widths):
        tables[i, :w] = order[used:used + w].int()
        used += w
    q = torch.randn(len(lens), kv_heads * group, head_dim, generator=gen).to(dtype)
    return q, k, v, tables, torch.tensor(lens, dtype=torch.int32)


def reference(q, k, v, tables, lens, block_size, scale):
    n, hq, d = q.shape
    hkv = k.shape[0]
    out = torch.empty(n, hq, d, dtype=torch.float64)
    for i, length in enumerate(lens.tolist()):
        slots = (tables[i].long()[:, None] * block_size + torch.arange(block_size)).flatten()[:length]
        keys, values = k[:, slots].double(), v[:, slots].double()  # [Hkv, L, D]
        qi = q[i].double().view(hkv, hq // hkv, d)
        probs = (qi @ keys.transpose(1, 2) * scale).softmax(-1)
        out[i] = (probs @ values).reshape(hq, d)
    return out


@needs_kernel
@pytest.mark.parametrize("dtype,kv_dtype,tol", [(torch.float32, torch.float32, 1e-5),
                                                (torch.bfloat16, torch.bfloat16, 2e-2),
                                                (torch.float32, torch.bfloat16, 1e-5)])
@pytest.mark.parametrize("head_dim", [64, 128, 40])  # the two unrolled sizes and the generic loop
@pytest.mark.parametrize("group", [1, 3, 4])
def test_matches_reference_on_scattered_blocks(dtype, kv_dtype, tol, head_dim, group):
    lens = [1, 2, 15, 16, 17, 33, 250, 511]  # block boundaries, a single token, long contexts
    q, k, v, tables, lengths = scattered_case(dtype, head_dim, group, lens, kv_dtype=kv_dtype)
    scale = head_dim ** -0.5
    got = kernels.decode_attention(q, k, v, tables, lengths, 16, scale)
    assert got.dtype == dtype and got.shape == q.shape
    torch.testing.assert_close(got.double(), reference(q, k, v, tables, lengths, 16, scale), atol=tol, rtol=tol)


@needs_kernel
def test_same_result_with_one_thread_and_several():
    q, k, v, tables, lengths = scattered_case(torch.bfloat16, 64, 3, [300, 5, 77, 128, 40, 1])
    many = kernels.decode_attention(q, k, v, tables, lengths, 16, 0.125)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        one = kernels.decode_attention(q, k, v, tables, lengths, 16, 0.125)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, many)  # each row is computed by one thread in a fixed order


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("rows", [2, 4, 9, 12])  # 12 x group 3 is past one item's 32 query rows
def test_a_verifications_rows_equal_each_row_alone_bit_for_bit(dtype, rows):
    """A speculative verification sends one sequence's rows with the same block table and lengths
    one apart; the kernel shares each block between them, and each row's output must be what it
    is alone (a decode step's), or greedy speculation would change the reply."""
    start = 300  # the run crosses block boundaries (16-token blocks)
    lens = [start + i for i in range(rows)]
    q, k, v, tables, lengths = scattered_case(dtype, 64, 3, [lens[-1]] * rows, seed=rows)
    tables[:] = tables[0]  # one sequence's table on every row, each row seeing one token more
    lengths = torch.tensor(lens, dtype=torch.int32)
    together = kernels.decode_attention(q, k, v, tables, lengths, 16, 0.125)
    for i in range(rows):
        alone = kernels.decode_attention(q[i:i + 1], k, v, tables[i:i + 1], lengths[i:i + 1], 16, 0.125)
        assert torch.equal(together[i:i + 1], alone), f"row {i}"
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(together.double(), reference(q, k, v, tables, lengths, 16, 0.125), atol=tol, rtol=tol)
    # Another sequence's decode row between the verification's rows: two runs, the same outputs.
    m = rows // 2
    mixed = torch.cat([lengths[:m], torch.tensor([40], dtype=torch.int32), lengths[m:]])
    got = kernels.decode_attention(torch.cat([q[:m], q[:1], q[m:]]), k, v, torch.cat([tables[:m], tables[:1], tables[m:]]),
                                   mixed, 16, 0.125)
    assert torch.equal(got[:m], together[:m]) and torch.equal(got[m + 1:], together[m:])


@needs_kernel
def test_shapes_beyond_the_kernel_are_not_claimed():
    bf16, f32 = torch.bfloat16, torch.float32
    assert kernels.supports(bf16, bf16, 3, 64, 16) and kernels.supports(f32, bf16, 3, 64, 16)
    assert not kernels.supports(torch.float16, torch.float16, 3, 64, 16)  # the portable path handles these
    assert not kernels.supports(bf16, f32, 3, 64, 16)
    assert not kernels.supports(f32, f32, 3, 60, 16)  # head_dim not a multiple of 8
    assert not kernels.supports(f32, f32, 32, 64, 16)


def test_no_compiler_falls_back_with_a_warning(monkeypatch, caplog, tmp_path):
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    monkeypatch.setenv("FAIRWAY_CACHE_DIR", str(tmp_path))
    with caplog.at_level(logging.WARNING):
        assert cpu_kernels._library.__wrapped__() is None
    assert "portable PyTorch paths" in caplog.text


def test_disabled_by_environment(monkeypatch):
    monkeypatch.setenv("FAIRWAY_NATIVE_KERNELS", "0")
    assert cpu_kernels.decode_kernels() is None and cpu_kernels.skinny_linear() is None


@needs_kernel
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 8])
@pytest.mark.parametrize("out_features,in_features", [(576, 1536), (963, 576), (7, 64)])  # ragged tails too
def test_skinny_linear_matches_float64(rows, out_features, in_features):
    skinny = cpu_kernels.skinny_linear()
    gen = torch.Generator().manual_seed(rows)
    weight = torch.randn(out_features, in_features, generator=gen).to(torch.bfloat16)
    x = torch.randn(rows, in_features, generator=gen)
    got = skinny(x, weight)
    want = x.double() @ weight.double().T
    torch.testing.assert_close(got.double(), want, atol=1e-4, rtol=1e-5)


@needs_kernel
def test_skinny_linear_claims_only_what_it_computes():
    skinny = cpu_kernels.skinny_linear()
    assert skinny.supports(1, 576) and skinny.supports(cpu_kernels.SKINNY_MAX_ROWS, 64)
    assert not skinny.supports(cpu_kernels.SKINNY_MAX_ROWS + 1, 576) and not skinny.supports(1, 60)


# -- a decoder layer's small ops (layer_ops.c) against the op-by-op PyTorch path ---------------------

DTYPES = [torch.float32, torch.bfloat16]


def portable(module):
    """The same module on the op-by-op PyTorch path."""
    module.native = None
    return module


def assert_same_rounding(got, want):
    """float32: equal to float rounding; bf16: the same rounding step by step, so equal but for the
    odd element where a float32 intermediate (a sum, an exp) differs in its last bit and a rounding
    goes the other way (two roundings in a row: up to two bf16 ulps)."""
    if got.dtype == torch.float32:
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        return
    torch.testing.assert_close(got.float(), want.float(), atol=0, rtol=2 ** -6)
    assert (got != want).float().mean().item() < 0.01


@needs_kernel
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 3, 64, 300])  # 2+ rows split across threads
def test_rms_norm_with_and_without_residual(dtype, rows):
    gen = torch.Generator().manual_seed(rows)
    x, res = (torch.randn(rows, 576, generator=gen) * 3).to(dtype), torch.randn(rows, 576, generator=gen).to(dtype)
    fused, ref = RMSNorm(576, 1e-5), portable(RMSNorm(576, 1e-5))
    with torch.no_grad():
        fused.weight.copy_(torch.randn(576, generator=gen))
        ref.weight.copy_(fused.weight)
    fused, ref = fused.to(dtype), ref.to(dtype)
    got, want = fused(x), ref(x)
    assert_same_rounding(got[0], want[0])
    assert got[1] is x
    got, want = fused(x, res), ref(x, res)
    assert torch.equal(got[1], want[1])  # the residual stream is one rounded add either way
    assert_same_rounding(got[0], want[0])


@needs_kernel
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 5, 70])
def test_silu_mul_matches_pytorch(dtype, rows):
    gate_up = (torch.randn(rows, 2 * 96, generator=torch.Generator().manual_seed(rows)) * 4).to(dtype)
    ops = cpu_kernels.layer_ops()
    gate, up = gate_up.chunk(2, dim=-1)
    assert_same_rounding(ops.silu_mul(gate_up), torch.nn.functional.silu(gate) * up)


@needs_kernel
@pytest.mark.parametrize("rows", [2, 3, 17])
def test_layer_ops_give_each_row_the_same_bits_on_one_thread_and_several(rows):
    """A decode step's rows split across threads from two rows: which thread takes a row must not
    change it (a reply would otherwise depend on the machine's thread count)."""
    ops = cpu_kernels.layer_ops()
    gen = torch.Generator().manual_seed(rows)
    x, res, w = (torch.randn(rows, 576, generator=gen).to(torch.bfloat16) for _ in range(3))
    gate_up = (torch.randn(rows, 2 * 1536, generator=gen) * 4).to(torch.bfloat16)
    threads = torch.get_num_threads()
    outs = []
    for n in (1, max(2, threads)):
        torch.set_num_threads(n)
        try:
            outs.append((ops.rms_norm(x, w, 1e-5, residual=res), ops.silu_mul(gate_up)))
        finally:
            torch.set_num_threads(threads)
    (norm1, silu1), (norm2, silu2) = outs
    assert torch.equal(norm1[0], norm2[0]) and torch.equal(norm1[1], norm2[1]) and torch.equal(silu1, silu2)


@needs_kernel
@pytest.mark.parametrize(("dtype", "cache_dtype"), [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                                    (torch.float32, torch.bfloat16)])
@pytest.mark.parametrize("tokens", [1, 6, 80])
def test_rope_store_rotates_and_writes_the_cache(dtype, cache_dtype, tokens):
    hq, hkv, d, slots = 9, 3, 64, 256
    gen = torch.Generator().manual_seed(tokens)
    rotary = RotaryEmbedding(d, 512, 10000.0)
    qkv = torch.randn(tokens, (hq + 2 * hkv) * d, generator=gen).to(dtype)
    positions = torch.randint(0, 512, (tokens,), generator=gen)
    where = torch.randperm(slots, generator=gen)[:tokens]
    k_cache, v_cache = torch.zeros(hkv, slots, d, dtype=cache_dtype), torch.zeros(hkv, slots, d, dtype=cache_dtype)
    want_k, want_v = k_cache.clone(), v_cache.clone()

    rope = rotary.batch(positions, dtype, native=False)
    heads = qkv.view(tokens, hq + 2 * hkv, d)
    want_qk = apply_rotary(heads[:, :hq + hkv], rope.cos, rope.sin)
    write_kv(want_qk[:, hq:], heads[:, hq + hkv:], want_k, want_v, where)

    got = qkv.clone()
    cpu_kernels.layer_ops().rope_store(got, hq, hkv, rotary.cos, rotary.sin, positions, where, k_cache, v_cache)
    got_heads = got.view(tokens, hq + 2 * hkv, d)
    assert_same_rounding(got_heads[:, :hq + hkv], want_qk)
    assert torch.equal(got_heads[:, hq + hkv:], heads[:, hq + hkv:])  # V untouched
    assert_same_rounding(k_cache, want_k)
    assert torch.equal(v_cache, want_v)


@needs_kernel
def test_rope_store_refuses_a_slot_outside_the_cache():
    cache = torch.zeros(1, 16, 8)
    with pytest.raises(RuntimeError, match="slot"):
        cpu_kernels.layer_ops().rope_store(torch.zeros(1, 3 * 8), 1, 1, torch.zeros(4, 8), torch.zeros(4, 8),
                                           torch.tensor([0]), torch.tensor([16]), cache, cache.clone())


@needs_kernel
@pytest.mark.parametrize("dtype", DTYPES)
def test_model_gives_the_same_logits_with_and_without_the_fused_ops(dtype):
    """A whole (tiny, random) model through the paged cache: fused layer ops against op by op."""
    from fairway.engine.llm_engine import EngineConfig, LLMEngine
    from fairway.engine.sampling_params import SamplingParams
    from fairway.models.config import LlamaConfig

    cfg = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                      num_kv_heads=2, head_dim=16, max_position_embeddings=256)
    outputs = []
    for native in (True, False):
        model = random_model(cfg, seed=3, dtype=dtype)
        if not native:
            for module in model.modules():
                if hasattr(module, "native"):
                    portable(module)
        engine = LLMEngine(model, EngineConfig(num_kv_blocks=64))
        prompts = [list(range(1, 40)), list(range(50, 60))]
        outputs.append(engine.generate(prompts, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)))
    assert outputs[0] == outputs[1]


# --- the AVX512-BF16 matmul (bf16_linear.c) ---

bf16_kernel = cpu_kernels.bf16_linear()
needs_bf16_kernel = pytest.mark.skipif(bf16_kernel is None, reason="no AVX512-BF16 here: bf16 layers use oneDNN")


def bf16_case(rows, out_features, in_features, seed=0):
    gen = torch.Generator().manual_seed(seed)
    weight = torch.randn(out_features, in_features, generator=gen).to(torch.bfloat16)
    x = torch.randn(rows, in_features, generator=gen).to(torch.bfloat16)
    return x, weight


def assert_bf16_linear_close(got, x, weight):
    """Within the bf16 rounding of the float32 product (half an ulp, 2^-9, plus the summation order)."""
    want = torch.nn.functional.linear(x.float(), weight.float())
    assert got.dtype == torch.bfloat16 and got.shape == want.shape
    torch.testing.assert_close(got.float(), want, rtol=2 ** -8, atol=1e-4)


@needs_bf16_kernel
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8, 13, 16, 17, 31, 32, 70])  # every tile policy, ragged chunks
@pytest.mark.parametrize("out_features,in_features", [(576, 1536), (963, 576), (7, 64), (40, 2), (3000, 10)])
def test_bf16_linear_matches_float32(rows, out_features, in_features):
    x, weight = bf16_case(rows, out_features, in_features, seed=rows)
    assert_bf16_linear_close(bf16_kernel(x, bf16_kernel.pack(weight), out_features), x, weight)


@needs_bf16_kernel
def test_bf16_linear_every_tile_shape():
    x, weight = bf16_case(37, 100, 64)  # 7 panels, the last 4 columns wide: ragged widths and chunks
    panels = bf16_kernel.pack(weight)
    for nv in range(1, 5):
        for mr in range(1, 17):
            if mr * nv > 28:  # past the registers: refused, not spilled
                with pytest.raises(RuntimeError):
                    bf16_kernel(x, panels, 100, tile=(nv, mr, False))
                continue
            for prefetch in (False, True):
                assert_bf16_linear_close(bf16_kernel(x, panels, 100, tile=(nv, mr, prefetch)), x, weight)


@needs_bf16_kernel
def test_bf16_linear_takes_any_layout_of_x():
    x, weight = bf16_case(6, 50, 64)
    panels = bf16_kernel.pack(weight)
    wide = torch.cat([x, x], dim=1)[:, ::2]  # strided
    shifted = torch.cat([torch.zeros(1, dtype=torch.bfloat16), x.flatten()])[1:].view(6, 64)  # 2-byte aligned
    assert shifted.data_ptr() % 4 == 2
    for view in (wide, shifted, x.t().contiguous().t()):
        assert_bf16_linear_close(bf16_kernel(view, panels, 50), view, weight)
    batched = x.view(2, 3, 64)
    assert bf16_kernel(batched, panels, 50).shape == (2, 3, 50)
    assert torch.equal(bf16_kernel(batched, panels, 50).view(6, 50), bf16_kernel(x, panels, 50))
    assert bf16_kernel(x[:0], panels, 50).shape == (0, 50)


@needs_bf16_kernel
def test_packed_linear_uses_the_kernel_for_bf16_and_onednn_otherwise(monkeypatch):
    from fairway.models import packed_linear
    from fairway.models.packed_linear import PackedLinear

    monkeypatch.setattr(packed_linear, "amx_available", lambda: False)  # (the AMX case: the next test)
    x, weight = bf16_case(5, 96, 64)
    layer = PackedLinear(weight)
    assert layer.native is bf16_kernel and not hasattr(layer, "packed")  # no second copy of the weight
    assert_bf16_linear_close(layer(x), x, weight)
    odd = PackedLinear(weight[:, :63])  # k-pairs only: an odd width stays with oneDNN
    assert odd.native is None
    torch.testing.assert_close(odd(x[:, :63]).float(), torch.nn.functional.linear(x[:, :63].float(),
                               weight[:, :63].float()), rtol=2 ** -7, atol=1e-3)
    assert PackedLinear(weight.float()).native is None


@needs_bf16_kernel
@pytest.mark.parametrize("amx_kernel", [False, True])
def test_on_an_amx_cpu_a_kernel_takes_few_rows_and_onednn_the_rest(monkeypatch, amx_kernel):
    from fairway.models import packed_linear

    if not packed_linear.packing_supported(torch.bfloat16, torch.device("cpu")):
        pytest.skip("no oneDNN bf16 on this CPU")
    if amx_kernel and amx_linear_kernel is None:
        pytest.skip("no AMX tiles here")
    monkeypatch.setattr(packed_linear, "amx_available", lambda: True)  # (what this CPU has does not matter)
    if not amx_kernel:  # an AMX CPU whose tiles the AMX kernel can't use: the AVX512-BF16 kernel takes fewer rows
        monkeypatch.setattr(packed_linear, "amx_linear", lambda: None)
    kernel, most = ((amx_linear_kernel, packed_linear.AMX_KERNEL_MAX_ROWS) if amx_kernel
                    else (bf16_kernel, packed_linear.NATIVE_ROWS_WITH_AMX))
    _, weight = bf16_case(1, 96, 64)
    layer = packed_linear.PackedLinear(weight)
    assert layer.native is kernel and hasattr(layer, "packed") and hasattr(layer, "panels")
    calls: list[int] = []
    monkeypatch.setattr(layer, "native", lambda x, panels, out: calls.append(x.shape[0]) or kernel(x, panels, out))
    for rows in (1, most, most + 1, 200):
        x, _ = bf16_case(rows, 96, 64)
        assert_bf16_linear_close(layer(x), x, weight)
    assert calls == [1, most]  # the larger batches went to oneDNN


# --- the AMX matmul (amx_linear.c) ---

amx_linear_kernel = cpu_kernels.amx_linear()
needs_amx_kernel = pytest.mark.skipif(amx_linear_kernel is None, reason="no AMX tiles here: the AVX512-BF16 "
                                      "kernel or oneDNN multiply")


@needs_amx_kernel
@pytest.mark.parametrize("rows", [1, 2, 5, 15, 16, 17, 31, 32, 33, 64, 70])  # one tile of rows, 32-row blocks, padding
@pytest.mark.parametrize("out_features,in_features", [(576, 1536), (963, 576), (7, 64), (3000, 32), (33, 96)])
def test_amx_linear_matches_float32(rows, out_features, in_features):
    x, weight = bf16_case(rows, out_features, in_features, seed=rows)
    assert_bf16_linear_close(amx_linear_kernel(x, amx_linear_kernel.pack(weight), out_features), x, weight)


@needs_amx_kernel
def test_amx_linear_takes_any_layout_of_x_and_only_widths_of_whole_tiles():
    x, weight = bf16_case(6, 50, 64)
    panels = amx_linear_kernel.pack(weight)
    for view in (torch.cat([x, x], dim=1)[:, :64], x.t().contiguous().t(), x.view(2, 3, 64)):  # strided, transposed
        assert torch.equal(amx_linear_kernel(view, panels, 50).view(6, 50), amx_linear_kernel(x, panels, 50))
    assert amx_linear_kernel(x[:0], panels, 50).shape == (0, 50)
    assert [amx_linear_kernel.supports(k) for k in (32, 576, 1536, 16, 48, 100)] == [True] * 3 + [False] * 3


@pytest.mark.parametrize("kernel,rows", [("bf16", 20), ("amx", 40)])
def test_packed_linear_kernels_give_the_same_result_with_one_thread_and_several(kernel, rows):
    chosen = {"bf16": bf16_kernel, "amx": amx_linear_kernel}[kernel]
    if chosen is None:
        pytest.skip(f"no {kernel} kernel on this CPU")
    x, weight = bf16_case(rows, 3000, 576)
    panels = chosen.pack(weight)
    many = chosen(x, panels, 3000)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        one = chosen(x, panels, 3000)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, many)  # each column is summed by one thread in a fixed order


def test_packed_linear_falls_back_to_onednn_without_the_kernel(monkeypatch):
    from fairway.models import packed_linear

    if not packed_linear.packing_supported(torch.bfloat16, torch.device("cpu")):
        pytest.skip("no oneDNN bf16 on this CPU: bf16 weights are held in float32")
    monkeypatch.setattr(packed_linear, "bf16_linear", lambda: None)  # as on a CPU without AVX512-BF16
    x, weight = bf16_case(3, 96, 64)
    layer = packed_linear.PackedLinear(weight)
    assert layer.native is None and hasattr(layer, "packed")
    torch.testing.assert_close(layer(x).float(), torch.nn.functional.linear(x.float(), weight.float()),
                               rtol=2 ** -7, atol=1e-3)


def test_bf16_kernel_present_exactly_where_the_compiler_targets_avx512_bf16(monkeypatch):
    if cpu_kernels._library() is None:
        pytest.skip("no C compiler")
    macros = subprocess.run([compiler(), "-march=native", "-dM", "-E", "-x", "c", "/dev/null"],
                            capture_output=True, text=True).stdout
    assert (cpu_kernels.bf16_linear() is not None) == ("__AVX512BF16__" in macros)
    if cpu_kernels.bf16_linear() is not None:
        assert "avx512_bf16" in cpu_kernels._cpu_signature().split()
    monkeypatch.setenv("FAIRWAY_NATIVE_KERNELS", "0")
    assert cpu_kernels.bf16_linear() is None


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64") or compiler() is None,
                    reason="needs an x86 C compiler")
def test_bf16_linear_without_avx512_bf16_builds_to_a_stub(tmp_path):
    """What a CPU without the instructions compiles (-march=native there): a kernel that declines."""
    out = tmp_path / "stub.so"
    src = Path(cpu_kernels.__file__).parent / "csrc" / "bf16_linear.c"
    subprocess.run([compiler(), "-O2", "-march=x86-64-v3", "-fopenmp", "-fPIC", "-shared", "-std=c11",
                    str(src), "-o", str(out)], check=True, capture_output=True)
    lib = ctypes.CDLL(str(out))
    binding = cpu_kernels.Bf16Linear(lib)
    assert not binding.available and not binding.supports(576)
    x, weight = bf16_case(2, 16, 64)
    with pytest.raises(RuntimeError):
        binding(x, binding.pack(weight), 16)


# --- a bf16 decode step's layers in one call (decode_forward.c, native_decode.py) ---

@needs_bf16_kernel
@pytest.mark.parametrize("amx", [True, False])
def test_native_decode_pass_gives_the_layer_by_layer_hidden_states_bit_for_bit(monkeypatch, amx):
    """Every step of a tiny random bf16 model, from 1 row to past one AMX tile (and past the most
    rows the pass takes on an AMX CPU), decode rows, prefill chunks (fresh and continuing a cached
    prefix) and both in one step: the one-call pass against the layer-by-layer path on the same
    inputs, hidden states compared bit for bit. With the AMX kernel where this CPU has it, and with
    the AVX512-BF16 kernel (as on a CPU without AMX) in any case."""
    from fairway.engine.llm_engine import EngineConfig, LLMEngine
    from fairway.engine.sampling_params import SamplingParams
    from fairway.models import packed_linear
    from fairway.models.config import LlamaConfig
    from fairway.models.packed_linear import pack_linears

    if amx and amx_linear_kernel is None:
        pytest.skip("no AMX tiles here")
    if not amx:
        monkeypatch.setattr(packed_linear, "amx_available", lambda: False)
    cfg = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=3, num_heads=4,
                      num_kv_heads=2, head_dim=16, max_position_embeddings=512)
    model = random_model(cfg, seed=5, dtype=torch.bfloat16)
    pack_linears(model)
    assert model.use_native_decode()
    native = model.native_decode
    assert native.amx == amx
    layer_by_layer = model.forward

    def both(ids, positions, kv, meta):
        if not native.takes(ids.shape[0], kv, meta):
            return layer_by_layer(ids, positions, kv, meta)
        got = layer_by_layer(ids, positions, kv, meta)  # (through the native pass)
        model.native_decode = None
        try:
            want = layer_by_layer(ids, positions, kv, meta)
        finally:
            model.native_decode = native
        assert torch.equal(got, want), f"{ids.shape[0]} rows"
        compared.append(ids.shape[0])
        kinds.add(step_kind(meta))
        return got

    compared: list[int] = []
    kinds: set[str] = set()
    model.forward = both
    # 512 tokens a step (the default), then 48: prompts split into chunks that continue a prefix
    for budget, batches in ((512, (1, 5, 20, 70)), (48, (20,))):
        engine = LLMEngine(model, EngineConfig(num_kv_blocks=256, max_num_batched_tokens=budget))
        for batch in batches:
            prompts = [[(7 * i + j) % 250 + 1 for j in range(3 + (i * 11) % 40)] for i in range(batch)]
            engine.generate(prompts, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
    # And a step that surely mixes: a prompt arriving while another reply decodes, its prefill beside
    # that decode (the runs above mix or not as measured step times shape them).
    engine = LLMEngine(model, EngineConfig(num_kv_blocks=256, bound_step_time=False, speculative=None))
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    engine.add_request("decoding", [5, 6, 7, 8, 9], params)
    engine.step()  # its prefill
    engine.add_request("arriving", [10, 11, 12], params)
    while engine.has_unfinished():
        engine.step()
    assert {1, 5, 20} <= set(compared)
    assert {"decode", "prefill", "mixed", "continued"} <= kinds
    assert native.max_rows is None or max(compared) <= native.max_rows


@needs_bf16_kernel
def test_an_error_in_the_native_pass_prefill_callback_reaches_the_caller(monkeypatch):
    """The prompt chunks' attention runs in Python, called back from the C pass: an exception there
    cannot cross the C frames, so the pass stops and the engine's step raises it, as the layer-by-
    layer path would (no crash, no hidden states from a half-run pass)."""
    from fairway.engine.llm_engine import EngineConfig, LLMEngine
    from fairway.engine.sampling_params import SamplingParams
    from fairway.models import native_decode
    from fairway.models.config import LlamaConfig
    from fairway.models.packed_linear import pack_linears

    cfg = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                      num_kv_heads=2, head_dim=16, max_position_embeddings=512)
    model = random_model(cfg, seed=5, dtype=torch.bfloat16)
    pack_linears(model)
    assert model.use_native_decode()

    def broken(*args, **kwargs):
        raise ValueError("attention failed")

    monkeypatch.setattr(native_decode, "attend_prefills", broken)
    engine = LLMEngine(model, EngineConfig(num_kv_blocks=64))
    engine.add_request("r", [5, 6, 7, 8], SamplingParams(max_tokens=2, temperature=0.0))
    with pytest.raises(ValueError, match="attention failed"):
        engine.step()


def step_kind(meta) -> str:
    """What a step's rows are, for the native-pass tests: decode rows only, prefill chunks only,
    both, or (any of them with) a chunk that continues a prompt already partly in the cache."""
    if any(pg.context_slots is not None for pg in meta.prefills):
        return "continued"
    if not meta.prefills:
        return "decode"
    return "mixed" if meta.decode_tables is not None else "prefill"


def test_native_decode_pass_is_not_taken_without_native_linears():
    from fairway.models.config import LlamaConfig

    cfg = LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_layers=1, num_heads=4,
                      num_kv_heads=2, head_dim=16, max_position_embeddings=64)
    assert not random_model(cfg, dtype=torch.float32).use_native_decode()
    assert not random_model(cfg, dtype=torch.bfloat16).use_native_decode()  # plain nn.Linear: not packed
