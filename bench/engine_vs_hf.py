"""Fairway engine vs Hugging Face transformers `generate`, same model (SmolLM2-135M, bf16), same CPU.

One run measures:
  1. throughput: 64 requests submitted at once (random prompts of 32..512 tokens, 16..256 output
     tokens, ignore_eos), Fairway's continuous batching vs `generate` in static batches of 16 and 64;
  2. KV utilization at peak: live tokens / allocated slots at the step that held the most slots;
  3. overhead: share of step() time spent outside the model forward, over pure-decode steps at
     batch 64 (and over the whole run, for reference);
  4. TTFT of a 1,536+32-token prompt whose 1,536-token prefix is cached vs the same length cold.

    .venv/bin/python bench/engine_vs_hf.py            # full run (several minutes on 2 cores)
    .venv/bin/python bench/engine_vs_hf.py --quick    # smoke run: 16 requests, short prompts
    .venv/bin/python bench/engine_vs_hf.py --profile  # also torch.profiler over decode steps at batch 64

Figures go to bench/results/engine_vs_hf.json (engine_vs_hf_quick.json for --quick).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import random
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import machine  # noqa: E402  (bench/machine.py: this script's folder is on the path)

from fairway.engine.factory import build_engine  # noqa: E402
from fairway.engine.llm_engine import EngineConfig, LLMEngine  # noqa: E402
from fairway.engine.sampling_params import SamplingParams  # noqa: E402
from fairway.models.bundled import bundled_model_path  # noqa: E402
from fairway.models.precision import compute_dtype  # noqa: E402
from fairway.models.weights import WEIGHTS  # noqa: E402
from fairway.server_gc import settle_heap  # noqa: E402

RESULTS = ROOT / "bench" / "results"
FIRST_ORDINARY_ID = 17  # ids below this are SmolLM2's special tokens
SEED = 1234

TARGETS = {"speedup_vs_hf": 4.0, "kv_utilization_at_peak": 0.90, "ttft_cached_speedup": 5.0,
           "overhead_share": 0.15}


@dataclass
class Workload:
    prompts: list[list[int]]
    output_lens: list[int]

    @property
    def prompt_tokens(self) -> int:
        return sum(map(len, self.prompts))

    @property
    def output_tokens(self) -> int:
        return sum(self.output_lens)


def make_workload(n: int, prompt_range: tuple[int, int], output_range: tuple[int, int], vocab: int,
                  seed: int = SEED) -> Workload:
    rng = random.Random(seed)
    lens = [rng.randint(*prompt_range) for _ in range(n)]
    prompts = [[rng.randrange(FIRST_ORDINARY_ID, vocab) for _ in range(k)] for k in lens]
    out_rng = random.Random(seed + 1)
    return Workload(prompts, [out_rng.randint(*output_range) for _ in range(n)])


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


# --- CPU contention -----------------------------------------------------------------------------
# On a small shared machine another busy process ruins CPU timings (two OpenMP pools on 2 cores
# make every kernel spin-wait), so each phase records how much of the machine others used.

def _cpu_ticks() -> tuple[int, int, int] | None:
    """(busy ticks of the whole machine, total ticks, ticks used by this process)."""
    try:
        fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
        own = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, ValueError, IndexError):
        return None
    total = sum(fields[:8])  # user nice system idle iowait irq softirq steal
    idle = fields[3] + fields[4]
    return total - idle, total, int(own[11]) + int(own[12])  # utime + stime


class CpuMeter:
    """Share of all cores' time that other processes used between start and stop."""

    def __init__(self) -> None:
        self.start = _cpu_ticks()

    def other_share(self) -> float | None:
        end = _cpu_ticks()
        if self.start is None or end is None or end[1] == self.start[1]:
            return None
        busy, total, own = (e - s for e, s in zip(end, self.start, strict=True))
        return max(0.0, (busy - own) / total)


def wait_for_quiet(max_wait: float, threshold: float = 0.10) -> float | None:
    """Wait (up to max_wait seconds) until others use under `threshold` of the CPUs for 3 s running."""
    deadline = time.monotonic() + max_wait
    warned = False
    while True:
        m = CpuMeter()
        time.sleep(3)
        share = m.other_share()
        if share is None or share < threshold or time.monotonic() >= deadline:
            if share is not None and share >= threshold:
                log(f"warning: other processes use {100 * share:.0f}% of the CPUs; timings will be skewed")
            return share
        if not warned:
            log(f"other processes use {100 * share:.0f}% of the CPUs; waiting up to {max_wait:.0f}s for quiet")
            warned = True


