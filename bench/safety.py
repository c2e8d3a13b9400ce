"""What the safety checks cost (fairway/safety/), in one run.

Part 1, the output check's hold-back: two `fairway serve` processes side by side, the same bundled
model and workload, one with `--safety-output off` and one with the default check-then-release
(each sentence held back until it is checked). 16 concurrent chats of 128 tokens (ignore_eos,
temperature 0.7, a seed per chat), the two servers taking turns (`--repeats` rounds), measured at
the client: time to first token and the delay between consecutive content events, p50 / p99. The
hold-back moves the first token to the end of the first sentence and delivers each sentence in
one burst, so TTFT and the p99 delay grow and the p50 delay shrinks (a burst's events arrive
together); the aggregate tokens/s says whether the classifier costs the engine anything.

Part 2, the input check on a 2,000-token context, in process: a conversation of system text and
history (~1,900 tokens, counted with the model's tokenizer) plus a new ~100-token user message.
Only the new message is classified (the history was checked when it was new); the same figure for
classifying the whole context is printed beside it. p50 / p99 over `--samples` checks, with the
policy and alt-profanity-check. Also the per-sentence cost of the output check's classifier, and
a pasted document (a 200,000-character message): how long its check takes and the event loop's
longest pause meanwhile (every stream the gateway relays waits that long), scored inline and, as
the gateway does for a text that long, in a worker thread.

    .venv/bin/python bench/safety.py            # ~1 min on 2 idle cores (far longer on a busy machine)
    .venv/bin/python bench/safety.py --quick    # smoke run: 4 chats of 32 tokens, one round
    .venv/bin/python bench/safety.py --classifiers-only   # part 2 alone (seconds)

Results: bench/results/safety.json (safety_quick.json for --quick).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import machine  # noqa: E402
import relay  # noqa: E402  (this tree's helpers: ports, processes, the SSE client, the model level)

from fairway.safety import SafetySettings, make_moderator  # noqa: E402
from fairway.safety import classifier as classifier_module  # noqa: E402

RESULTS = ROOT / "bench" / "results"
INPUT_P99_TARGET_MS = 5.0
CONFIGS = {"no check": ["--safety-output", "off"], "check-then-release": ["--safety-output", "check-then-release"]}


# -- part 1: the hold-back, end to end ----------------------------------------------------------------


async def bench_holdback(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    from fairway.gateway.keys import generate_key

    relay.API_KEY["value"] = generate_key()
    servers = {}
    for name, flags in CONFIGS.items():
        port = relay.free_port()
        proc = relay.spawn(["-m", "fairway.cli", "serve", "--port", str(port), "--database",
                            f"sqlite:///{workdir}/{port}.db", "--log-level", "warning", *relay.NO_LIMITS, *flags],
                           workdir / f"serve-{port}.log", env={"FAIRWAY_DEV_KEY": relay.API_KEY["value"]})
        servers[name] = (proc, port)
    rounds: dict[str, list[dict[str, Any]]] = {name: [] for name in CONFIGS}
    try:
        for _, port in servers.values():
            await relay.wait_ready(f"http://127.0.0.1:{port}")
            await relay.model_level(port, 2, 4, extra={"ignore_eos": True})  # warm-up
        for r in range(args.repeats):
            for name, (_, port) in servers.items():  # taking turns: both see the same machine
                level = await relay.model_level(port, args.chats, args.tokens, extra={"ignore_eos": True})
                rounds[name].append(level)
                print(f"  round {r + 1} {name:19s} TTFT p50 {level['ttft_p50_s']:.2f} s p99 {level['ttft_p99_s']:.2f} s"
                      f"  delay p50 {level['itl_p50_ms']:.0f} ms p99 {level['itl_p99_ms']:.0f} ms"
                      f"  {level['aggregate_tokens_per_s']:.1f} tokens/s ({level['tokens']} tokens; ends: "
                      f"{', '.join(f'{n} {why}' for why, n in sorted(level['finish_reasons'].items()))})", flush=True)
    finally:
        for proc, _ in servers.values():
            proc.terminate()
            proc.wait(timeout=30)
    medians = {name: {key: statistics.median(level[key] for level in levels)
                      for key in ("ttft_p50_s", "ttft_p99_s", "itl_p50_ms", "itl_p99_ms", "aggregate_tokens_per_s")}
               for name, levels in rounds.items()}
    return {"chats": args.chats, "tokens_per_chat": args.tokens, "rounds": rounds, "medians": medians}


# -- part 2: the classifiers, in process --------------------------------------------------------------


def percentiles_ms(samples: list[float]) -> dict[str, float]:
    ordered = sorted(samples)
    return {"p50_ms": round(relay.percentile(ordered, 0.5) * 1000, 3),
            "p99_ms": round(relay.percentile(ordered, 0.99) * 1000, 3)}


async def timed(moderator, texts: list[str], stage: str, samples: int) -> dict[str, float]:
    """p50/p99 of each check's wall time, and of the CPU time this thread spent on it: on a shared
    machine the wall time's tail is mostly other processes' turns on the cores, the CPU time is the
    check's own cost."""
    wall, cpu = [], []
    for i in range(samples):
        text = f"{texts[i % len(texts)]} ({i})"  # each text new: fold()'s cache must not answer it
        start, start_cpu = time.perf_counter(), time.thread_time()
        await moderator.moderate_one(text, stage)
        wall.append(time.perf_counter() - start)
        cpu.append(time.thread_time() - start_cpu)
    cpu_figures = percentiles_ms(cpu)
    return {**percentiles_ms(wall), "cpu_p50_ms": cpu_figures["p50_ms"], "cpu_p99_ms": cpu_figures["p99_ms"]}


