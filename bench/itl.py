"""Inter-token latency under load: the engine with each step's time bounded vs bounded by tokens
alone (the 512-token budget), side by side in one run.

N chats (default 64) arrive at once, as in relay.py's model part: distinct ~90-token chat prompts,
128 tokens each (ignore_eos, greedy), on the bundled model (bf16, CPU), stepped in this process
(no HTTP: the engine's own timing). Reported per configuration: inter-token latency p50/p99 over
every interval of every reply, TTFT p50/p99, aggregate tokens/s (all tokens over the wall time
from the first submission to the last token). Each configuration runs --repeats times, the order
rotating; figures are medians over the repeats, ratios are after / before.

    .venv/bin/python bench/itl.py                 # ~3 min on 2 cores
    .venv/bin/python bench/itl.py --chats 16 --repeats 1
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import machine  # noqa: E402  (bench/machine.py: this script's folder is on the path)
from engine_vs_hf import CpuMeter  # noqa: E402

from fairway.engine.factory import build_engine  # noqa: E402
from fairway.engine.llm_engine import EngineConfig, LLMEngine  # noqa: E402
from fairway.engine.sampling_params import SamplingParams  # noqa: E402
from fairway.server_gc import settle_heap  # noqa: E402

RESULTS = ROOT / "bench" / "results"
TARGETS = {"itl_p99_over_p50": 2.0, "tokens_per_s_min_ratio": 0.9, "ttft_p50_max_ratio": 1.25}
TOPICS = ["the ocean", "volcanoes", "the moon", "bread baking", "jazz", "chess", "honey bees", "glaciers",
          "the printing press", "electric cars", "coral reefs", "the violin"]


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def chat_prompts(tok, n: int, start: int = 0) -> list[list[int]]:
    """n distinct chat prompts, numbered from `start` (past the chat template's system block they
    share no prefix with other numbers, so the prefix cache never skips a prefill)."""
    out = []
    for i in range(start, start + n):
        topic = TOPICS[i % len(TOPICS)]
        text = (f"Request {i}: I am preparing a short talk for my local library club next week. Please write a "
                f"friendly, detailed explanation of {topic} for an audience of curious adults, with a few "
                f"surprising facts and one practical tip they can remember afterwards.")
        out.append(tok.chat_prompt_ids([{"role": "user", "content": text}]))
    return out


def run(eng: LLMEngine, prompts: list[list[int]], max_tokens: int, tag: str) -> dict[str, float]:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    t0 = time.perf_counter()
    for i, p in enumerate(prompts):
        eng.add_request(f"{tag}-{i}", p, params)
    itl: list[float] = []
    ttft: list[float] = []
    tokens = 0
    while eng.has_unfinished():
        for out in eng.step():
            tokens += out.token_id is not None
            if out.finished:
                itl += out.inter_token_times or []
                ttft.append(out.ttft)
    wall = time.perf_counter() - t0
    a, t = np.array(itl), np.array(ttft)
    return {"itl_p50_s": float(np.percentile(a, 50)), "itl_p99_s": float(np.percentile(a, 99)),
            "ttft_p50_s": float(np.percentile(t, 50)), "ttft_p99_s": float(np.percentile(t, 99)),
            "tokens_per_s": tokens / wall, "wall_s": wall}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--chats", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=0,
                    help="torch threads (0: its default); 1 steadies ratios on a crowded machine")
    ap.add_argument("--out", type=Path, default=RESULTS / "itl.json")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    base = build_engine(dtype="bfloat16", config=EngineConfig(num_kv_blocks=2048, bound_step_time=False))
    engines = {"tokens_only": base,
               "step_time_bounded": LLMEngine(base.model, EngineConfig(num_kv_blocks=2048, bound_step_time=True),
                                                 tokenizer=base.tokenizer)}
    # each run its own prompts: a repeat of the same ones would find them in the prefix cache
    prompts = [chat_prompts(base.tokenizer, args.chats, (1 + i) * args.chats) for i in range(2 * args.repeats)]
    log(f"{args.chats} chats, prompts {min(map(len, prompts[0]))}-{max(map(len, prompts[0]))} tokens, "
        f"{args.max_tokens} tokens each")
    settle_heap()  # as a replica does once its engine is loaded (fairway/server_gc.py)
    for name, eng in engines.items():  # warm-up, and the step-time model's first measurements
        run(eng, chat_prompts(base.tokenizer, 8), 16, f"warm-{name}")
    names = list(engines)
    runs: dict[str, list[dict[str, float]]] = {n: [] for n in names}
    meter = CpuMeter()
    for rep in range(args.repeats):
        for i, n in enumerate(names[rep % 2:] + names[:rep % 2]):
            runs[n].append(run(engines[n], prompts[2 * rep + i], args.max_tokens, f"{n}-{rep}"))
            r = runs[n][-1]
            log(f"repeat {rep + 1} {n}: ITL p50 {1000 * r['itl_p50_s']:.1f} ms p99 {1000 * r['itl_p99_s']:.1f} ms, "
                f"TTFT p50 {r['ttft_p50_s']:.2f} s, {r['tokens_per_s']:.0f} tok/s")
    other_share = meter.other_share()
    medians = {n: {k: statistics.median(r[k] for r in runs[n]) for k in runs[n][0]} for n in names}
    before, after = medians["tokens_only"], medians["step_time_bounded"]
    ratios = {"tokens_per_s": after["tokens_per_s"] / before["tokens_per_s"],
              "ttft_p50": after["ttft_p50_s"] / before["ttft_p50_s"],
              "itl_p99": after["itl_p99_s"] / before["itl_p99_s"]}
    print(f"\n{args.chats} chats x {args.max_tokens} tokens, medians of {args.repeats}")
    print("| engine | ITL p50 | ITL p99 | p99/p50 | TTFT p50 | TTFT p99 | tok/s |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for n in names:
        m = medians[n]
        print(f"| {n} | {1000 * m['itl_p50_s']:.1f} ms | {1000 * m['itl_p99_s']:.1f} ms | "
              f"{m['itl_p99_s'] / m['itl_p50_s']:.2f} | {m['ttft_p50_s']:.2f} s | {m['ttft_p99_s']:.2f} s | "
              f"{m['tokens_per_s']:.0f} |")
    print(f"after/before: tokens/s {ratios['tokens_per_s']:.2f}x, TTFT p50 {ratios['ttft_p50']:.2f}x, "
          f"ITL p99 {ratios['itl_p99']:.2f}x; other processes used {100 * (other_share or 0):.0f}% of the CPUs")
    result = {
        "timestamp": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "machine": machine.describe(), "other_processes_cpu_share": other_share,
        "args": {k: str(v) for k, v in vars(args).items()}, "targets": TARGETS,
        "medians": medians, "runs": runs, "ratios_after_over_before": ratios,
        "step_cost_after": vars(engines["step_time_bounded"].step_time.cost),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    log(f"wrote {args.out}")


if __name__ == "__main__":
    main()
