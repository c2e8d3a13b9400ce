"""What guided decoding costs per engine step (fairway/engine/guided_decoding.py), side by side
with the same batch unguided: the bundled model, a batch of `--batch` sequences decoding greedily
(`ignore_eos`, the same prompt), 0, 1 or all of them held to a JSON Schema. Figures: the mean
decode step time of each mix, and the time the mask itself takes per guided row and step
(llguidance's bitmask, unpacked, applied to the row's logits), timed around the sampler's call.
The grammar's first mask (llguidance builds its lexer lazily) is outside the timed steps. Run it
under nice on a shared machine.

    nice -n 19 .venv/bin/python bench/guided.py            # ~1 min
    nice -n 19 .venv/bin/python bench/guided.py --quick

Results: bench/results/guided.json (guided_quick.json for --quick).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import machine  # noqa: E402
import torch  # noqa: E402

from fairway.engine import EngineConfig, LLMEngine, SamplingParams  # noqa: E402
from fairway.engine.guided_decoding import mask_logits  # noqa: E402
from fairway.models.bundled import bundled_model_path  # noqa: E402
from fairway.models.loader import load_model  # noqa: E402
from fairway.models.tokenizer import Tokenizer  # noqa: E402

RESULTS = ROOT / "bench" / "results"
SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "items": {"type": "array", "items": {
    "type": "object", "properties": {"label": {"type": "string"}, "score": {"type": "number"}},
    "required": ["label", "score"]}}}, "required": ["name", "items"]}


class MaskTimer:
    """Wraps mask_logits where the sampler calls it: seconds and rows masked."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.cpu_seconds = 0.0  # this thread's CPU time: less at the mercy of other processes
        self.rows = 0
        self._inner = mask_logits

    def __call__(self, logits, rows, matchers) -> None:
        started, cpu = time.perf_counter(), time.thread_time()
        self._inner(logits, rows, matchers)
        self.seconds += time.perf_counter() - started
        self.cpu_seconds += time.thread_time() - cpu
        self.rows += len(rows)


def run_mix(engine: LLMEngine, prompt: list[int], batch: int, guided: int, steps: int, timer: MaskTimer) -> dict:
    free = SamplingParams(temperature=0, max_tokens=steps + 8, ignore_eos=True)
    held = SamplingParams(temperature=0, max_tokens=steps + 8, ignore_eos=True,
                          guided_decoding={"json_schema": SCHEMA})
    for i in range(batch):
        engine.add_request(f"mix{guided}-{i}", prompt, held if i < guided else free)
    for _ in range(3):  # the prefill and the first masks (lazy lexer) stay out of the figures
        engine.step()
    timer.seconds, timer.cpu_seconds, timer.rows = 0.0, 0.0, 0
    times = []
    for _ in range(steps):
        started = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - started)
    for i in range(batch):
        engine.abort(f"mix{guided}-{i}")
    engine.step()
    return {"batch": batch, "guided": guided, "steps": steps, "step_ms_mean": 1000 * statistics.fmean(times),
            "step_ms_p50": 1000 * statistics.median(times),
            "mask_us_per_row": 1e6 * timer.seconds / timer.rows if timer.rows else 0.0,
            "mask_cpu_us_per_row": 1e6 * timer.cpu_seconds / timer.rows if timer.rows else 0.0}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--quick", action="store_true")
    args = p.parse_args()
    if args.quick:
        args.batch, args.steps = 4, 10
    timer = MaskTimer()
    import fairway.engine.sampler as sampler

    sampler.mask_logits = timer
    path = bundled_model_path()
    tokenizer = Tokenizer.from_gguf(path)
    engine = LLMEngine(load_model(path, torch.bfloat16), EngineConfig(speculative=None, bound_step_time=False),
                       tokenizer=tokenizer)
    prompt = tokenizer.chat_prompt_ids([{"role": "user", "content": "List a few things with a score each, as JSON."}])
    mixes = [run_mix(engine, prompt, args.batch, guided, args.steps, timer) for guided in (0, 1, args.batch)]
    base = mixes[0]["step_ms_mean"]
    print(f"{'batch':>5s} {'guided':>6s} {'step ms':>8s} {'x free':>7s} {'mask us/row':>11s} {'cpu us/row':>10s}")
    for m in mixes:
        print(f"{m['batch']:5d} {m['guided']:6d} {m['step_ms_mean']:8.2f} {m['step_ms_mean'] / base:7.2f} "
              f"{m['mask_us_per_row']:11.0f} {m['mask_cpu_us_per_row']:10.0f}")
    out = {"benchmark": "guided", "when": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
           "machine": machine.describe(), "nice": os.nice(0), "load_average": os.getloadavg(), "schema": SCHEMA,
           "mixes": mixes}
    RESULTS.mkdir(parents=True, exist_ok=True)
    target = RESULTS / ("guided_quick.json" if args.quick else "guided.json")
    target.write_text(json.dumps(out, indent=2) + "\n")
    print(f"wrote {target.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