async def bench_classifiers(args: argparse.Namespace) -> dict[str, Any]:
    from fairway.assembly import load_tokenizer
    from fairway.conversation.context_builder import ContextBuilder

    moderator = make_moderator(SafetySettings())
    tokenizer = load_tokenizer(None)
    system = {"role": "system", "content": "You are a helpful assistant for a travel company. " * 20}
    history = []
    for i in range(30):
        history.append({"role": "user", "content": f"Question {i}: what should I pack for a week in the mountains "
                                                   f"in month {i % 12 + 1}, with two children and a dog?"})
        history.append({"role": "assistant", "content": "Layers, a rain jacket, sturdy shoes, snacks, a first-aid "
                                                        "kit and the dog's lead and bowl. Check the forecast. " * 2})
    new_messages = [("Thanks. One more thing: we will also visit a lake, so what should we bring for swimming and "
                     f"boating, and is it safe for a {i + 5}-year-old to swim in cold mountain water in spring? "
                     "Please also suggest two easy hikes near the lake that the dog can do.") for i in range(20)]
    builder = ContextBuilder(tokenizer, 4096)
    while True:  # trim the history to ~2,000 tokens in all
        context = builder.build([system], history, [{"role": "user", "content": new_messages[0]}], 0)
        if context.num_tokens <= 2000 or not history:
            break
        history = history[2:]
    new_tokens = len(tokenizer.encode(new_messages[0]))
    whole = ["\n".join(m["content"] for m in [system, *history]) + "\n" + text for text in new_messages]
    sentences = [s.strip() + "." for s in " ".join(m["content"] for m in history).split(".") if s.strip()]
    await timed(moderator, new_messages, "input", 200)  # warm-up (caches, the first regex compiles)
    new_only = await timed(moderator, new_messages, "input", args.samples)
    everything = await timed(moderator, whole, "input", max(args.samples // 10, 50))
    per_sentence = await timed(moderator, sentences, "output", args.samples)
    return {
        "context_tokens": context.num_tokens,
        "new_message_tokens": new_tokens,
        "input_check_new_message": new_only,
        "input_check_whole_context": everything,
        "output_check_per_sentence": per_sentence,
        "samples": args.samples,
        "input_p99_target_ms": INPUT_P99_TARGET_MS,
        "input_p99_within_target": new_only["p99_ms"] <= INPUT_P99_TARGET_MS,
    }


async def check_with_ticker(moderator, text: str) -> dict[str, float]:
    """One check of text: its wall time and the event loop's longest pause meanwhile (the largest
    gap of a 1 ms ticker's wakes)."""
    gaps: list[float] = []

    async def tick() -> None:
        last = time.perf_counter()
        while True:
            await asyncio.sleep(0.001)
            now = time.perf_counter()
            gaps.append(now - last)
            last = now

    ticker = asyncio.create_task(tick())
    await asyncio.sleep(0.02)
    gaps.clear()
    start = time.perf_counter()
    await moderator.moderate_one(text, "input")
    took = time.perf_counter() - start
    await asyncio.sleep(0.002)  # the ticker's wake right after the check ends its last gap
    ticker.cancel()
    return {"check_ms": round(took * 1000, 1), "longest_loop_pause_ms": round(max(gaps) * 1000, 1)}


async def bench_long_message(chars: int = 200_000) -> dict[str, Any]:
    """A pasted document checked inline (as every text was before classifier.INLINE_CHARS) and in
    a worker thread; each figure the median of 3 checks, each text new."""
    moderator = make_moderator(SafetySettings())
    paragraph = ("The quarterly report covers shipping volumes, staffing, and the new warehouse in the north. "
                 "Deliveries rose in every region; returns fell slightly after the packaging change. ")
    threshold = classifier_module.INLINE_CHARS
    sides: dict[str, dict[str, float]] = {}
    for side, inline_chars in (("inline", 10**12), ("worker thread", threshold)):
        classifier_module.INLINE_CHARS = inline_chars
        try:
            runs = [await check_with_ticker(moderator, (f"({side} {i}) " + paragraph * (chars // len(paragraph) + 1))[:chars])
                    for i in range(3)]
        finally:
            classifier_module.INLINE_CHARS = threshold
        sides[side] = {key: statistics.median(r[key] for r in runs) for key in runs[0]}
    return {"chars": chars, **sides}


# -- main ---------------------------------------------------------------------------------------------


async def main(args: argparse.Namespace) -> None:
    relay.raise_fd_limit()
    report: dict[str, Any] = {"benchmark": "safety", "quick": args.quick,
                              "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
                              "machine": machine.describe()}
    print("classifiers, in process (policy + alt-profanity-check)", flush=True)
    report["classifiers"] = classifiers = await bench_classifiers(args)
    print(f"  {classifiers['context_tokens']}-token context, only its new {classifiers['new_message_tokens']}-token "
          f"message classified; target: input check p99 <= {INPUT_P99_TARGET_MS} ms")
    print(f"  {'':34s} {'p50':>8s} {'p99':>8s} {'CPU p50':>8s} {'CPU p99':>8s}")
    for label, key in (("input check (the new message)", "input_check_new_message"),
                       ("input check (the whole context)", "input_check_whole_context"),
                       ("output check (one sentence)", "output_check_per_sentence")):
        f = classifiers[key]
        print(f"  {label:34s} {f['p50_ms']:6.2f}ms {f['p99_ms']:6.2f}ms {f['cpu_p50_ms']:6.2f}ms {f['cpu_p99_ms']:6.2f}ms")
    verdict = "within" if classifiers["input_p99_within_target"] else "OVER"
    print(f"  input check p99 {classifiers['input_check_new_message']['p99_ms']:.2f} ms: {verdict} the target",
          flush=True)
    report["long_message"] = long = await bench_long_message()
    print(f"  a {long['chars']:,}-character message (median of 3):")
    for side in ("inline", "worker thread"):
        print(f"    {side:14s} check {long[side]['check_ms']:8.1f} ms, the event loop's longest pause "
              f"{long[side]['longest_loop_pause_ms']:8.1f} ms", flush=True)
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = RESULTS / ("safety_quick.json" if args.quick else "safety.json")
    if args.classifiers_only:  # part 2 again; part 1's figures (and their date) stay as they were
        earlier = json.loads(out.read_text()) if out.exists() else {}
        if "holdback" in earlier:
            report["holdback"] = earlier["holdback"]
            report["holdback_date"] = earlier.get("holdback_date", earlier.get("date"))
        out.write_text(json.dumps(report, indent=2) + "\n")
        print(f"results: {out}")
        return
    print(f"hold-back: fairway serve x2 (no check / check-then-release), {args.chats} chats of {args.tokens} tokens",
          flush=True)
    with tempfile.TemporaryDirectory(prefix="fairway-bench-") as tmp:
        report["holdback"] = holdback = await bench_holdback(args, Path(tmp))
    print(f"\n{'':20s} {'TTFT p50':>9s} {'TTFT p99':>9s} {'delay p50':>10s} {'delay p99':>10s} {'tokens/s':>9s}"
          f"   (median of {args.repeats} rounds)")
    for name, m in holdback["medians"].items():
        print(f"{name:20s} {m['ttft_p50_s']:8.2f}s {m['ttft_p99_s']:8.2f}s {m['itl_p50_ms']:8.0f}ms {m['itl_p99_ms']:8.0f}ms"
              f" {m['aggregate_tokens_per_s']:9.1f}")
    report["holdback_date"] = report["date"]
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"results: {out}")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--chats", type=int, default=None)
    parser.add_argument("--tokens", type=int, default=None)
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--samples", type=int, default=None, help="classifier checks timed per figure")
    parser.add_argument("--classifiers-only", action="store_true",
                        help="part 2 only, written into the results beside part 1's earlier figures")
    args = parser.parse_args()
    args.chats = args.chats or (4 if args.quick else 16)
    args.tokens = args.tokens or (32 if args.quick else 128)
    args.repeats = args.repeats or (1 if args.quick else 3)
    args.samples = args.samples or (300 if args.quick else 3000)
    return args


if __name__ == "__main__":
    asyncio.run(main(parse_args()))
