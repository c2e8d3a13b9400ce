"""Speculative decoding on one stream: speculation on vs off, side by side in one run.

Two workloads on the bundled SmolLM2-135M-Instruct (bf16, CPU), one request at a time, greedy:
* input-grounded: the reply repeats, edits or quotes a text given in the prompt (prompt lookup's
  case: its drafts are the prompt's own tokens);
* free chat: open questions whose replies quote nothing (where speculation must cost nothing).

Each prompt runs on every engine in turn (the order rotating per repeat), so a noisy neighbour
slows them alike; tokens/s is generated tokens over the wall time from submission to the last
token. Figures are medians over the repeats of each workload's tokens/s; the ratio column is the
median of the per-repeat ratios. Greedy output is checked to be the same on every engine.

    .venv/bin/python bench/spec_decode.py                 # ~4 min on 2 cores
    .venv/bin/python bench/spec_decode.py --draft-layers 8 --repeats 1 --max-tokens 64
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import machine  # noqa: E402  (bench/machine.py: this script's folder is on the path)
from engine_vs_hf import CpuMeter  # noqa: E402

from fairway.engine.factory import build_engine  # noqa: E402
from fairway.engine.llm_engine import EngineConfig, LLMEngine  # noqa: E402
from fairway.engine.sampling_params import SamplingParams  # noqa: E402
from fairway.engine.spec_decode.config import SpeculativeConfig  # noqa: E402
from fairway.models.weights import WEIGHTS  # noqa: E402
from fairway.server_gc import settle_heap  # noqa: E402

RESULTS = ROOT / "bench" / "results"
TARGETS = {"grounded_speedup": 1.8, "free_chat_max_loss": 0.03}

ARTICLE = (
    "The city council voted on Tuesday to expand the bicycle lane network by 40 kilometres over the next "
    "three years. The plan, which costs 12 million euros, adds protected lanes on the four main avenues and "
    "connects the university campus with the central train station. Council member Ana Ruiz said the "
    "project would cut car traffic in the centre by a fifth. Local shop owners asked for more delivery "
    "zones, and the council agreed to review parking rules before construction begins in March.")
CODE = (
    "def total_price(items, tax_rate):\n"
    "    subtotal = 0\n"
    "    for item in items:\n"
    "        subtotal += item.price * item.quantity\n"
    "    tax = subtotal * tax_rate\n"
    "    return subtotal + tax\n")
GROUNDED = [
    f"Correct the spelling in this text and return the whole corrected text:\n\n{ARTICLE.replace('the', 'teh', 3)}",
    f"{ARTICLE}\n\nQuote, word for word, the two sentences of this article about the plan's cost and route.",
    f"{CODE}\nRename the variable subtotal to net_total and return the complete function.",
    f"Summarise this article in three sentences, reusing its own wording:\n\n{ARTICLE}",
    f"{ARTICLE}\n\nWhat did the shop owners ask for? Answer with a quote from the article.",
]
FREE = [
    "Tell me a short story about a lighthouse keeper who finds a message in a bottle.",
    "What are some good habits for staying focused while studying?",
    "Explain how a rainbow forms.",
    "Give me three ideas for a birthday party for a ten year old.",
    "Why do cats purr?",
]


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def run_one(eng: LLMEngine, rid: str, prompt: list[int], params: SamplingParams) -> tuple[list[int], float, float]:
    """(tokens, seconds from submission to the last token, seconds to the first token)."""
    t0 = time.perf_counter()
    eng.add_request(rid, prompt, params)
    tokens: list[int] = []
    first = 0.0
    while eng.has_unfinished():
        for out in eng.step():
            if out.token_id is not None:
                if not tokens:
                    first = time.perf_counter() - t0
                tokens.append(out.token_id)
    return tokens, time.perf_counter() - t0, first


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--draft-layers", type=int, default=0,
                    help="also run a draft model: the target's first N layers (0: prompt lookup only)")
    ap.add_argument("--threads", type=int, default=0,
                    help="torch threads (0: its default); 1 steadies ratios on a crowded machine")
    ap.add_argument("--weights", choices=list(WEIGHTS), default="native",
                    help="the bundled GGUF's weights as stored (the default: one stream never reaches the many "
                         "rows auto's bf16 copy takes), as auto, or dequantized to bf16")
    ap.add_argument("--out", type=Path, default=None, help="default: bench/results/spec_decode[_WEIGHTS].json")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    if args.out is None:
        args.out = RESULTS / ("spec_decode.json" if args.weights == "native" else f"spec_decode_{args.weights}.json")
    base = build_engine(dtype="bfloat16", config=EngineConfig(num_kv_blocks=512, speculative=None),
                        weights=args.weights)
    model, tok = base.model, base.tokenizer
    engines = {"off": base,
               "prompt_lookup": LLMEngine(model, EngineConfig(num_kv_blocks=512), tokenizer=tok)}
    if args.draft_layers:
        engines[f"draft_{args.draft_layers}_layers"] = LLMEngine(model, EngineConfig(
            num_kv_blocks=512, speculative=SpeculativeConfig(method="draft_model", draft_num_layers=args.draft_layers)),
            tokenizer=tok)
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    workloads = {"input_grounded": GROUNDED, "free_chat": FREE}
    prompts = {w: [tok.chat_prompt_ids([{"role": "user", "content": q}]) for q in qs] for w, qs in workloads.items()}
    settle_heap()  # as a replica does once its engine is loaded (fairway/server_gc.py)
    for name, eng in engines.items():  # warm-up: kernels, allocator, the step-time model's first steps
        run_one(eng, f"warm-{name}", prompts["free_chat"][0], SamplingParams(temperature=0, max_tokens=16))

    names = list(engines)
    per_rep: dict[str, dict[str, list[float]]] = {w: {n: [] for n in names} for w in workloads}
    identical = True
    detail: dict[str, dict[str, dict[str, float]]] = {w: {n: {"tokens": 0, "seconds": 0.0, "ttft": 0.0,
                                                               "draft_tokens": 0, "accepted": 0, "steps": 0}
                                                           for n in names} for w in workloads}
    meter = CpuMeter()
    for rep in range(args.repeats):
        order = names[rep % len(names):] + names[:rep % len(names)]
        for w, ps in prompts.items():
            rep_tokens = {n: 0 for n in names}
            rep_seconds = {n: 0.0 for n in names}
            for i, p in enumerate(ps):
                outputs = {}
                for n in order:
                    eng = engines[n]
                    before = eng.stats()
                    toks, secs, ttft = run_one(eng, f"{w}-{rep}-{i}-{n}", p, params)
                    after = eng.stats()
                    outputs[n] = toks
                    rep_tokens[n] += len(toks)
                    rep_seconds[n] += secs
                    d = detail[w][n]
                    d["tokens"] += len(toks)
                    d["seconds"] += secs
                    d["ttft"] += ttft
                    d["steps"] += after.num_steps - before.num_steps
                    d["draft_tokens"] += after.spec_decode_num_draft_tokens - before.spec_decode_num_draft_tokens
                    d["accepted"] += after.spec_decode_num_accepted_tokens - before.spec_decode_num_accepted_tokens
                identical &= all(o == outputs["off"] for o in outputs.values())
            for n in names:
                per_rep[w][n].append(rep_tokens[n] / rep_seconds[n])
            log(f"repeat {rep + 1} {w}: " + ", ".join(f"{n} {per_rep[w][n][-1]:.1f} tok/s" for n in names))
    other_share = meter.other_share()

    rows = []
    result_workloads = {}
    for w in workloads:
        result_workloads[w] = {}
        for n in names:
            d = detail[w][n]
            ratios = [on / off for on, off in zip(per_rep[w][n], per_rep[w]["off"], strict=True)]
            entry = {
                "tokens_per_s_median": statistics.median(per_rep[w][n]), "tokens_per_s_each": per_rep[w][n],
                "ratio_vs_off_median": statistics.median(ratios), "ratio_vs_off_each": ratios,
                "acceptance_rate": d["accepted"] / d["draft_tokens"] if d["draft_tokens"] else None,
                "draft_tokens": d["draft_tokens"], "accepted_tokens": d["accepted"],
                "tokens_per_step": d["tokens"] / d["steps"], "output_tokens": d["tokens"],
                "ttft_mean_s": d["ttft"] / (len(prompts[w]) * args.repeats),
            }
            result_workloads[w][n] = entry
            acc = "-" if entry["acceptance_rate"] is None else f"{entry['acceptance_rate']:.2f}"
            rows.append(f"| {w} | {n} | {entry['tokens_per_s_median']:.1f} | {entry['ratio_vs_off_median']:.2f}x "
                        f"| {acc} | {entry['tokens_per_step']:.2f} |")
    print("\n| workload | engine | tok/s (median) | vs off | acceptance | tokens/step |")
    print("| --- | --- | --- | --- | --- | --- |")
    print("\n".join(rows))
    print(f"greedy output identical on every engine: {identical}; "
          f"other processes used {100 * (other_share or 0):.0f}% of the CPUs")
    result = {
        "timestamp": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "machine": machine.describe(), "other_processes_cpu_share": other_share,
        "args": {k: str(v) for k, v in vars(args).items()}, "targets": TARGETS,
        "greedy_identical": identical, "workloads": result_workloads,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    log(f"wrote {args.out}")


if __name__ == "__main__":
    main()