# --- Fairway ------------------------------------------------------------------------------------

def pure_decode(eng: LLMEngine) -> bool:
    """True when the next step is decode only: nothing waiting, every running sequence needs 1 token.

    Reads scheduler internals: EngineStats does not say whether a step carried prefill tokens.
    """
    sched = eng.scheduler
    return sched.num_waiting == 0 and all(s.num_tokens - s.num_computed_tokens == 1 for s in sched.running)


def run_engine(eng: LLMEngine, wl: Workload, batch: int) -> dict:
    """Submit every request at once and step to completion, sampling stats after each step."""
    before = eng.stats()
    t0 = time.perf_counter()
    for i, (prompt, n) in enumerate(zip(wl.prompts, wl.output_lens, strict=True)):
        eng.add_request(f"w{i}", prompt, greedy(n))
    generated = {f"w{i}": 0 for i in range(len(wl.prompts))}
    ttfts: list[float] = []
    samples = []  # (running before, pure decode before, stats after)
    prev = before
    while eng.has_unfinished():
        running, decode = len(eng.scheduler.running), pure_decode(eng)
        for out in eng.step():
            if out.token_id is not None:
                generated[out.request_id] += 1
                if generated[out.request_id] == 1 and out.ttft is not None:
                    ttfts.append(out.ttft)
        st = eng.stats()
        samples.append((running, decode, prev, st))
        prev = st
    wall = time.perf_counter() - t0
    after = prev

    total_out = sum(generated.values())
    if total_out != wl.output_tokens:
        raise RuntimeError(f"engine generated {total_out} tokens, the workload asked for {wl.output_tokens}")
    peak = max(samples, key=lambda s: s[3].kv_slots_used)[3]
    mean_util = statistics.fmean(s[3].kv_utilization for s in samples if s[3].kv_slots_used)
    step_s = after.step_seconds - before.step_seconds
    fwd_s = after.forward_seconds - before.forward_seconds
    at_batch = [(b.step_seconds - a.step_seconds, b.forward_seconds - a.forward_seconds)
                for running, decode, a, b in samples if running == batch and decode]
    batch_step = sum(s for s, _ in at_batch)
    decode_only = [(running, b.step_seconds - a.step_seconds) for running, decode, a, b in samples if decode]
    decode_s = sum(t for _, t in decode_only)
    batch_fwd = sum(f for _, f in at_batch)
    return {
        "wall_seconds": wall,
        "output_tokens": total_out,
        "tokens_per_second": total_out / wall,
        "num_steps": after.num_steps - before.num_steps,
        "num_preemptions": after.num_preemptions - before.num_preemptions,
        "ttft_median_seconds": statistics.median(ttfts),
        "kv_peak": {"kv_blocks_used": peak.kv_blocks_used, "kv_slots_used": peak.kv_slots_used,
                    "kv_tokens_live": peak.kv_tokens_live, "kv_utilization": peak.kv_utilization,
                    "kv_blocks_total": peak.kv_blocks_total},
        "kv_utilization_mean_over_steps": mean_util,
        "overhead_whole_run": {"step_seconds": step_s, "forward_seconds": fwd_s,
                               "share_outside_forward": 1 - fwd_s / step_s if step_s else None,
                               "outside_step_seconds": wall - step_s},
        "step_time_split": {  # where the wall time went: steps carrying prompt tokens vs decode only
            "prefill_steps": len(samples) - len(decode_only), "prefill_step_seconds": step_s - decode_s,
            "decode_only_steps": len(decode_only), "decode_only_step_seconds": decode_s,
            "decode_only_mean_batch": statistics.fmean(r for r, _ in decode_only) if decode_only else None},
        "overhead_decode_at_batch": {
            "batch": batch, "steps": len(at_batch), "step_seconds": batch_step, "forward_seconds": batch_fwd,
            "share_outside_forward": 1 - batch_fwd / batch_step if at_batch else None,
            "mean_step_ms": 1000 * batch_step / len(at_batch) if at_batch else None},
    }


