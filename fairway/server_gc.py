"""The cyclic garbage collector, set for a long-running server process.

Python's collector walks every tracked object of a generation it collects. A gateway relaying
hundreds of streams holds ~200 such objects a stream (tasks, frames, dicts), and a replica holds
PyTorch's and the engine's too, so with the default thresholds (700, 10, 10) a full collection
came every few seconds and stopped the whole process (bench/README.md, relay.py): every event in
flight waited, which set the relay's p99 delay.

settle_heap(), once the process has started (modules imported, app and model loaded): what exists
then lives as long as the process, so it is frozen out of collections for good; and collections
of what comes later are set for short pauses that come rarely enough:
* the youngest generation every YOUNG_THRESHOLD allocations (net of frees) instead of 700;
* the middle one every MIDDLE_THRESHOLD young collections. A middle collection walks everything
  that survived the young ones since the last, at hundreds of streams mostly their live objects,
  so it is the process's longest regular pause, long enough at 10 young ones of 20,000 to set
  the relay's p99 delay; 2 young ones' survivors keep it short, at the same CPU in all
  (bench/README.md, relay.py, "Garbage collection pauses");
* a full collection once per OLD_THRESHOLD middle ones instead of 10 (about as rarely as before).
Each collection's time is the `fairway:gc_pause_seconds` metric (usage/metrics.py). Cyclic
garbage waits a little longer to be freed; nothing else changes.
"""

from __future__ import annotations

import gc

YOUNG_THRESHOLD = 10_000
MIDDLE_THRESHOLD = 2
OLD_THRESHOLD = 1000


def settle_heap() -> None:
    gc.collect()
    gc.freeze()
    gc.set_threshold(YOUNG_THRESHOLD, MIDDLE_THRESHOLD, OLD_THRESHOLD)
