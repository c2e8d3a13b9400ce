"""The gateway's C path for one relayed token event, this working tree against another revision:
the Pub/Sub dispatcher parsing a socket read, finding the stream's tap, and its token writer
formatting the event, handing it to the connection and keeping the reply's text.

N streams (800, relay.py's largest passing level) take turns as they do in a gateway: each read
holds 25 events of different streams, every stream one event a round. "cold": before each read a
48 MB buffer is walked, as the gateway's other work between two events of one stream (~33 ms
apart at 30 tokens a second) pushes that stream's state out of the caches; "warm": nothing in
between. The transports are C callables (no socket), so the figure is the user-space work relay.py
cannot separate from the kernel's. Each side runs in its own process, taking turns round by round;
medians of ns per event. Results: bench/results/event_path.json.

    .venv/bin/python bench/event_path.py --base 0ab41d4 --rounds 5

A revision from before issue 14's re-cut (the taps of fairway/relay/live_fast.py) is driven
through its own API, with the same streams and payloads.
"""

from __future__ import annotations

import datetime
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

import machine  # noqa: E402
from gateway_requests import comparison_parser, this_tree, worktree  # noqa: E402

STREAMS, ROUNDS_OF_EVENTS, PER_READ, THRASH_MB = 800, 40, 25, 48

# Run in the side's own interpreter with the side's tree first on sys.path; prints ns an event.
SIDE = r"""
import random, sys, time
from collections import deque
import numpy as np
from redis.exceptions import ResponseError
from fairway.relay.events import TokenEvent
from fairway.relay.redis_live import live_payload

streams, rounds, per_read, thrash_mb, cold = (int(a) for a in sys.argv[1:6])


class Transport:  # what the writer calls: C callables, as uvloop's transport methods are
    def __init__(self):
        self.is_closing, self.get_write_buffer_size, self.write = bool, int, deque(maxlen=1).append


def ids(i):
    return f"rep_{i:024x}", f"conv_{i:024x}", f"msg_{i:024x}"


try:  # after the re-cut: the dispatcher's taps hand events to the gateway's token writer
    from fairway.gateway import token_writer
    from fairway.gateway.sse import ReplyView, token_template
    from fairway.redis_client import dispatch

    module = dispatch.native_module()
    tap_class, dispatcher_class = module.Tap, module.Dispatcher
    table_class = getattr(module, "TapTable", dict)  # (a dict before the TapTable)
    writer_class = token_writer.native_module().TokenWriter
    keeps_text = hasattr(writer_class, "add_text")

    def tap(i, transport):
        template = token_template(ReplyView(*ids(i), "smollm2", 1796060482))
        writer = writer_class(template, transport) if keeps_text else writer_class(template, [], transport)
        return tap_class(writer)
except ImportError:  # before it: fairway/relay/live_fast.py's taps write the chunk themselves
    from fairway.relay import live_fast

    tap_class, dispatcher_class = live_fast.native_module().Tap, live_fast.native_module().Dispatcher
    table_class = dict

    def tap(i, transport):
        reply, conversation, message = ids(i)
        head = (f'{{"id":"{reply}","object":"chat.completion.chunk","created":1796060482,"model":"smollm2",'
                f'"conversation_id":"{conversation}","message_id":"{message}","choices":[{{"index":0,'
                f'"delta":{{"content":').encode()
        return tap_class(head, print, [], True, transport)

keep = [Transport() for _ in range(streams)]
taps = table_class()
for i in range(streams):
    taps[f"fairway:reply:{{{ids(i)[0]}}}:live"] = tap(i, keep[i])


def message(channel, n, text):
    parts = [b"smessage", channel.encode(), (f"{n} " + live_payload(TokenEvent(n, text, [n]))).encode()]
    return b"*3\r\n" + b"".join(b"$%d\r\n%b\r\n" % (len(p), p) for p in parts)


rng, reads = random.Random(1), []
for n in range(1, rounds + 1):
    order = [f"fairway:reply:{{{ids(i)[0]}}}:live" for i in range(streams)]
    rng.shuffle(order)
    events = [message(channel, n, " word") for channel in order]
    reads += [b"".join(events[i:i + per_read]) for i in range(0, streams, per_read)]
dispatcher = dispatcher_class(taps, ResponseError)
junk = np.zeros(thrash_mb << 20, np.uint8)
spent = 0.0
for data in reads:
    if cold:
        junk[::64] += 1
    started = time.perf_counter()
    rest = dispatcher.feed(data, 0.0)
    spent += time.perf_counter() - started
    assert not rest, rest[:1]  # every event went the C path
print(spent / (streams * rounds) * 1e9)
"""


def side_ns(root: Path, cold: bool) -> float:
    code = f"import sys; sys.path.insert(0, {str(root)!r})\n" + SIDE
    out = subprocess.run([sys.executable, "-c", code, str(STREAMS), str(ROUNDS_OF_EVENTS), str(PER_READ),
                          str(THRASH_MB), str(int(cold))], cwd=root, check=True, capture_output=True, text=True)
    return float(out.stdout.split()[-1])


def main() -> None:
    args = comparison_parser(__doc__, this_arg=False).parse_args()
    results: dict[str, dict[str, list[float]]] = {"base": {"cold": [], "warm": []}, "this": {"cold": [], "warm": []}}
    with tempfile.TemporaryDirectory(prefix="fairway-event-path-") as tmp, \
            worktree(args.base, Path(tmp) / "base") as base:
        this = this_tree()
        print(f"ns of the gateway's C path a relayed event, {STREAMS} streams: {base} vs this tree ({this})")
        sides = [("base", Path(tmp) / "base"), ("this", ROOT)]
        for r in range(args.rounds):
            for name, root in (sides if r % 2 == 0 else sides[::-1]):
                for state in ("cold", "warm"):
                    results[name][state].append(round(side_ns(root, state == "cold")))
            print(f"  round {r + 1}: " + "   ".join(
                f"{state} {results['base'][state][-1]} / {results['this'][state][-1]}" for state in ("cold", "warm")),
                flush=True)
    summary = {}
    for state in ("cold", "warm"):
        medians = {name: statistics.median(results[name][state]) for name in ("base", "this")}
        summary[state] = {"median_ns": medians, "this_over_base": round(medians["this"] / medians["base"], 3)}
        print(f"{state}: median {medians['base']:.0f} vs {medians['this']:.0f} ns an event "
              f"(this / base = {summary[state]['this_over_base']})")
    report = {"benchmark": "event_path", "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
              "machine": machine.describe(), "base": base, "this": this, "streams": STREAMS,
              "events_a_read": PER_READ, "thrash_mb": THRASH_MB, "rounds": results, "summary": summary}
    out = ROOT / "bench" / "results" / "event_path.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
