"""The GPU path on one card (an H200 in issue 21), in one run of a few minutes:

1. correctness: the Triton kernels against the PyTorch twin (block_tables.py) on one ragged step
   in bf16 and fp16; then a small random model's greedy tokens, GPU runner (CUDA graphs) against
   the CPU runner, float32 (tf32 off in both torch and Triton, so near-ties alone may differ);
2. throughput: a random-weight model of Llama-3.2-1B's shape in bf16, 256 requests of 512 prompt
   tokens and 256 output tokens submitted at once, against transformers' generate at batch 256 on
   the same card (random weights of the same shape);
3. TTFT of a 2,000-token prompt on the idle engine (median of 5, fresh prompts);
4. ITL (p50, p99 over every reply's gaps) with 32 and with 225 requests running at once.

It prints a short table and writes bench/results/gpu.json. `--tiny` runs the same phases on the
CPU with tiny shapes (the kernels under Triton's interpreter for the correctness phase, the
PyTorch twin for the rest, the capture eager): a smoke run of the script, its figures meaningless.

    .venv/bin/python bench/gpu.py            # on a GPU (a session lent one)
    .venv/bin/python bench/gpu.py --tiny     # anywhere, ~1 minute
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import statistics
import sys
import time
from pathlib import Path

TINY = "--tiny" in sys.argv
if TINY:  # before triton is imported: the kernels run interpreted on CPU tensors
    os.environ["TRITON_INTERPRET"] = "1"
os.environ.setdefault("TRITON_F32_DEFAULT", "ieee")  # float32 tl.dot without tf32 (bf16 kernels unaffected)

import torch  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import machine  # noqa: E402  (bench/machine.py)

from fairway.engine.cuda_graphs import EagerCapture  # noqa: E402
from fairway.engine.gpu_model_runner import GPUModelRunner  # noqa: E402
from fairway.engine.llm_engine import EngineConfig, LLMEngine  # noqa: E402
from fairway.engine.sampling_params import SamplingParams  # noqa: E402
from fairway.models.block_tables import BlockTableBatch, TorchBlockAttention  # noqa: E402
from fairway.models.config import LlamaConfig  # noqa: E402
from fairway.models.llama import LlamaModel, random_model  # noqa: E402

RESULTS = ROOT / "bench" / "results"
TARGETS = {"tokens_per_second": 80_000, "ttft_2000_s": 0.015, "itl_p99_225_s": 0.030}  # issue 21
LLAMA_1B = LlamaConfig(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_layers=16, num_heads=32,
                       num_kv_heads=8, head_dim=64, rope_theta=500000.0, max_position_embeddings=131072)
SMALL = LlamaConfig(vocab_size=1024, hidden_size=256, intermediate_size=512, num_layers=4, num_heads=8,
                    num_kv_heads=2, head_dim=32, max_position_embeddings=4096)
TINY_CFG = LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                       num_kv_heads=2, head_dim=16, max_position_embeddings=4096)
T0 = time.perf_counter()


def log(msg: str) -> None:
    print(f"[{time.perf_counter() - T0:6.1f}s] {msg}", file=sys.stderr, flush=True)


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


# --- engines ------------------------------------------------------------------------------------

def gpu_engine(model: LlamaModel, config: EngineConfig, attention=None) -> LLMEngine:
    """On a GPU the engine's own choice (GPUModelRunner, CUDA graphs, Triton); with --tiny the same
    runner on the CPU, eager, on the given attention (the PyTorch twin by default)."""
    if not TINY:
        return LLMEngine(model, config)
    runner = GPUModelRunner(model, config.num_kv_blocks, config.block_size, config.max_num_seqs,
                            config.max_model_len or model.cfg.max_position_embeddings, capture=EagerCapture(),
                            attention=attention or TorchBlockAttention,
                            max_num_batched_tokens=config.max_num_batched_tokens)
    return LLMEngine(model, config, runner=runner)


def random_on_device(cfg: LlamaConfig, dtype: torch.dtype, device: str, seed: int = 0, std: float = 0.02) -> LlamaModel:
    """Random weights made where they will run (1.2B float32 values drawn on the CPU would take longer)."""
    torch.manual_seed(seed)
    with torch.device(device):
        model = LlamaModel(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.fill_(1.0) if "norm" in name else p.normal_(0.0, std)
    return model.to(dtype).eval()


def random_prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(17, vocab, (n, length), generator=gen).tolist()


def run_requests(engine: LLMEngine, prompts: list[list[int]], max_tokens: int) -> dict:
    """All submitted at once, greedy, ignore_eos; until the last finishes."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    steps = engine.num_steps
    t0 = time.perf_counter()
    for i, p in enumerate(prompts):
        engine.add_request(f"r{steps}-{i}", p, params)
    tokens = 0
    ttfts: list[float] = []
    gaps: list[float] = []
    while engine.has_unfinished():
        for out in engine.step():
            tokens += out.token_id is not None
            if out.finish_reason is not None:
                ttfts.append(out.ttft)
                gaps += out.inter_token_times or []
    wall = time.perf_counter() - t0
    return {"requests": len(prompts), "output_tokens": tokens, "wall_s": wall, "tokens_per_second": tokens / wall,
            "steps": engine.num_steps - steps, "ttft_p50_s": pct(ttfts, 50), "itl_p50_s": pct(gaps, 50),
            "itl_p99_s": pct(gaps, 99)}