def decode_probe(eng: LLMEngine, wl: Workload, steps: int, profile_steps: int, profile_path: Path | None) -> dict:
    """All requests of the workload with long outputs: once every one is decoding, time `steps` steps
    (and optionally profile a few more), then abort them all."""
    n = len(wl.prompts)
    for i, prompt in enumerate(wl.prompts):
        eng.add_request(f"p{i}", prompt, greedy(4096))
    while not (len(eng.scheduler.running) == n and pure_decode(eng)):
        eng.step()
    a = eng.stats()
    for _ in range(steps):
        eng.step()
    b = eng.stats()
    result = {"batch": n, "steps": steps, "step_seconds": b.step_seconds - a.step_seconds,
              "forward_seconds": b.forward_seconds - a.forward_seconds}
    result["share_outside_forward"] = 1 - result["forward_seconds"] / result["step_seconds"]
    result["mean_step_ms"] = 1000 * result["step_seconds"] / steps
    if profile_path is not None and profile_steps:
        from torch.profiler import ProfilerActivity, profile
        with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
            for _ in range(profile_steps):
                eng.step()
        by_op = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30)
        by_shape = prof.key_averages(group_by_input_shape=True).table(sort_by="self_cpu_time_total", row_limit=25)
        profile_path.write_text(f"torch.profiler: {profile_steps} pure-decode steps at batch {n}\n\n"
                                f"{by_op}\n\nBy input shape:\n{by_shape}\n")
        result["profile"] = str(profile_path.relative_to(ROOT))
    for i in range(n):
        eng.abort(f"p{i}")
    while eng.has_unfinished():
        eng.step()
    return result


def ttft_cached_vs_cold(eng: LLMEngine, vocab: int, prefix_len: int, suffix_len: int, reps: int) -> dict:
    """Per repetition, a fresh random prefix: one request cold, then one sharing the prefix."""
    rng = random.Random(SEED + 2)

    def one(rid: str, prompt: list[int]) -> tuple[float, int]:
        eng.add_request(rid, prompt, greedy(1))
        ttft, cached = None, 0
        while eng.has_unfinished():
            for out in eng.step():
                if out.request_id == rid and ttft is None and out.token_id is not None:
                    ttft, cached = out.ttft, out.num_cached_tokens
        return ttft, cached

    def tokens(k: int) -> list[int]:
        return [rng.randrange(FIRST_ORDINARY_ID, vocab) for _ in range(k)]

    runs = []
    for r in range(reps):
        prefix = tokens(prefix_len)
        cold, cold_cached = one(f"cold{r}", prefix + tokens(suffix_len))
        warm, warm_cached = one(f"warm{r}", prefix + tokens(suffix_len))
        runs.append({"cold_seconds": cold, "cached_seconds": warm, "ratio": cold / warm,
                     "cold_cached_tokens": cold_cached, "warm_cached_tokens": warm_cached})
    return {"prefix_tokens": prefix_len, "suffix_tokens": suffix_len, "runs": runs,
            "cold_median_seconds": statistics.median(r["cold_seconds"] for r in runs),
            "cached_median_seconds": statistics.median(r["cached_seconds"] for r in runs),
            "ratio_median": statistics.median(r["ratio"] for r in runs)}


# --- transformers -------------------------------------------------------------------------------

def load_hf():
    """The same bf16-rounded weights, multiplied in the same dtype as Fairway's on this CPU
    (float32 where bf16 matmuls are emulated: fairway/models/precision.py), so the two compare
    as engines, not as precisions."""
    from transformers import AutoModelForCausalLM
    p = bundled_model_path()
    model = AutoModelForCausalLM.from_pretrained(str(p.parent), gguf_file=p.name, dtype=torch.bfloat16)
    return model.to(compute_dtype(torch.bfloat16, "cpu")).eval()


@torch.inference_mode()
def hf_generate(model, prompts: list[list[int]], new_tokens: int, pad_id: int) -> torch.Tensor:
    width = max(map(len, prompts))
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, p in enumerate(prompts):  # left padding
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    out = model.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=new_tokens,
                         min_new_tokens=new_tokens, pad_token_id=pad_id, eos_token_id=pad_id)
    return out[:, width:]


