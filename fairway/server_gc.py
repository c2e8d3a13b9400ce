"""The cyclic garbage collector, set for a long-running server process.

Python's collector walks every tracked object of a generation it collects. A gateway relaying
hundreds of streams holds ~200 such objects a stream (tasks, frames, dicts), and a replica holds
PyTorch's and the engine's too, so with the default thresholds (700, 10, 10) a full collection
came every few seconds and stopped the whole process (bench/README.md, relay.py): every event in
flight waited, which set the relay's p99 delay.

settle_heap(), once the process has started (modules imported, app and model loaded): what exists
then lives as long as the process, so it is frozen out of collections for good; and collections
of what comes later are made rarer (the youngest generation collected every YOUNG_THRESHOLD
allocations instead of 700, a full collection once per OLD_THRESHOLD middle ones instead of 10).
Cyclic garbage waits a little longer to be freed; nothing else changes.
"""

from __future__ import annotations

import gc

YOUNG_THRESHOLD = 20_000
MIDDLE_THRESHOLD = 10
OLD_THRESHOLD = 100


def settle_heap() -> None:
    gc.collect()
    gc.freeze()
    gc.set_threshold(YOUNG_THRESHOLD, MIDDLE_THRESHOLD, OLD_THRESHOLD)
