"""What a sandboxed run costs (fairway/sandbox/): start-to-result for `print(1)`, p50 / p99, and
the throughput of concurrent runs, side by side with its peer, the same interpreter started bare
(`/usr/bin/python3 -c`, no isolation): the difference is bubblewrap's namespaces and mounts, the
seccomp filter, setpriv and prlimit.

Four ways, each `--samples` sequential runs then `--concurrent` runs at a time for `--burst`
runs: bare python3 (the floor), the runner in process (LocalSandbox), the same without a memory
cgroup per run (what the cgroup costs; where the host allows none, both are the same), and the
gRPC service (`fairway sandbox`, a process of its own) through GrpcSandbox. Run it under nice (the numbers on
a shared 2-core machine are what the other processes leave).

    nice -n 19 .venv/bin/python bench/sandbox.py            # ~1 min
    nice -n 19 .venv/bin/python bench/sandbox.py --quick    # a few seconds

Results: bench/results/sandbox.json (sandbox_quick.json for --quick).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import machine  # noqa: E402

from fairway.sandbox import LocalSandbox, RunnerSettings, SandboxLimits  # noqa: E402
from fairway.sandbox.service import GrpcSandbox  # noqa: E402

RESULTS = ROOT / "bench" / "results"
CODE = "print(1)"
LIMITS = SandboxLimits()

Run = Callable[[], Awaitable[str]]


async def bare() -> str:
    proc = await asyncio.create_subprocess_exec("/usr/bin/python3", "-I", "-c", CODE, stdout=asyncio.subprocess.PIPE)
    out, _ = await proc.communicate()
    return out.decode()


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


async def measure(run: Run, samples: int, concurrent: int, burst: int) -> dict[str, Any]:
    for _ in range(3):  # warm: the filter compiled, the channel connected, the page cache hot
        assert await run() == "1\n"
    latencies = []
    for _ in range(samples):
        started = time.perf_counter()
        out = await run()
        latencies.append(time.perf_counter() - started)
        assert out == "1\n", out
    slots = asyncio.Semaphore(concurrent)

    async def one() -> None:
        async with slots:
            assert await run() == "1\n"

    started = time.perf_counter()
    await asyncio.gather(*(one() for _ in range(burst)))
    wall = time.perf_counter() - started
    return {"p50_ms": 1000 * statistics.median(latencies), "p99_ms": 1000 * percentile(latencies, 0.99),
            "mean_ms": 1000 * statistics.fmean(latencies), "samples": samples,
            "concurrent": concurrent, "burst": burst, "runs_per_s": burst / wall}


async def main(args: argparse.Namespace) -> dict[str, Any]:
    local = LocalSandbox(RunnerSettings(max_concurrent=args.concurrent, per_tenant=args.concurrent))
    uncapped = LocalSandbox(RunnerSettings(max_concurrent=args.concurrent, per_tenant=args.concurrent,
                                           memory_cgroups=False))
    reason = await local.check()
    if reason:
        raise SystemExit(f"the sandbox is off here: {reason}")
    service = subprocess.Popen([sys.executable, "-m", "fairway.cli", "sandbox", "--listen", "127.0.0.1:0",
                                "--max-concurrent", str(args.concurrent), "--per-tenant", str(args.concurrent),
                                "--log-level", "warning"],
                               cwd=ROOT, stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    client: GrpcSandbox | None = None
    try:
        line = service.stdout.readline() if service.stdout else ""
        client = GrpcSandbox("grpc://" + line.split()[3])

        async def in_process() -> str:
            return (await local.run(CODE, LIMITS)).stdout

        async def without_cgroup() -> str:
            return (await uncapped.run(CODE, LIMITS)).stdout

        async def over_grpc() -> str:
            assert client is not None
            return (await client.run(CODE, LIMITS)).stdout

        ways = {"bare python3 (no isolation)": bare, "sandbox in process": in_process,
                "  the same, no memory cgroup": without_cgroup, "sandbox over gRPC": over_grpc}
        figures = {}
        for name, run in ways.items():
            figures[name] = await measure(run, args.samples, args.concurrent, args.burst)
    finally:
        if client is not None:
            await client.close()
        service.terminate()
        service.wait(10)
    return figures


def table(figures: dict[str, Any]) -> str:
    rows = [f"{'print(1), start to result':32s} {'p50 ms':>8s} {'p99 ms':>8s} {'runs/s':>8s}"]
    for name, f in figures.items():
        rows.append(f"{name:32s} {f['p50_ms']:8.1f} {f['p99_ms']:8.1f} {f['runs_per_s']:8.1f}")
    return "\n".join(rows)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--samples", type=int, default=200, help="sequential runs for the latency figures")
    p.add_argument("--concurrent", type=int, default=8, help="runs at once for the throughput figure")
    p.add_argument("--burst", type=int, default=200, help="runs in the throughput figure")
    p.add_argument("--quick", action="store_true", help="20 samples, a burst of 40")
    args = p.parse_args()
    if args.quick:
        args.samples, args.burst = 20, 40
    return args


if __name__ == "__main__":
    args = parse_args()
    figures = asyncio.run(main(args))
    print(table(figures))
    out = {"benchmark": "sandbox", "when": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
           "machine": machine.describe(), "nice": os.nice(0), "load_average": os.getloadavg(), "code": CODE,
           "limits": LIMITS.to_dict(), "memory_bound": LocalSandbox().memory_bound,
           "figures": figures}
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / ("sandbox_quick.json" if args.quick else "sandbox.json")
    path.write_text(json.dumps(out, indent=2) + "\n")
    print(f"wrote {path.relative_to(ROOT)}")