def run_hf(model, wl: Workload, batch_size: int, pad_id: int) -> dict:
    """Static batches in submission order; a batch runs until its longest request is done."""
    t0 = time.perf_counter()
    computed = 0
    for start in range(0, len(wl.prompts), batch_size):
        prompts = wl.prompts[start:start + batch_size]
        n = max(wl.output_lens[start:start + batch_size])
        out = hf_generate(model, prompts, n, pad_id)
        if out.shape[1] != n:
            raise RuntimeError(f"generate returned {out.shape[1]} tokens per row, expected {n}")
        computed += out.numel()
        log(f"  hf batch {batch_size}: requests {start}..{start + len(prompts) - 1} done "
            f"({time.perf_counter() - t0:.1f}s)")
    wall = time.perf_counter() - t0
    useful = wl.output_tokens  # each request's own requested tokens; the rest of each row is waste
    return {"batch_size": batch_size, "wall_seconds": wall, "useful_output_tokens": useful,
            "computed_output_tokens": computed, "tokens_per_second": useful / wall}


# --- report -------------------------------------------------------------------------------------

def machine_info() -> dict:
    import transformers
    return machine.describe() | {"torch_threads": torch.get_num_threads(), "torch_version": torch.__version__,
                                 "transformers_version": transformers.__version__}


def loadavg() -> list[float] | None:
    try:
        return list(os.getloadavg())
    except OSError:
        return None