def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q / 100 * (len(ordered) - 1))))]


# --- phases -------------------------------------------------------------------------------------

def kernel_check(device: str) -> dict:
    """One ragged step (decode rows, a fresh chunk, a chunk after a cached prefix; block 16, GQA 4)
    through the Triton kernels on the device and through the twin in float32 on the CPU."""
    from fairway.models.triton_attention import TritonAttention  # imports triton

    gen = torch.Generator().manual_seed(0)
    hkv, group, d, bs = (2, 4, 16, 16) if TINY else (8, 4, 64, 16)
    decode_lens, chunks = ([1, 17, 40], [(0, 9), (20, 13)]) if TINY else ([1, 17, 300, 1000], [(0, 200), (513, 77)])
    seqs = [(n - 1, 1) for n in decode_lens] + chunks
    need = [-(-(p + n) // bs) for p, n in seqs]
    num_blocks = sum(need) + 1
    order = torch.randperm(num_blocks, generator=gen)
    tables = torch.zeros(len(seqs), max(need), dtype=torch.int32)
    slots, used = [], 0
    for s, ((prefix, new), blocks) in enumerate(zip(seqs, need, strict=True)):
        tables[s, :blocks] = order[used:used + blocks]
        used += blocks
        slots += [int(tables[s, p // bs]) * bs + p % bs for p in range(prefix, prefix + new)]
    t, nd = len(slots), len(decode_lens)
    starts = [nd]
    for _, new in chunks:
        starts.append(starts[-1] + new)

    def batch_on(dev: str) -> BlockTableBatch:
        i32 = {"dtype": torch.int32, "device": dev}
        return BlockTableBatch(torch.tensor(slots, device=dev), nd, tables[:nd].to(dev), torch.tensor(decode_lens, **i32),
                               torch.tensor(starts, **i32), torch.tensor([p + n for p, n in chunks], **i32),
                               tables[nd:].to(dev), max(n for _, n in chunks), bs)

    result = {}
    for dtype in (torch.float32, torch.float16) if TINY else (torch.bfloat16, torch.float16):
        q, k, v = (torch.randn(t, h, d, generator=gen).to(dtype) for h in (hkv * group, hkv, hkv))
        cache = [torch.randn(hkv, num_blocks * bs, d, generator=gen).to(dtype) for _ in range(2)]
        outs = []
        for backend, dev, cast in ((TritonAttention, device, dtype), (TorchBlockAttention, "cpu", torch.float32)):
            kc, vc = (c.to(dev, cast) for c in cache)
            att = backend(batch_on(dev))
            att.write_kv(k.to(dev, cast), v.to(dev, cast), kc, vc)
            outs.append(att.attention(q.to(dev, cast), kc, vc, d ** -0.5).float().cpu())
        err = (outs[0] - outs[1]).abs().max().item()
        result[str(dtype).removeprefix("torch.")] = {"max_abs_error": err, "ok": err < 3e-2}
    return result


def engine_check(device: str) -> dict:
    """A small random model's greedy tokens, float32: the GPU runner against the CPU runner."""
    from fairway.models.triton_attention import TritonAttention

    cfg = TINY_CFG if TINY else SMALL
    n, tokens = (3, 4) if TINY else (16, 32)
    config = EngineConfig(num_kv_blocks=256, max_num_seqs=16, max_num_batched_tokens=256)
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(17, cfg.vocab_size, (int(m),), generator=gen).tolist()
               for m in torch.randint(3, 24 if TINY else 300, (n,), generator=gen)]
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    want = LLMEngine(random_model(cfg, seed=0), config).generate(prompts, params)
    got = gpu_engine(random_model(cfg, seed=0, device=device), config, TritonAttention).generate(prompts, params)
    same = sum(a == b for a, b in zip(got, want, strict=True))
    first = [next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), None)
             for a, b in zip(got, want, strict=True)]
    return {"sequences": n, "identical": same, "first_difference": [f for f in first if f is not None],
            "ok": same == n}


def hf_generate(cfg: LlamaConfig, device: str, batch: int, prompt: int, new: int) -> dict:
    """transformers' generate on random weights of the same shape: static batch, greedy, every
    row runs all `new` tokens."""
    from transformers import LlamaConfig as HFConfig
    from transformers import LlamaForCausalLM

    hf_cfg = HFConfig(vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
                      num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads,
                      num_key_value_heads=cfg.num_kv_heads, head_dim=cfg.head_dim, rope_theta=cfg.rope_theta,
                      max_position_embeddings=cfg.max_position_embeddings, tie_word_embeddings=True)
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(hf_cfg).to(torch.float32 if TINY else torch.bfloat16).eval()
    ids = torch.tensor(random_prompts(batch, prompt, cfg.vocab_size, seed=7), device=device)

    @torch.inference_mode()
    def generate(rows: int, n: int) -> torch.Tensor:
        return model.generate(input_ids=ids[:rows], attention_mask=torch.ones_like(ids[:rows]), do_sample=False,
                              max_new_tokens=n, min_new_tokens=n, pad_token_id=0, eos_token_id=None)

    generate(2, 4)  # warm-up
    sync()
    t0 = time.perf_counter()
    out = generate(batch, new)
    sync()
    wall = time.perf_counter() - t0
    produced = (out.shape[1] - prompt) * batch
    return {"batch": batch, "output_tokens": produced, "wall_s": wall, "tokens_per_second": produced / wall}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tiny", action="store_true", help="tiny shapes on the CPU: a smoke run of the script")
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    if not TINY and not torch.cuda.is_available():
        sys.exit("bench/gpu.py: no CUDA device here (use --tiny for the CPU smoke run)")
    device = "cpu" if TINY else "cuda"
    torch.backends.cuda.matmul.allow_tf32 = False
    res: dict = {"tiny": TINY, "timestamp": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
                 "machine": machine.describe() | {"torch": torch.__version__, "gpu": _gpu_name()}, "targets": TARGETS}

    def phase(name: str, fn):
        log(f"{name} ...")
        try:
            res[name] = fn()
        except Exception as exc:  # one phase failing still leaves the others' figures
            res[name] = {"error": f"{type(exc).__name__}: {exc}"}
        log(f"{name}: {json.dumps(res[name])[:300]}")

    phase("kernels", lambda: kernel_check(device))
    phase("engine_vs_cpu", lambda: engine_check(device))

    cfg = TINY_CFG if TINY else LLAMA_1B
    n, prompt, new = (8, 32, 16) if TINY else (256, 512, 256)
    ttft_len, itl_levels = (64, (4, 8)) if TINY else (2000, (32, 225))
    config = EngineConfig(num_kv_blocks=256 if TINY else 16384, max_num_seqs=n, max_num_batched_tokens=8192,
                          max_model_len=4096, speculative=None)
    res["engine_config"] = {k: v for k, v in vars(config).items() if k != "speculative"} | {"speculative": None}
    log("building the Llama-3.2-1B-shaped engine (weights, KV cache, graph capture) ...")
    t0 = time.perf_counter()
    model = random_on_device(cfg, torch.float32 if TINY else torch.bfloat16, device)
    engine = gpu_engine(model, config)
    res["engine_build_s"] = time.perf_counter() - t0
    run_requests(engine, random_prompts(4, 64, cfg.vocab_size, seed=1), 8)  # warm-up: the prefill kernel compiles
    phase("throughput", lambda: run_requests(engine, random_prompts(n, prompt, cfg.vocab_size, seed=2), new))

    def ttft() -> dict:
        times = [run_requests(engine, random_prompts(1, ttft_len, cfg.vocab_size, seed=10 + i), 1)["ttft_p50_s"]
                 for i in range(5)]
        return {"prompt_tokens": ttft_len, "ttft_s": times, "median_s": statistics.median(times)}

    phase("ttft", ttft)
    for level in itl_levels:
        phase(f"itl_{level}", lambda level=level: run_requests(
            engine, random_prompts(level, prompt, cfg.vocab_size, seed=100 + level), new))
    engine = model = None  # the card's memory to transformers
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    if not args.skip_hf:
        phase("hf_generate", lambda: hf_generate(cfg, device, n, prompt, new))
    res["total_s"] = time.perf_counter() - T0
    print_table(res, n, prompt, new, ttft_len, itl_levels)
    out = args.out or RESULTS / ("gpu_tiny.json" if TINY else "gpu.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=2) + "\n")
    log(f"wrote {out}")


def _gpu_name() -> str | None:
    return torch.cuda.get_device_name() if torch.cuda.is_available() else None


def print_table(res: dict, n: int, prompt: int, new: int, ttft_len: int, itl_levels: tuple[int, int]) -> None:
    def get(phase: str, key: str):
        value = res.get(phase, {}).get(key)
        return "error" if "error" in res.get(phase, {}) else value

    def fmt(x, scale: float = 1.0, unit: str = "") -> str:
        return x if isinstance(x, str) else "-" if x is None else f"{x * scale:,.1f}{unit}"

    tput, hf = get("throughput", "tokens_per_second"), get("hf_generate", "tokens_per_second")
    ratio = f"{tput / hf:.2f}x" if isinstance(tput, float) and isinstance(hf, float) else "-"
    kernels = res.get("kernels", {})
    rows = [
        ("kernels vs twin (max abs err)", ", ".join(f"{k} {v['max_abs_error']:.1e}" for k, v in kernels.items()
                                                    if isinstance(v, dict)) or str(kernels.get("error")), ""),
        ("greedy tokens vs CPU runner", f"{get('engine_vs_cpu', 'identical')}/{get('engine_vs_cpu', 'sequences')}", "all"),
        (f"tokens/s, {n} x ({prompt} + {new})", fmt(tput), f">= {TARGETS['tokens_per_second']:,}"),
        (f"transformers generate, batch {n}", f"{fmt(hf)} (Fairway {ratio})", ""),
        (f"TTFT, {ttft_len:,}-token prompt", fmt(get("ttft", "median_s"), 1000, " ms"), "<= 15 ms"),
        (f"ITL p50 / p99 at {itl_levels[0]}", f"{fmt(get(f'itl_{itl_levels[0]}', 'itl_p50_s'), 1000)} / "
                                              f"{fmt(get(f'itl_{itl_levels[0]}', 'itl_p99_s'), 1000, ' ms')}", ""),
        (f"ITL p50 / p99 at {itl_levels[1]}", f"{fmt(get(f'itl_{itl_levels[1]}', 'itl_p50_s'), 1000)} / "
                                              f"{fmt(get(f'itl_{itl_levels[1]}', 'itl_p99_s'), 1000, ' ms')}", "p99 <= 30 ms"),
    ]
    print(f"\nbench/gpu.py on {res['machine']['gpu'] or 'the CPU (--tiny: figures meaningless)'}, "
          f"{res['total_s']:.0f} s")
    for name, value, target in rows:
        print(f"  {name:34} {value:32} {target}")


if __name__ == "__main__":
    main()
