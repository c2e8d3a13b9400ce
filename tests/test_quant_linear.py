"""The quantized-weight kernels (Q8_0, Q4_0, Q4_1; every path this CPU has) against float64
products with the dequantized weights, and the weights quantized here by ggml's block formats."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from probes import PARIS_PROMPT

from fairway.engine import EngineConfig, LLMEngine, SamplingParams
from fairway.engine.factory import build_engine
from fairway.models.cpu_kernels import QuantKernels, bf16_linear, decode_forward, quant_kernels
from fairway.models.loader import load_model
from fairway.models.packed_linear import PackedLinear
from fairway.models.quant_linear import STEP_ROWS, QuantLinear, native_types

kernel = quant_kernels()
needs_kernel = pytest.mark.skipif(kernel is None, reason="no x86 AVX2/AVX512 kernels here: weights are dequantized")
# What a decode step has here: an AVX2-only CPU multiplies the blocks by float32 activations alone
# (the model computes in float32 there).
ACTIVATIONS = torch.bfloat16 if native_types(torch.bfloat16) else torch.float32
needs_bf16 = pytest.mark.skipif(ACTIVATIONS != torch.bfloat16,
                                reason="no bf16 activations on stored weights here (AVX2 only: float32's)")
PATHS = [(isa, dtype) for isa, dtype in ((QuantKernels.AVX2, torch.float32), (QuantKernels.AVX512, torch.float32),
                                         (QuantKernels.AVX512, torch.bfloat16),
                                         (QuantKernels.AVX512_BF16, torch.bfloat16), (QuantKernels.AMX, torch.bfloat16),
                                         (QuantKernels.VNNI, torch.bfloat16))
         if kernel is not None and kernel.isas & isa]


def quantize(w: np.ndarray, qtype: str) -> np.ndarray:
    """A reference quantizer after ggml (quantize_row_*_ref): rows of [n, k] float -> block bytes."""
    n, k = w.shape
    blocks = w.reshape(n, k // 32, 32).astype(np.float32)
    if qtype == "Q8_0":
        d = np.abs(blocks).max(-1) / 127
        q = np.round(blocks / np.where(d == 0, 1, d)[..., None]).astype(np.int8)
        return np.concatenate([d.astype(np.float16)[..., None].view(np.uint8), q.view(np.uint8)], -1).reshape(n, -1)
    if qtype == "Q4_0":  # d = the signed extreme / -8, values round(x / d) + 8 clipped to 0..15
        idx = np.abs(blocks).argmax(-1)
        d = np.take_along_axis(blocks, idx[..., None], -1)[..., 0] / -8
        q = np.clip(np.floor(blocks / np.where(d == 0, 1, d)[..., None] + 8.5), 0, 15).astype(np.uint8)
        head = [d.astype(np.float16)[..., None].view(np.uint8)]
    else:  # Q4_1: d = (max - min) / 15, m = min, values round((x - m) / d)
        lo, hi = blocks.min(-1), blocks.max(-1)
        d = (hi - lo) / 15
        q = np.clip(np.floor((blocks - lo[..., None]) / np.where(d == 0, 1, d)[..., None] + 0.5), 0, 15)
        q = q.astype(np.uint8)
        head = [d.astype(np.float16)[..., None].view(np.uint8), lo.astype(np.float16)[..., None].view(np.uint8)]
    qs = q[..., :16] | (q[..., 16:] << 4)
    return np.concatenate([*head, qs], -1).reshape(n, -1)


def dequantize64(raw: np.ndarray, qtype: str, k: int) -> np.ndarray:
    """The weight the blocks stand for, in float64, straight from ggml's block layout."""
    size = {"Q8_0": 34, "Q4_0": 18, "Q4_1": 20}[qtype]
    b = raw.reshape(raw.shape[0], k // 32, size)
    d = b[..., :2].copy().view(np.float16).astype(np.float64)
    if qtype == "Q8_0":
        return (d * b[..., 2:].view(np.int8)).reshape(raw.shape[0], k)
    qs = b[..., 4:] if qtype == "Q4_1" else b[..., 2:]
    q = np.concatenate([qs & 15, qs >> 4], -1).astype(np.float64)
    if qtype == "Q4_0":
        return (d * (q - 8)).reshape(raw.shape[0], k)
    m = b[..., 2:4].copy().view(np.float16).astype(np.float64)
    return (d * q + m).reshape(raw.shape[0], k)


def case(qtype: str, n: int, k: int, rows: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    raw = quantize(rng.standard_normal((n, k)) * 0.05 + rng.standard_normal((n, 1)) * 0.02, qtype)
    x = torch.from_numpy(rng.standard_normal((rows, k)).astype(np.float32))
    return raw, x


@needs_kernel
@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0", "Q4_1"])
@pytest.mark.parametrize("isa,dtype", PATHS)
@pytest.mark.parametrize("rows,n", [(1, 576), (2, 40), (3, 100), (5, 64), (6, 32), (8, 16), (13, 200), (40, 48), (70, 40)])
def test_matches_float64_with_the_dequantized_weights(qtype, isa, dtype, rows, n):
    """Every tile shape (rows 1..8 in 1, 2 and 4 panels, chunks beyond; AMX: fewer rows than it
    takes, one tile, padded 16-row chunks, more than four) and a last panel cut short."""
    k = 96 if n != 576 else 576
    raw, x = case(qtype, n, k, rows)
    x = x.to(dtype)
    want = x.double().numpy() @ dequantize64(raw, qtype, k).T
    layer = QuantLinear.from_blocks(raw, qtype, k, dtype)
    layer.isa = isa
    got = layer(x)
    assert got.dtype == dtype and got.shape == (rows, n)
    scale = np.abs(want).max()
    tol = 1e-2 if dtype == torch.bfloat16 else 1e-5  # bf16: the output is rounded to 8 bits
    assert np.abs(got.double().numpy() - want).max() <= tol * scale


@needs_kernel
@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0", "Q4_1"])
def test_a_rows_outputs_barely_depend_on_the_rows_beside_it(qtype):
    """The activations a decode step has here (bf16; float32 on an AVX2-only CPU), one row alone
    (a decode step) or among up to 48 (a speculative verification of several sequences, a decode
    batch): the same bits among any number of rows on one path, and at most a bf16 rounding step
    apart across paths (the same block sums but for the order of float32 additions). The path is
    the step's rows without its drafts (STEP_ROWS): with AVX512-VNNI, bf16 steps of one or two rows
    take integer products, so one sequence's verification is its decode rows to the bit. With AMX,
    Q4 weights take it from one row (from three with VNNI), Q8_0 from 3 rows (1 and 2 on FMA)."""
    layer = QuantLinear.from_blocks(*case(qtype, 100, 128, 1)[:1], qtype, 128, ACTIVATIONS)
    x = case(qtype, 100, 128, 48, seed=1)[1].to(ACTIVATIONS)
    alone = torch.cat([layer(x[i:i + 1]) for i in range(48)]).float()
    batch = layer(x).float()
    assert ((batch - alone).abs() <= alone.abs() * 2 ** -7 + 1e-6).all()
    for rows in (3, 6, 13, 17, 40):  # AMX where there is some
        assert torch.equal(layer(x[:rows]).float(), batch[:rows]), rows
    if layer.path(1) == QuantKernels.VNNI:
        token = STEP_ROWS.set(1)  # one sequence's decode row and its drafts
        try:
            for rows in (2, 3, 4, 5, 9, 11, 16, 48):  # AMX int8 tiles from 4 where there are some
                assert torch.equal(layer(x[:rows]).float(), alone[:rows]), rows
        finally:
            STEP_ROWS.reset(token)
        return
    amx = kernel.isas & QuantKernels.AMX
    for rows in (2, 5, 6, 16) if not amx else (2,) if qtype == "Q8_0" else (2, 5, 16, 17, 40):
        assert torch.equal(layer(x[:rows]).float(), alone[:rows]), rows
    if amx and qtype != "Q8_0":
        assert torch.equal(batch, alone)


@pytest.mark.skipif(kernel is None or not kernel.isas & QuantKernels.AVX2, reason="no AVX2 here")
@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0", "Q4_1"])
def test_on_the_avx2_path_a_rows_outputs_are_the_same_bits_among_any_rows(qtype):
    """The AVX2 path (float32 activations; what an AVX2-only CPU runs) sums each row's chains in
    one order whether its tile runs them together (1-2 rows) or even k before odd k (3-4 rows), so
    a sequence's tokens do not change with the rows beside it in a step."""
    layer = QuantLinear.from_blocks(*case(qtype, 100, 128, 1)[:1], qtype, 128, torch.float32)
    layer.isa = QuantKernels.AVX2
    x = case(qtype, 100, 128, 48, seed=1)[1]
    alone = torch.cat([layer(x[i:i + 1]) for i in range(48)])
    for rows in (2, 3, 4, 5, 6, 7, 9, 13, 48):
        assert torch.equal(layer(x[:rows]), alone[:rows]), rows


@pytest.mark.skipif(kernel is None or not kernel.isas & QuantKernels.VNNI, reason="no AVX512-VNNI here")
@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0", "Q4_1"])
def test_a_verifications_rows_are_its_decode_rows_at_every_digit_edge(qtype):
    """Activations whose integer digits reach every edge of their bytes and words (each block's
    largest is just under 2, the rest exact multiples of its grid step: low words of -32768 and 32640,
    bytes of 0, 128 and 255, carries into the high digit): one sequence's verification rows, at
    every row count (integer products below quant_vnni.c's AMX_FROM_ROWS, AMX int8 tiles from it
    where there are some), are its decode rows to the bit."""
    k = 256
    layer = QuantLinear.from_blocks(case(qtype, 48, k, 1)[0], qtype, k, torch.bfloat16)
    rng = np.random.default_rng(7)
    rows = 24
    x = (rng.choice([-1.0, 1.0], (rows, k)) * rng.integers(128, 256, (rows, k)) / 128
         * 2.0 ** -rng.integers(0, 22, (rows, k)))
    x[:, ::32] = 255 / 128  # the largest bf16 below 2: digits up to the top of their range
    x = torch.from_numpy(x).to(torch.bfloat16)
    token = STEP_ROWS.set(1)  # one sequence's decode row and its drafts
    try:
        alone = torch.cat([layer(x[i:i + 1]) for i in range(rows)])
        for m in (*range(2, 13), 16, 24):
            assert torch.equal(layer(x[:m]), alone[:m]), m
    finally:
        STEP_ROWS.reset(token)


@needs_kernel
@needs_bf16
@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0", "Q4_1"])
@pytest.mark.parametrize("isa,dtype", [p for p in PATHS if p[1] == torch.bfloat16])
def test_small_activations_beside_an_outlier_keep_their_products(qtype, isa, dtype):
    """A decode step's row (bf16; integer dot products where the CPU has AVX512-VNNI) whose every
    block holds one value 2^14 times the others, as the bundled model's activations have, with a
    zero weight there: the output is the small values' products alone, and they must survive (a
    16-bit grid per block rounds them by up to 1/4 and misses by ~10%; it changed the bundled
    model's greedy text)."""
    k, n = 576, 64
    rng = np.random.default_rng(4)
    w = rng.standard_normal((n, k)) * 0.05
    w[:, ::32] = 0
    raw = quantize(w, qtype)
    x = torch.from_numpy(rng.standard_normal((1, k)).astype(np.float32))
    x[0, ::32] = torch.tensor([2.0 ** 14, -(2.0 ** 14)]).repeat(k // 64)
    x = x.to(dtype)
    want = x.double().numpy() @ dequantize64(raw, qtype, k).T
    layer = QuantLinear.from_blocks(raw, qtype, k, dtype)
    layer.isa = isa
    assert np.abs(layer(x).double().numpy() - want).max() <= 1e-2 * np.abs(want).max()


@needs_kernel
@needs_bf16
@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0", "Q4_1"])
@pytest.mark.parametrize("rows", [49, 64, 100])
def test_past_48_rows_the_outputs_are_the_dequantized_models(qtype, rows):
    """More rows than a verification of several sequences takes (a prefill): the weights are
    unpacked to bf16 panel by panel, the very weights --weights dequantized holds, and multiplied
    by its kernel (AMX tiles, or AVX512-BF16's), so the outputs are that kernel's to the bit."""
    from fairway.models.cpu_kernels import amx_linear, bf16_linear
    raw, x = case(qtype, 200, 192, rows, seed=2)
    x = x.to(torch.bfloat16)
    dequantized = torch.from_numpy(dequantize64(raw, qtype, 192).astype(np.float32)).to(torch.bfloat16)
    layer = QuantLinear.from_blocks(raw, qtype, 192, torch.bfloat16)
    if layer.isa not in (QuantKernels.AMX, QuantKernels.AVX512_BF16):
        pytest.skip("bf16 activations take neither AMX nor AVX512-BF16 here: past 48 rows as below")
    multiply = amx_linear() if layer.isa == QuantKernels.AMX else bf16_linear()
    want = multiply(x, bf16_linear().pack(dequantized), 200)
    assert torch.equal(layer(x), want)


@needs_kernel
def test_kernel_refuses_what_it_does_not_compute():
    raw, x = case("Q4_1", 32, 64, 2)
    layer = QuantLinear.from_blocks(raw, "Q4_1", 64, torch.float32)
    with pytest.raises(RuntimeError):  # bf16 dot products need bf16 activations
        kernel(x, layer.panels, 32, layer.qtype_id, QuantKernels.AVX512_BF16)
    with pytest.raises(RuntimeError):  # a type without a kernel
        kernel(x, layer.panels, 32, 12, layer.isa)
    with pytest.raises(ValueError):  # widths not a whole number of blocks
        QuantLinear.from_blocks(raw[:, :20], "Q4_1", 48, torch.float32)


@needs_kernel
def test_same_result_with_one_thread_and_several():
    raw, x = case("Q4_0", 1024, 256, 3)
    layer = QuantLinear.from_blocks(raw, "Q4_0", 256, torch.float32)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = layer(x)
        torch.set_num_threads(max(2, threads))
        assert torch.equal(one, layer(x))
    finally:
        torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def native_fp32(model_path):
    return load_model(model_path, torch.float32, weights="native")


@needs_kernel
def test_bundled_q4_1_weights_run_as_stored_give_the_dequantized_greedy_tokens(native_fp32, real_model_fp32,
                                                                              real_tokenizer):
    """The bundled GGUF holds its layers as Q4_1 and its (tied) embedding as Q8_0: run as stored
    with float32 activations, greedy tokens equal the float32 dequantized model's."""
    from test_engine_correctness import QUESTIONS

    linears = [layer.mlp.down_proj for layer in native_fp32.layers] + [native_fp32.layers[0].self_attn.qkv_proj]
    assert {lin.qtype for lin in linears} == {"Q4_1"} and native_fp32.lm_head.qtype == "Q8_0"
    prompts = [real_tokenizer.chat_prompt_ids([{"role": "user", "content": q}]) for q in QUESTIONS]
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    config = EngineConfig(num_kv_blocks=512, max_num_batched_tokens=256)
    native = LLMEngine(native_fp32, config).generate(prompts, params)
    dequantized = LLMEngine(real_model_fp32, config).generate(prompts, params)
    same = [a == b for a, b in zip(native, dequantized, strict=True)]
    assert sum(same) >= 9, same


@needs_kernel
def test_float32_activations_on_stored_weights_take_the_native_decode_pass_too(native_fp32):
    """Where the model computes in float32 (a CPU without bf16 arithmetic, or --dtype float32), its
    steps take the one-call pass too: the greedy comparison above runs through it."""
    if decode_forward() is None:
        pytest.skip("no whole-step decode pass in this build")
    assert native_fp32.native_decode is not None and native_fp32.native_decode.dtype == torch.float32


@needs_kernel
def test_bf16_activations_on_stored_weights_take_the_native_decode_pass(model_path, real_tokenizer, monkeypatch):
    """The default load (bf16; on a CPU without bf16 arithmetic computed in float32 over a bf16 KV
    cache): every step of a reply goes through the one-call pass."""
    from fairway.models.native_decode import NativeDecode

    model = load_model(model_path, torch.bfloat16)  # native: the default
    assert isinstance(model.layers[0].mlp.gate_up_proj, QuantLinear) and isinstance(model.lm_head, QuantLinear)
    if model.native_decode is None:
        pytest.skip("no whole-step decode pass in this build")
    passes: list[int] = []
    call = NativeDecode.__call__
    # Counted where the pass runs: a many-row step hands over to the bf16 copies' pass (_for), on
    # CPUs that keep one, and is counted there.
    monkeypatch.setattr(NativeDecode, "__call__", lambda self, x, *rest: (
        self._for(x.shape[0]) is self and passes.append(x.shape[0])) or call(self, x, *rest))
    eng = LLMEngine(model, EngineConfig(num_kv_blocks=64, speculative=None), tokenizer=real_tokenizer)
    prompt = real_tokenizer.chat_prompt_ids([{"role": "user", "content": PARIS_PROMPT}])
    got = eng.generate([prompt], SamplingParams(temperature=0, max_tokens=20))
    assert "Paris" in real_tokenizer.decode(got[0])
    assert len(passes) == eng.num_steps and passes[1:] == [1] * (eng.num_steps - 1)  # the prompt, then 1 row a step
    with pytest.raises(ValueError, match="weights"):
        load_model(model_path, torch.bfloat16, weights="bf16")
    dequantized = build_engine(model_path, "bfloat16", weights="dequantized").model  # --weights dequantized
    assert not any(isinstance(m, QuantLinear) for m in dequantized.modules())


@needs_kernel
@pytest.mark.parametrize(("dtype", "isa", "cache"), [pytest.param(torch.bfloat16, None, None, marks=needs_bf16),
                                                    (torch.float32, None, None),
                                                    (torch.float32, QuantKernels.AVX2, None),
                                                    (torch.float32, QuantKernels.AVX2, torch.bfloat16)],
                         ids=["bf16", "float32", "float32-avx2", "float32-avx2-bf16-cache"])
@pytest.mark.parametrize("qtype", ["Q4_0", "Q8_0"])
@pytest.mark.parametrize("dense_from", [None, 6], ids=["as-stored", "bf16-copy-from-6-rows"])
def test_native_decode_pass_on_stored_weights_gives_the_layer_by_layer_hidden_states(dtype, isa, cache, qtype,
                                                                                      dense_from):
    """A tiny random model (bf16, or float32 as on a CPU without bf16 arithmetic, there on the AVX2
    path, its cache float32 or bf16: the bf16 model loaded there) with its linears quantized here:
    every step's one-call pass (decode_forward.c calling the quantized kernel; prefill chunks, alone
    or beside decode rows, through its attention callback) against the layer-by-layer path, bit for
    bit; with bf16 copies for steps of 6 rows or more, those steps run on the copies on both paths
    (bf16 only: a float32 model with copies keeps the layer path)."""
    from fairway.models.config import LlamaConfig
    from fairway.models.llama import random_model

    if dtype == torch.float32 and dense_from is not None:
        pytest.skip("bf16 copies are for bf16 activations")
    if not native_types(dtype) or (isa is not None and not kernel.isas & isa):
        pytest.skip(f"no path for {dtype} activations on stored weights here")
    cfg = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                      num_kv_heads=2, head_dim=16, max_position_embeddings=512)
    model = random_model(cfg, seed=3, dtype=dtype)
    model.kv_cache_dtype = cache
    for parent in [m for layer in model.layers for m in (layer.self_attn, layer.mlp)]:
        for name, child in list(parent.named_children()):
            raw = quantize(child.weight.detach().float().numpy(), qtype)
            setattr(parent, name, linear := QuantLinear.from_blocks(raw, qtype, child.in_features, dtype))
            linear.isa = isa or linear.isa
            if dense_from is not None:
                linear.keep_dense(bf16_copy(raw, qtype, child.in_features), dense_from)
    if not model.use_native_decode():
        pytest.skip("no whole-step decode pass in this build")
    assert (model.native_decode.dense is not None) == (dense_from is not None)
    native, layer_by_layer, compared = model.native_decode, model.forward, []

    def both(ids, positions, kv, meta):
        got = layer_by_layer(ids, positions, kv, meta)
        if native.takes(ids.shape[0], kv, meta):
            model.native_decode = None
            try:
                assert torch.equal(got, layer_by_layer(ids, positions, kv, meta)), f"{ids.shape[0]} rows"
            finally:
                model.native_decode = native
            compared.append(ids.shape[0])
            mixed.append(bool(meta.prefills) and meta.decode_tables is not None)
        return got

    model.forward = both
    mixed: list[bool] = []
    for budget, batches in ((512, (1, 6, 19)), (64, (19,))):  # 64 tokens a step: chunks beside decode rows
        engine = LLMEngine(model, EngineConfig(num_kv_blocks=256, max_num_batched_tokens=budget))
        for batch in batches:
            prompts = [[(7 * i + j) % 250 + 1 for j in range(3 + (i * 11) % 40)] for i in range(batch)]
            engine.generate(prompts, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    assert {1, 6, 19} <= set(compared)
    assert any(mixed)  # decode rows and prefill chunks in one pass


def bf16_copy(raw: np.ndarray, qtype: str, k: int) -> PackedLinear:
    """The weight these blocks stand for in bf16, packed (what --weights auto keeps beside them)."""
    if bf16_linear() is None:
        pytest.skip("no AVX512-BF16 matmul here: no bf16 copies")
    return PackedLinear(torch.from_numpy(dequantize64(raw, qtype, k).astype(np.float32)).to(torch.bfloat16))


@needs_kernel
@needs_bf16
@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_1"])
def test_a_bf16_copy_takes_the_steps_of_many_rows_and_only_those(qtype):
    """From dense_from_rows rows of the step (its rows without draft tokens, as the engine sets
    STEP_ROWS; else the rows given) a layer with a bf16 copy multiplies by the copy, below by the
    blocks as stored: each the same bits as that path alone."""
    raw, x = case(qtype, 48, 256, 20, seed=7)
    x = x.to(torch.bfloat16)
    layer = QuantLinear.from_blocks(raw, qtype, 256, torch.bfloat16)
    copy = bf16_copy(raw, qtype, 256)
    layer.keep_dense(copy, 8)
    assert torch.equal(layer(x[:7]), layer.stored(x[:7])) and not torch.equal(layer(x[:7]), copy(x[:7]))
    assert torch.equal(layer(x[:8]), copy(x[:8])) and torch.equal(layer(x), copy(x))
    token = STEP_ROWS.set(20)  # 4 rows of a step of 20
    try:
        assert torch.equal(layer(x[:4]), copy(x[:4]))
    finally:
        STEP_ROWS.reset(token)
    token = STEP_ROWS.set(2)  # 2 sequences verifying 18 draft tokens: as the 2 rows alone
    try:
        assert torch.equal(layer(x), layer.stored(x))
    finally:
        STEP_ROWS.reset(token)


@needs_kernel
@needs_bf16
def test_the_copies_row_count_is_fixed_not_timed(monkeypatch):
    """Which weights a step uses changes its greedy tokens, so the copies' row count must not
    depend on how busy the machine was at load: DENSE_FROM_ROWS wherever the bf16 kernel is native
    and the blocks are not on AMX tiles, even with the bf16 kernel made slower than the blocks."""
    import time

    import fairway.models.quant_linear as quant_linear
    from fairway.models.quant_linear import DENSE_FROM_ROWS, dense_from_rows

    kernel = bf16_linear()
    if kernel is None:
        pytest.skip("no AVX512-BF16 matmul here: no bf16 copies")
    raw, _ = case("Q4_1", 48, 256, 1, seed=3)
    layer = QuantLinear.from_blocks(raw, "Q4_1", 256, torch.bfloat16)
    multiply = type(kernel).__call__
    monkeypatch.setattr(type(kernel), "__call__", lambda *a: (time.sleep(0.002), multiply(*a))[1])  # a crowded CPU
    expected = None if layer.isa == QuantKernels.AMX else DENSE_FROM_ROWS
    assert [dense_from_rows(layer) for _ in range(3)] == [expected] * 3
    monkeypatch.setattr(quant_linear, "bf16_linear", lambda: None)  # (oneDNN's bf16: no copy)
    assert dense_from_rows(layer) is None


@pytest.fixture
def with_copies(monkeypatch):
    """--weights auto with the bf16 copies taking over from the given row count, whatever this
    CPU measures (the measurement is the only thing replaced)."""
    import fairway.models.loader as loader

    def load(model_path, from_rows: int):
        if bf16_linear() is None:
            pytest.skip("no AVX512-BF16 matmul here: no bf16 copies")
        monkeypatch.setattr(loader, "dense_from_rows", lambda linear: from_rows)
        return load_model(model_path, torch.bfloat16, weights="auto")

    return load


@needs_kernel
def test_auto_weights_run_many_rows_as_the_dequantized_model_and_few_as_stored(model_path, real_tokenizer,
                                                                               with_copies, monkeypatch):
    """With copies from one row every step is the dequantized model's, token for token; with copies
    from more rows than any step has, the stored blocks' alone. With copies from 8 rows, 4 replies
    decoding with draft tokens to verify (steps of more than 8 rows) stay on the stored blocks, as
    without speculation, so speculation changes no greedy reply. The stored blocks take one path
    for every row count here (not the integer path of one- and two-sequence steps, which the
    speculating run's last steps would take alone: test_spec_decode says why)."""
    from test_engine_correctness import QUESTIONS

    from fairway.models import quant_linear
    from fairway.models.quant_linear import step_rows

    monkeypatch.setattr(quant_linear, "VNNI_ROWS", 0)

    prompts = [real_tokenizer.chat_prompt_ids([{"role": "user", "content": q}]) for q in QUESTIONS[:4]]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    config = EngineConfig(num_kv_blocks=512, max_num_batched_tokens=256, speculative=None)

    def tokens(model, cfg=config):
        return LLMEngine(model, cfg, tokenizer=real_tokenizer).generate(prompts, params)

    always = with_copies(model_path, 1)
    assert always.native_decode is not None and always.native_decode.dense is not None
    assert tokens(always) == tokens(load_model(model_path, torch.bfloat16, weights="dequantized"))
    assert tokens(with_copies(model_path, 10**6)) == tokens(load_model(model_path, torch.bfloat16, weights="native"))
    from8 = with_copies(model_path, 8)
    passes, choose = [], from8.native_decode._for

    def recorded(rows: int):
        chosen = choose(rows)
        passes.append((rows, step_rows(rows), chosen is from8.native_decode.dense))
        return chosen

    from8.native_decode._for = recorded
    engine = LLMEngine(from8, EngineConfig(num_kv_blocks=512, max_num_batched_tokens=256), tokenizer=real_tokenizer)
    assert engine.generate(prompts, params) == tokens(from8)
    assert engine.stats().spec_decode_num_draft_tokens > 0
    assert any(rows >= 8 > without_drafts and not dense for rows, without_drafts, dense in passes)
    assert all(dense == (without_drafts >= 8) for _, without_drafts, dense in passes)


@needs_kernel
def test_no_bf16_copies_where_they_would_crowd_memory(model_path, monkeypatch, with_copies):
    import fairway.models.loader as loader

    monkeypatch.setattr(loader, "_free_memory", lambda: 100 * 2**20)  # the copies: ~325 MB
    model = with_copies(model_path, 12)
    assert all(m.dense is None for m in model.modules() if isinstance(m, QuantLinear))
