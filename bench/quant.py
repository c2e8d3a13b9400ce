"""Quantized weights run as stored vs dequantized at load vs llama.cpp's llama-server on Q4_0, side by
side in one run.

Engines: Fairway with --weights native on the bundled Q4_1 GGUF and on a Q4_0 copy of it (the file
llama-server runs), Fairway --weights auto (the default: as stored, with a bf16 copy for steps of
many rows where this CPU multiplies that faster), Fairway --weights dequantized (bf16 weights),
and llama-server on the Q4_0 file. All bf16 activations (llama.cpp: its own choice, int8 dot
products). Workload as relay.py's model part: distinct ~90-token chat prompts, 128 forced tokens
(greedy, ignore_eos). One stream: decode tokens/s after the first token (Fairway: the engine's own
timestamps; llama-server: its reported `predicted_per_second`). 16 chats: all tokens over the wall
time from the first submission to the last token (llama-server: 16 slots, requests from 16
threads). Beside each, the decode rate from the median inter-token interval (rows a step / its
median; llama-server: streamed, per stream), which a process stopped or crowded out for part of
the run leaves alone. Each configuration runs --repeats times, the order rotating; figures are
medians, and the best of the repeats beside them.

Also the floor: the bytes of weights one decode step reads (per engine, from the loaded layers)
over this machine's read bandwidth for a buffer of that size (all threads).

llama-server and llama-quantize: built from the PyPI sdist of llama-cpp-python (bench/README.md,
"Quantized weights"); --llama-bin names their folder. Without them the Fairway rows still run.

    .venv/bin/python bench/quant.py --llama-bin /tmp/llamacpp/build/bin      # ~6 min on 2 cores
"""

from __future__ import annotations

import argparse
import datetime
import json
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import machine  # noqa: E402  (bench/machine.py: this script's folder is on the path)
from engine_vs_hf import CpuMeter, wait_for_quiet  # noqa: E402
from itl import chat_prompts, run  # noqa: E402

from fairway.engine.factory import build_engine  # noqa: E402
from fairway.engine.llm_engine import EngineConfig, LLMEngine  # noqa: E402
from fairway.models.bundled import bundled_model_path  # noqa: E402
from fairway.models.quant_linear import DENSE_FROM_ROWS, QuantLinear  # noqa: E402
from fairway.server_gc import settle_heap  # noqa: E402

