"""relay.py's model part for this working tree and another revision, the two alternated round by
round: aggregate tokens/s of `fairway serve` (bundled model, bf16, CPU) at 1, 16 and 64 chats.

Two servers of the model cannot share a 2-core machine at once (each would take the other's
cores), and one tree measured after the other meets another phase of a shared VM (this one's
speed moves by 10-30% from one minute to the next). So each round starts one tree's server,
runs every level, stops it, then the other's, the order swapped every round; the medians over
the rounds and their ratio are printed. relay.py's workload: a chat per topic, 128 tokens
(ignore_eos), sampled at 0.7 with a seed per chat, after a short warm-up. Results go to
bench/results/model_pair.json.

    .venv/bin/python bench/model_pair.py --base 0ab41d4 --rounds 3 \\
        --this-arg=--safety-output --this-arg=off --this-arg=--no-input-check --this-arg=--no-memory
"""

from __future__ import annotations

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
sys.path.insert(0, str(ROOT / "bench"))

import machine  # noqa: E402
import relay  # noqa: E402  (this tree's client and level runner)
from gateway_requests import comparison_parser, this_tree, worktree  # noqa: E402

SIDES = ("base", "this")


async def serve_levels(root: Path, own_args: list[str], levels: list[int], tokens: int,
                       workdir: Path) -> list[dict[str, Any]]:
    """One server of the tree at root, the levels in turn, then stopped."""
    from fairway.gateway.keys import generate_key

    relay.API_KEY["value"] = generate_key()
    port = relay.free_port()
    workdir.mkdir(parents=True, exist_ok=True)
    server = relay.spawn(["-m", "fairway.cli", "serve", "--port", str(port), "--database",
                          f"sqlite:///{workdir}/serve.db", "--log-level", "warning", *relay.NO_LIMITS, *own_args],
                         workdir / "serve.log", env={"FAIRWAY_DEV_KEY": relay.API_KEY["value"]}, root=root)
    return await relay.model_levels(root.name, server, port, levels, tokens, extra={"ignore_eos": True})


async def main(args: Any) -> None:
    levels = [int(c) for c in args.chats.split(",")]
    with tempfile.TemporaryDirectory(prefix="fairway-model-pair-") as tmp, \
            worktree(args.base, Path(tmp) / "base") as base:
        this = this_tree()
        print(f"fairway serve, tokens/s at {levels} chats, alternated: {base} vs this tree ({this}"
              f"{' ' + ' '.join(args.this_arg) if args.this_arg else ''})", flush=True)
        roots = {"base": (Path(tmp) / "base", []), "this": (ROOT, args.this_arg)}
        runs: dict[str, dict[str, list[float]]] = {s: {str(c): [] for c in levels} for s in SIDES}
        for r in range(args.rounds):
            for side in SIDES if r % 2 == 0 else SIDES[::-1]:
                root, own = roots[side]
                for level in await serve_levels(root, own, levels, args.tokens, Path(tmp) / f"{side}-{r}"):
                    runs[side][str(level["concurrency"])].append(level["aggregate_tokens_per_s"])
    summary = {}
    print("| chats | base tok/s (rounds) | this tok/s (rounds) | this / base, medians |\n| --- | --- | --- | --- |")
    for c in map(str, levels):
        medians = {s: statistics.median(runs[s][c]) for s in SIDES}
        summary[c] = {"medians": medians, "this_over_base": round(medians["this"] / medians["base"], 3)}
        print(f"| {c} | {medians['base']:.0f} ({', '.join(f'{x:.0f}' for x in runs['base'][c])}) | "
              f"{medians['this']:.0f} ({', '.join(f'{x:.0f}' for x in runs['this'][c])}) | "
              f"{summary[c]['this_over_base']:.2f} |")
    report = {"benchmark": "model_pair", "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
              "machine": machine.describe(), "base": base, "this": this, "this_args": args.this_arg,
              "tokens_per_chat": args.tokens, "runs": runs, "summary": summary}
    relay.RESULTS.mkdir(parents=True, exist_ok=True)
    (relay.RESULTS / "model_pair.json").write_text(json.dumps(report, indent=2) + "\n")


def parse_args() -> Any:
    parser = comparison_parser(__doc__)
    parser.add_argument("--chats", default="1,16,64", help="concurrent chats, comma-separated levels")
    parser.add_argument("--tokens", type=int, default=128, help="tokens a chat")
    return parser.parse_args()


if __name__ == "__main__":
    started = time.monotonic()
    asyncio.run(main(parse_args()))
    print(f"({time.monotonic() - started:.0f} s)")
