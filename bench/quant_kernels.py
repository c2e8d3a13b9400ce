"""Per-layer times of the quantized-weight kernels against the dequantized bf16 ones, side by side.

The linears of the bundled model (qkv, o, gate|up, down: Q4_1 in the bundled GGUF) and its tied head
(Q8_0), bf16 activations (float32 on a CPU without bf16 matmuls, as the model runs there), at the
row counts of a decode step (1), a speculative verification (2-9), a decode batch (16, 32) and
beyond: `--weights native` (the blocks as stored, csrc/quant_linear.c, csrc/quant_amx.c and
csrc/quant_vnni.c), the same rows counted as one sequence's (a verification of its drafts, which
takes its decode row's path: QuantLinear.path) and `--weights dequantized` (bf16 panels), on
the same random rows, 2 threads by default; also the ratio of each row count's time to the one-row
time, which prices a speculative verification step.

Each figure is the best of --tries passes (us a layer). A pass calls the linear of every layer in
turn, as a decode step does, so each call reads its weight from DRAM (or L3), not from a cache the
call before warmed; the head has one copy, read whole. `--warm` repeats layer 0's instead (its
weight then stays in L2): a kernel's arithmetic alone, which ranks the kernels' tiles differently.

    .venv/bin/python bench/quant_kernels.py             # ~2 min
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import machine  # noqa: E402  (bench/machine.py: this script's folder is on the path)

from fairway.models.bundled import bundled_model_path  # noqa: E402
from fairway.models.loader import load_model  # noqa: E402
from fairway.models.precision import compute_dtype  # noqa: E402
from fairway.models.quant_linear import STEP_ROWS  # noqa: E402

RESULTS = ROOT / "bench" / "results"
# The stored blocks with the step counted as one sequence (quant_linear.STEP_ROWS = 1): the path of
# a speculative verification of one sequence's drafts (integer products where the CPU has them).
ONE_SEQUENCE = "native, one sequence"


def layers(model: torch.nn.Module, warm: bool) -> dict[str, list[torch.nn.Module]]:
    """Each linear's copies, one a layer (layer 0's alone when warm); the head's one."""
    chosen = model.layers[:1] if warm else model.layers
    return {"qkv": [layer.self_attn.qkv_proj for layer in chosen], "o": [layer.self_attn.o_proj for layer in chosen],
            "gate_up": [layer.mlp.gate_up_proj for layer in chosen], "down": [layer.mlp.down_proj for layer in chosen],
            "head": [model.lm_head]}


def best_us(copies: list[torch.nn.Module], x: torch.Tensor, tries: int) -> float:
    """The best pass over the copies, per copy."""
    for layer in copies:
        layer(x)
    best = float("inf")
    for _ in range(tries):
        t = time.perf_counter()
        for layer in copies:
            layer(x)
        best = min(best, time.perf_counter() - t)
    return best / len(copies) * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="1,2,3,4,6,8,9,16,32,48")
    ap.add_argument("--tries", type=int, default=20)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--warm", action="store_true", help="repeat layer 0's linears (weights in cache)")
    ap.add_argument("--out", type=Path, default=None, help="default: bench/results/quant_kernels[_warm].json")
    args = ap.parse_args()
    if args.out is None:
        args.out = RESULTS / ("quant_kernels_warm.json" if args.warm else "quant_kernels.json")
    torch.set_num_threads(args.threads)
    rows = [int(r) for r in args.rows.split(",")]
    path = bundled_model_path()
    models = {w: layers(load_model(path, torch.bfloat16, weights=w), args.warm) for w in ("native", "dequantized")}
    gen = torch.Generator().manual_seed(0)
    activations = compute_dtype(torch.bfloat16, "cpu")  # what the loaded layers take here
    times: dict[str, dict[str, dict[int, float]]] = {w: {} for w in (*models, ONE_SEQUENCE)}
    print("| layer | type | rows | native us | one sequence's rows us | dequantized bf16 us | native / its 1 row |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for name, copies in models["native"].items():
        native = copies[0]
        for w in times:
            times[w][name] = {}
        for m in rows:
            x = torch.randn(m, native.in_features, generator=gen).to(activations)
            for w, ls in models.items():  # the same rows, one right after the other
                times[w][name][m] = round(best_us(ls[name], x, args.tries), 1)
            token = STEP_ROWS.set(1)  # a verification of one sequence's drafts: its decode row's path
            try:
                times[ONE_SEQUENCE][name][m] = round(best_us(models["native"][name], x, args.tries), 1)
            finally:
                STEP_ROWS.reset(token)
            t = times["native"][name]
            print(f"| {name} | {getattr(native, 'qtype', '-')} | {m} | {t[m]:.1f} | {times[ONE_SEQUENCE][name][m]:.1f} | "
                  f"{times['dequantized'][name][m]:.1f} | {t[m] / t[rows[0]]:.2f} |", flush=True)
    result = {"timestamp": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
              "machine": machine.describe(), "args": {k: str(v) for k, v in vars(args).items()},
              "types": {n: getattr(copies[0], "qtype", None) for n, copies in models["native"].items()},
              "best_us": times}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
