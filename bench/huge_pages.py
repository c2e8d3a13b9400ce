"""The KV cache and the weights on 2 MB pages vs 4 KB pages (fairway/models/huge_pages.py), side by
side in one process.

Two engines on the bundled model (--weights native, bf16, speculation off), one loaded with
FAIRWAY_HUGE_PAGES=0 (small pages: the KV cache from torch.zeros, each weight where the loader
left it), one as shipped; round by round each runs N distinct ~90-token chat prompts, 128 forced
tokens (greedy), as itl.py does. The figure is the median time of the last 100 decode steps of a
round; the ratio huge / small is taken per round (both engines ran minutes apart at most) and
its median reported. Also the decode attention kernel alone on caches of each kind: 30 layers of
16 sequences x 155 tokens with their blocks scattered over the pool, best of 20 passes.

    .venv/bin/python bench/huge_pages.py               # ~3 min on 2 cores
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
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import machine  # noqa: E402  (bench/machine.py: this script's folder is on the path)
from itl import chat_prompts  # noqa: E402

from fairway.engine.factory import build_engine  # noqa: E402
from fairway.engine.llm_engine import EngineConfig, LLMEngine  # noqa: E402
from fairway.engine.sampling_params import SamplingParams  # noqa: E402
from fairway.models import huge_pages  # noqa: E402
from fairway.models.cpu_kernels import decode_kernels  # noqa: E402
from fairway.server_gc import settle_heap  # noqa: E402

RESULTS = ROOT / "bench" / "results"


def with_pages(huge: bool, build):
    os.environ["FAIRWAY_HUGE_PAGES"] = "1" if huge else "0"
    try:
        return build()
    finally:
        os.environ.pop("FAIRWAY_HUGE_PAGES")


def step_ms(eng: LLMEngine, prompts: list[list[int]], tag: str, max_tokens: int) -> float:
    """The median time of the round's last 100 steps (all of them decode steps)."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    for i, p in enumerate(prompts):
        eng.add_request(f"{tag}-{i}", p, params)
    times = []
    while eng.has_unfinished():
        t0 = time.perf_counter()
        eng.step()
        times.append(time.perf_counter() - t0)
    return statistics.median(times[-100:]) * 1e3


def attention_ms(huge: bool, seqs: int = 16, ctx: int = 155, layers: int = 30, blocks: int = 2048) -> float:
    kernels = decode_kernels()
    shape = (layers, 3, blocks * 16, 64)
    k, v = (with_pages(huge, lambda: huge_pages.zeros(shape, torch.bfloat16)) for _ in range(2))
    gen = torch.Generator().manual_seed(0)
    for t in (k, v):
        for layer in t:
            layer.copy_(torch.randn(layer.shape, generator=gen))
    order = list(range(blocks))
    random.Random(0).shuffle(order)
    width = -(-ctx // 16)
    tables = torch.tensor([order[i * width:(i + 1) * width] for i in range(seqs)], dtype=torch.int32)
    lens = torch.full((seqs,), ctx, dtype=torch.int32)
    q = torch.randn(seqs, 9, 64, generator=gen).to(torch.bfloat16)
    best = float("inf")
    for _ in range(20):
        t0 = time.perf_counter()
        for layer in range(layers):
            kernels.decode_attention(q, k[layer], v[layer], tables, lens, 16, 0.125)
        best = min(best, time.perf_counter() - t0)
    return best * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--chats", default="1,16", help="sequences a step, comma-separated")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--out", type=Path, default=RESULTS / "huge_pages.json")
    args = ap.parse_args()

    # The kernel first, while the host's free memory is unfragmented.
    attention = {"small_pages_ms": attention_ms(False), "huge_pages_ms": attention_ms(True)}
    config = EngineConfig(num_kv_blocks=2048, speculative=None)
    engines = {huge: with_pages(huge, lambda: build_engine(dtype="bfloat16", config=config, weights="native"))
               for huge in (False, True)}
    settle_heap()
    tok = engines[True].tokenizer
    steps: dict[str, dict[str, object]] = {}
    for n in (int(c) for c in args.chats.split(",")):
        for huge, eng in engines.items():  # warm-up round
            step_ms(eng, chat_prompts(tok, n, 0), f"warm{n}{huge}", args.max_tokens)
        small, big = [], []
        for r in range(args.rounds):
            prompts = chat_prompts(tok, n, 1000 + r * n)
            small.append(step_ms(engines[False], prompts, f"s{n}-{r}", args.max_tokens))
            big.append(step_ms(engines[True], prompts, f"h{n}-{r}", args.max_tokens))
        ratios = [b / s for s, b in zip(small, big, strict=True)]
        steps[str(n)] = {"small_pages_ms": small, "huge_pages_ms": big, "ratios": ratios,
                         "small_median_ms": statistics.median(small), "huge_median_ms": statistics.median(big),
                         "ratio_median": statistics.median(ratios)}

    print(f"{'decode step':<26}{'4 KB pages':>12}{'2 MB pages':>12}{'ratio (median of rounds)':>26}")
    for n, s in steps.items():
        print(f"{n + ' sequences':<26}{s['small_median_ms']:>10.2f}ms{s['huge_median_ms']:>10.2f}ms"
              f"{s['ratio_median']:>26.3f}")
    print(f"{'attention, 16 x 155 tok':<26}{attention['small_pages_ms']:>10.2f}ms{attention['huge_pages_ms']:>10.2f}ms"
          f"{attention['huge_pages_ms'] / attention['small_pages_ms']:>26.3f}")
    result = {"timestamp": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
              "machine": machine.describe(), "args": {k: str(v) for k, v in vars(args).items()},
              "steps": steps, "attention_30_layers": attention}
    args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