RESULTS = ROOT / "bench" / "results"
TARGETS = {"one_stream_over_llama_q4_0": 1.5, "chats16_over_llama_best": 3.0}


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def read_bandwidth(size: int) -> float:
    """Bytes/s of a read pass over `size` bytes (float32 sum, all torch threads), best of 5: the
    weights of a step are read again every step, so a buffer of their size, which may sit in a
    large last-level cache as they do."""
    t = torch.ones(size // 4)
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        float(t.sum())
        best = min(best, time.perf_counter() - t0)
    return t.numel() * 4 / best


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of weights a one-row decode step reads: every linear (quantized as stored, or dense;
    not the bf16 copies --weights auto keeps for steps of many rows)."""
    total = 0
    copies = {id(mod.dense) for mod in model.modules() if isinstance(mod, QuantLinear) and mod.dense is not None}
    for mod in model.modules():
        if id(mod) in copies:
            continue
        if isinstance(mod, QuantLinear):
            total += mod.weight_bytes
        elif hasattr(mod, "out_features") and hasattr(mod, "in_features") and not list(mod.children()):
            elem = 2 if next(iter(mod.buffers()), torch.empty(0, dtype=torch.bfloat16)).dtype == torch.bfloat16 else 4
            total += mod.out_features * mod.in_features * elem
    return total


CROSSOVER_ROWS = (1, 4, 8, 12, 16, 24, 32, 48)


def crossover(model: torch.nn.Module, repeats: int = 5) -> list[dict[str, float]]:
    """Every stored-block linear of a step (the ones --weights auto keeps a bf16 copy of) at each
    row count of CROSSOVER_ROWS: ms on the stored blocks vs on the copies, best of `repeats`, the
    two taken in turn; where the copies win is quant_linear.DENSE_FROM_ROWS's ground."""
    linears = [m for m in model.modules() if isinstance(m, QuantLinear) and m.dense is not None]
    table = []
    for rows in CROSSOVER_ROWS if linears else ():
        xs = [torch.randn(rows, lin.in_features).to(torch.bfloat16) for lin in linears]
        best = {"stored": float("inf"), "copy": float("inf")}
        for _ in range(repeats):
            for name in best:
                t0 = time.perf_counter()
                for lin, x in zip(linears, xs, strict=True):
                    lin.stored(x) if name == "stored" else lin.dense(x)
                best[name] = min(best[name], time.perf_counter() - t0)
        table.append({"rows": rows, "stored_ms": 1e3 * best["stored"], "copy_ms": 1e3 * best["copy"]})
    return table


def fairway_run(eng: LLMEngine, prompts: list[list[int]], max_tokens: int, tag: str) -> dict[str, float]:
    r = run(eng, prompts, max_tokens, tag)
    itl_rate = len(prompts) / r["itl_p50_s"]
    if len(prompts) == 1:  # one stream: the decode rate after the first token
        return {"tokens_per_s": (max_tokens - 1) / (r["wall_s"] - r["ttft_p50_s"]), "itl_tokens_per_s": itl_rate}
    return {"tokens_per_s": r["tokens_per_s"], "itl_tokens_per_s": itl_rate}


class LlamaServer:
    """llama-server on a GGUF, 2 threads, `slots` parallel sequences, on a free port."""

    def __init__(self, binary: Path, model: Path, slots: int, ctx_per_slot: int = 512) -> None:
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        threads = str(torch.get_num_threads())
        self.proc = subprocess.Popen([str(binary), "-m", str(model), "--port", str(self.port), "-t", threads,
                                      "-tb", threads, "-np", str(slots), "-c", str(slots * ctx_per_slot),
                                      "--no-webui", "-ngl", "0"],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                time.sleep(0.5)
        self.stop()
        raise RuntimeError("llama-server did not come up")

    def complete(self, prompt: list[int], max_tokens: int) -> tuple[dict, list[float]]:
        """The final event's fields (timings) and each token's arrival time, streamed."""
        body = json.dumps({"prompt": prompt, "n_predict": max_tokens, "temperature": 0, "ignore_eos": True,
                           "cache_prompt": False, "stream": True}).encode()
        req = urllib.request.Request(f"http://127.0.0.1:{self.port}/completion", body,
                                     {"Content-Type": "application/json"})
        arrivals, last = [], {}
        with urllib.request.urlopen(req, timeout=600) as r:
            for line in r:
                if line.startswith(b"data: "):
                    last = json.loads(line[6:])
                    arrivals.append(time.perf_counter())
        return last, arrivals

    def run(self, prompts: list[list[int]], max_tokens: int) -> dict[str, float]:
        out: list[tuple[dict, list[float]]] = []
        threads = [threading.Thread(target=lambda p=p: out.append(self.complete(p, max_tokens))) for p in prompts]
        t0 = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        wall = time.perf_counter() - t0
        gaps = [b - a for _, arrivals in out for a, b in zip(arrivals[1:-1], arrivals[2:], strict=False)]
        itl_rate = len(prompts) / statistics.median(gaps)
        if len(prompts) == 1:
            return {"tokens_per_s": out[0][0]["timings"]["predicted_per_second"], "itl_tokens_per_s": itl_rate}
        return {"tokens_per_s": sum(o["timings"]["predicted_n"] for o, _ in out) / wall, "itl_tokens_per_s": itl_rate}

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(30)


def q4_0_copy(quantize: Path, source: Path, folder: Path) -> Path:
    """The bundled GGUF requantized to Q4_0 (embedding and head Q8_0, as bundled)."""
    out = folder / "SmolLM2-135M-Instruct.Q4_0.gguf"
    subprocess.run([str(quantize), "--allow-requantize", "--token-embedding-type", "q8_0", "--output-tensor-type",
                    "q8_0", str(source), str(out), "Q4_0", "2"], check=True, capture_output=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--llama-bin", type=Path, default=None, help="folder with llama-server and llama-quantize")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-minutes", type=float, default=0,
                    help="start no further repeat after this long (0: no limit); a crowded machine is slow")
    ap.add_argument("--quiet-wait", type=float, default=60,
                    help="seconds to wait, before each measurement, for other processes to leave the CPUs")
    ap.add_argument("--out", type=Path, default=RESULTS / "quant.json")
    args = ap.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))  # a killed run still stops llama-server
    tmp = Path(tempfile.mkdtemp(prefix="fairway-quant-"))
    bundled = bundled_model_path()
    server_bin = args.llama_bin / "llama-server" if args.llama_bin else None
    q4_0 = None
    if server_bin is not None and server_bin.exists():
        q4_0 = q4_0_copy(args.llama_bin / "llama-quantize", bundled, tmp)
    else:
        log("no llama-server: Fairway rows only")
    # no speculation: this compares the weights' kernels (llama-server speculates only when told)
    config = EngineConfig(num_kv_blocks=1024, max_num_batched_tokens=512, speculative=None)
    engines = {"fairway native Q4_1": build_engine(bundled, "bfloat16", config=config, weights="native"),
               "fairway auto Q4_1": build_engine(bundled, "bfloat16", config=config, weights="auto"),
               "fairway dequantized bf16": build_engine(bundled, "bfloat16", config=config, weights="dequantized")}
    if q4_0 is not None:
        engines["fairway native Q4_0"] = build_engine(q4_0, "bfloat16", config=config, weights="native")
    tok = engines["fairway native Q4_1"].tokenizer
    prompts = chat_prompts(tok, 16)
    floors = {n: {"weight_bytes_per_token": weight_bytes(e.model)} for n, e in engines.items()}
    for f in floors.values():
        f["read_bytes_per_s"] = read_bandwidth(f["weight_bytes_per_token"])
        f["floor_tokens_per_s"] = f["read_bytes_per_s"] / f["weight_bytes_per_token"]
    servers = {"llama-server Q4_0": LlamaServer(server_bin, q4_0, 16)} if q4_0 is not None else {}
    names = list(engines) + list(servers)
    runs: dict[str, dict[str, list[float]]] = {n: {"1": [], "16": [], "1 itl": [], "16 itl": []} for n in names}
    try:
        settle_heap()  # as a replica does once its engine is loaded (fairway/server_gc.py)
        for n, e in engines.items():  # warm-up
            fairway_run(e, prompts[:4], 16, f"warm-{n}")
        for s in servers.values():
            s.run(prompts[:4], 16)
        wait_for_quiet(args.quiet_wait)
        copies = crossover(engines["fairway auto Q4_1"].model)
        meter, started, done = CpuMeter(), time.monotonic(), 0
        for rep in range(args.repeats):
            if rep and args.max_minutes and time.monotonic() - started > 60 * args.max_minutes:
                log(f"stopping after {rep} repeats (--max-minutes)")
                break
            order = names[rep % len(names):] + names[:rep % len(names)]
            for n in order:
                for chats in ("1", "16"):
                    # the repeat's own prompts (the same for every engine): Fairway's prefix cache
                    # would skip the prefill of prompts it saw before; llama-server runs without one
                    batch = chat_prompts(tok, int(chats), 100 + 100 * rep + (50 if chats == "1" else 0))
                    wait_for_quiet(args.quiet_wait)
                    r = (servers[n].run(batch, args.max_tokens) if n in servers
                         else fairway_run(engines[n], batch, args.max_tokens, f"{n}-{rep}-{chats}"))
                    runs[n][chats].append(r["tokens_per_s"])
                    runs[n][f"{chats} itl"].append(r["itl_tokens_per_s"])
                    log(f"repeat {rep + 1} {n}, {chats} chat(s): {r['tokens_per_s']:.0f} tok/s, "
                        f"from the median inter-token interval {r['itl_tokens_per_s']:.0f}")
            done = rep + 1
        other_share = meter.other_share()
    finally:
        for s in servers.values():
            s.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    medians = {n: {c: statistics.median(v) for c, v in r.items()} for n, r in runs.items()}
    best = {n: {c: max(v) for c, v in r.items()} for n, r in runs.items()}
    print(f"\n{args.max_tokens} forced tokens, median (best) of {done}")
    print("| engine | MB weights/token | read GB/s | floor tok/s | 1 stream tok/s | of floor | 16 chats tok/s "
          "| 1 stream, median ITL | 16 chats, median ITL |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for n in names:
        f = floors.get(n)
        mb = f"{f['weight_bytes_per_token'] / 1e6:.1f} | {f['read_bytes_per_s'] / 1e9:.0f}" if f else "- | -"
        floor = f"{f['floor_tokens_per_s']:.0f}" if f else "-"
        share = f"{best[n]['1'] / f['floor_tokens_per_s']:.0%}" if f else "-"
        print(f"| {n} | {mb} | {floor} | {medians[n]['1']:.0f} ({best[n]['1']:.0f}) | {share} | "
              f"{medians[n]['16']:.0f} ({best[n]['16']:.0f}) | {medians[n]['1 itl']:.0f} | {medians[n]['16 itl']:.0f} |")
    if copies:
        print("\nthe stored-block linears of a step vs their bf16 copies (--weights auto from "
              f"{DENSE_FROM_ROWS} rows), ms, best of 5")
        print("| rows | stored blocks | bf16 copies | copies / stored |\n| --- | --- | --- | --- |")
        for c in copies:
            print(f"| {c['rows']} | {c['stored_ms']:.1f} | {c['copy_ms']:.1f} | {c['copy_ms'] / c['stored_ms']:.2f} |")
    ratios = {}
    if servers:
        for stat, figures in (("median", medians), ("best", best)):
            llama = figures["llama-server Q4_0"]
            ratios[stat] = {
                "one_stream_native_q4_1_over_llama_q4_0": figures["fairway native Q4_1"]["1"] / llama["1"],
                "one_stream_native_q4_0_over_llama_q4_0": figures["fairway native Q4_0"]["1"] / llama["1"],
                "chats16_native_q4_1_over_llama": figures["fairway native Q4_1"]["16"] / max(llama["1"], llama["16"]),
                "chats16_auto_q4_1_over_llama": figures["fairway auto Q4_1"]["16"] / max(llama["1"], llama["16"]),
                "one_stream_itl_native_q4_1_over_llama_q4_0": figures["fairway native Q4_1"]["1 itl"] / llama["1 itl"],
                "chats16_itl_native_q4_1_over_llama": figures["fairway native Q4_1"]["16 itl"]
                / max(llama["1 itl"], llama["16 itl"])}
        for stat, r in ratios.items():
            print(f"{stat}: " + "; ".join(f"{k} {v:.2f}x" for k, v in r.items()))
    print(f"other processes used {100 * (other_share or 0):.0f}% of the CPUs")
    result = {
        "timestamp": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "machine": machine.describe(), "other_processes_cpu_share": other_share,
        "args": {k: str(v) for k, v in vars(args).items()}, "targets": TARGETS,
        "repeats_done": done, "floors": floors, "copies_vs_stored": copies, "medians": medians, "best": best, "runs": runs,
        "ratios": ratios,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    log(f"wrote {args.out}")


if __name__ == "__main__":
    main()