def fmt_pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def print_table(res: dict) -> None:
    eng, hf_best, ttft = res["fairway"], res["hf_best"], res["ttft"]
    ov = res["overhead"]
    hf_tps = hf_best["tokens_per_second"] if hf_best else None

    def vs_hf(tps: float) -> str:
        return f"{tps / hf_tps:.2f}x" if hf_tps else "-"
    rows = [("system", "tokens/s", "x HF best", "KV util @peak", "TTFT cold/cached", "overhead outside fwd")]
    rows.append(("fairway", f"{eng['tokens_per_second']:.1f}", vs_hf(eng["tokens_per_second"]),
                 fmt_pct(eng["kv_peak"]["kv_utilization"]),
                 f"{ttft['ratio_median']:.1f}x ({1000 * ttft['cold_median_seconds']:.0f}/"
                 f"{1000 * ttft['cached_median_seconds']:.0f} ms)",
                 f"{fmt_pct(ov['share_outside_forward'])} ({ov['source']})"))
    for h in res["hf"]:
        rows.append((f"hf generate b={h['batch_size']}", f"{h['tokens_per_second']:.1f}",
                     vs_hf(h["tokens_per_second"]), "-", "-", "-"))
    rows.append(("target", "", f">= {TARGETS['speedup_vs_hf']:.0f}x", f">= {100 * TARGETS['kv_utilization_at_peak']:.0f}%",
                 f">= {TARGETS['ttft_cached_speedup']:.0f}x", f"<= {100 * TARGETS['overhead_share']:.0f}%"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    print()
    for j, r in enumerate(rows):
        print("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)))
        if j == 0:
            print("  ".join("-" * w for w in widths))
    f = res["flops"]
    print(f"\nfloor: {f['params'] / 1e6:.1f}M params x {f['tokens']} tokens (prompt + output) x 2 = "
          f"{f['total_flops'] / 1e12:.2f} TFLOP; fairway {f['fairway_gflops_per_second']:.1f} GFLOP/s"
          + (f", hf best {f['hf_best_gflops_per_second']:.1f} GFLOP/s" if hf_tps else ""))
    print("pass: " + ", ".join(f"{k}={'yes' if v else 'NO'}" for k, v in res["pass"].items()))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="smoke run: 16 requests, prompts 32..128, outputs 16..64")
    ap.add_argument("--profile", action="store_true", help="torch.profiler over a few decode steps at full batch")
    ap.add_argument("--max-batched-tokens", type=int, default=512, help="engine per-step token budget")
    ap.add_argument("--skip-hf", action="store_true", help="engine figures only (no ratio to HF)")
    ap.add_argument("--wait-quiet", type=float, default=120.0,
                    help="before each phase, wait up to this many seconds for other processes to go idle")
    ap.add_argument("--out", type=Path, default=None, help="JSON path (default bench/results/engine_vs_hf*.json)")
    # The engine's serving defaults, one by one, to tell what each costs or gains on this workload
    # (an older revision had none of them).
    ap.add_argument("--weights", choices=list(WEIGHTS), default="auto",
                    help="the bundled GGUF's layers: as stored, with a bf16 copy for many-row steps where "
                         "that pays (auto, the serving default), as stored only (native), or in bf16")
    ap.add_argument("--no-step-time-bound", dest="bound_step_time", action="store_false",
                    help="bound each step by its token budget alone, not by time (scheduler.py)")
    ap.add_argument("--no-speculative", dest="speculative", action="store_false", help="no speculative decoding")
    args = ap.parse_args()

    if args.quick:
        n, prompt_range, output_range, hf_batches = 16, (32, 128), (16, 64), [16]
        ttft_prefix, ttft_reps = 1536, 1
    else:
        n, prompt_range, output_range, hf_batches = 64, (32, 512), (16, 256), [16, 64]
        ttft_prefix, ttft_reps = 1536, 3
    suffix = 32
    started = datetime.datetime.now(datetime.UTC)
    load_start = loadavg()
    contention: dict[str, float | None] = {}  # phase -> share of the CPUs other processes used

    def phase(name: str):
        wait_for_quiet(args.wait_quiet)
        meter = CpuMeter()
        return lambda: contention.__setitem__(name, meter.other_share())

    cfg = EngineConfig(num_kv_blocks=4096, max_num_batched_tokens=args.max_batched_tokens, max_num_seqs=256,
                       bound_step_time=args.bound_step_time)
    if not args.speculative:
        cfg.speculative = None
    log(f"loading engine (bf16, cpu, {args.weights} weights, {cfg.num_kv_blocks} KV blocks, "
        f"{cfg.max_num_batched_tokens} tokens/step, step time bound {'on' if cfg.bound_step_time else 'off'}, "
        f"speculation {'on' if cfg.speculative else 'off'})")
    eng = build_engine(None, "bfloat16", "cpu", cfg, weights=args.weights)
    vocab = eng.model.cfg.vocab_size
    params = eng.model.num_parameters()  # tied embedding counted once
    wl = make_workload(n, prompt_range, output_range, vocab)
    log(f"workload: {n} requests, {wl.prompt_tokens} prompt tokens, {wl.output_tokens} output tokens")

    eng.generate([[100, 200, 300, 400]], greedy(4))  # warm-up
    settle_heap()  # as a replica does once its engine is loaded (fairway/server_gc.py)
    log("fairway: throughput run")
    done = phase("fairway_run")
    fw = run_engine(eng, wl, batch=n)
    done()
    log(f"fairway: {fw['tokens_per_second']:.1f} tok/s in {fw['wall_seconds']:.1f}s, "
        f"{fw['overhead_decode_at_batch']['steps']} pure-decode steps at batch {n}")

    # The headline overhead: pure-decode steps at full batch in the run itself if there are enough,
    # else (the shortest requests finish before the last prefill) a probe that holds the full batch.
    probe = None
    ov_run = fw["overhead_decode_at_batch"]
    if ov_run["steps"] < 5 or args.profile:
        log("fairway: decode probe at full batch" + (" with profiler" if args.profile else ""))
        done = phase("decode_probe")
        probe = decode_probe(eng, wl, steps=5 if args.quick else 10, profile_steps=3 if args.profile else 0,
                             profile_path=RESULTS / ("engine_decode_profile_quick.txt" if args.quick
                                                     else "engine_decode_profile.txt") if args.profile else None)
        done()
        log(f"fairway: probe {probe['mean_step_ms']:.0f} ms/step, "
            f"{fmt_pct(probe['share_outside_forward'])} outside forward")
    if ov_run["steps"] >= 5:
        overhead = {"source": f"run, {ov_run['steps']} decode steps @{n}",
                    "share_outside_forward": ov_run["share_outside_forward"]}
    else:
        overhead = {"source": f"probe, {probe['steps']} decode steps @{n}",
                    "share_outside_forward": probe["share_outside_forward"]}

    log("fairway: TTFT cached vs cold")
    done = phase("ttft")
    ttft = ttft_cached_vs_cold(eng, vocab, ttft_prefix, suffix, ttft_reps)
    done()
    log(f"fairway: TTFT cold {1000 * ttft['cold_median_seconds']:.0f} ms, "
        f"cached {1000 * ttft['cached_median_seconds']:.0f} ms, ratio {ttft['ratio_median']:.1f}x")
    del eng

    hf_results = []
    if not args.skip_hf:
        log("hf: loading model")
        model = load_hf()
        pad_id = model.generation_config.eos_token_id
        if isinstance(pad_id, list):
            pad_id = pad_id[0]
        hf_generate(model, [[100, 200, 300, 400]], 4, pad_id)  # warm-up
        for bs in hf_batches:
            log(f"hf: generate, static batches of {bs}")
            done = phase(f"hf_b{bs}")
            h = run_hf(model, wl, bs, pad_id)
            done()
            log(f"hf b={bs}: {h['tokens_per_second']:.1f} tok/s in {h['wall_seconds']:.1f}s")
            hf_results.append(h)
    hf_best = max(hf_results, key=lambda h: h["tokens_per_second"]) if hf_results else None

    tokens = wl.prompt_tokens + wl.output_tokens
    total_flops = 2 * params * tokens
    res = {
        "timestamp": started.isoformat(timespec="seconds"),
        "mode": "quick" if args.quick else "full",
        "machine": machine_info() | {"loadavg_start": load_start, "loadavg_end": loadavg(),
                                    "other_processes_cpu_share": contention},
        "model": {"name": "SmolLM2-135M-Instruct", "dtype": "bfloat16", "device": "cpu", "params": params,
                  "compute_dtype": str(compute_dtype(torch.bfloat16, "cpu")).removeprefix("torch.")},
        "engine_config": {"num_kv_blocks": cfg.num_kv_blocks, "block_size": cfg.block_size,
                          "max_num_batched_tokens": cfg.max_num_batched_tokens, "max_num_seqs": cfg.max_num_seqs,
                          "enable_prefix_caching": cfg.enable_prefix_caching, "weights": args.weights,
                          "bound_step_time": cfg.bound_step_time, "speculative": cfg.speculative is not None},
        "workload": {"requests": n, "prompt_len_range": prompt_range, "output_len_range": output_range,
                     "seed": SEED, "prompt_tokens": wl.prompt_tokens, "output_tokens": wl.output_tokens,
                     "prompt_lens": [len(p) for p in wl.prompts], "output_lens": wl.output_lens},
        "fairway": fw,
        "decode_probe": probe,
        "overhead": overhead,
        "ttft": ttft,
        "hf": hf_results,
        "hf_best": hf_best,
        "speedup_vs_hf_best": fw["tokens_per_second"] / hf_best["tokens_per_second"] if hf_best else None,
        "flops": {"params": params, "tokens": tokens, "total_flops": total_flops,
                  "formula": "2 * params * (prompt + output tokens); ignores attention and HF's padding waste",
                  "fairway_gflops_per_second": total_flops / fw["wall_seconds"] / 1e9,
                  "hf_best_gflops_per_second": total_flops / hf_best["wall_seconds"] / 1e9 if hf_best else None},
        "targets": TARGETS,
    }
    res["pass"] = {
        "speedup_vs_hf": hf_best is not None and res["speedup_vs_hf_best"] >= TARGETS["speedup_vs_hf"],
        "kv_utilization_at_peak": fw["kv_peak"]["kv_utilization"] >= TARGETS["kv_utilization_at_peak"],
        "ttft_cached_speedup": ttft["ratio_median"] >= TARGETS["ttft_cached_speedup"],
        "overhead_share": overhead["share_outside_forward"] <= TARGETS["overhead_share"],
    }
    print_table(res)
    busy = {k: v for k, v in contention.items() if v is not None and v > 0.05}
    if busy:
        print("warning: other processes were busy during " + ", ".join(
            f"{k} ({100 * v:.0f}% of the CPUs)" for k, v in busy.items()) + "; those figures are skewed")
    out = args.out or RESULTS / ("engine_vs_hf_quick.json" if args.quick else "engine_vs_hf.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=2) + "\n")
    log(f"wrote {out.relative_to(ROOT) if out.is_relative_to(ROOT) else out}")


if __name__ == "__main__":
    main()
