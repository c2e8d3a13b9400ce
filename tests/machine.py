"""Test helper: whether this machine was the test's while it measured a latency.

A latency bound set from what the system did idle holds only while the machine stays as it was:
on a shared machine another job's processes (at a higher priority than the suite's `nice -n 19`)
can take most of the CPUs for a while, and a developer's tools may stop the suite's processes
outright (SIGSTOP) while they measure. Neither is the code under test's doing.

Others: the share of the CPUs everything else on the machine used (the machine's busy time,
psutil.cpu_times, less this process's and its descendants', those that ended included: a reaped
child's time is in its parent's children_* times), in its busiest WINDOW_S of a period: a queue
builds within seconds of a replica losing its CPU, so a busy spell counts, not the period's mean.
Pauses: a thread that sleeps 20 ms and notes how much longer it slept; a stopped process notes
the whole stop when it runs again.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

import psutil

PAUSE_S = 0.5  # a sleep of 20 ms that took this much longer: the test's processes did not run
SAMPLE_S = 0.5  # how often the CPU times are read
WINDOW_S = 4.0  # others' share is that of the busiest window this long


def _busy_s() -> float:
    t = psutil.cpu_times()
    return t.user + t.nice + t.system + getattr(t, "irq", 0) + getattr(t, "softirq", 0) + getattr(t, "steal", 0)


def _ours_s() -> float:
    me = psutil.Process()
    for _ in range(5):
        before = me.cpu_times()
        total = 0.0
        for child in me.children(recursive=True):
            try:
                total += sum(child.cpu_times()[:4])  # its own and its reaped children's
            except psutil.Error:  # ended and reaped since the listing: its time moved to ours
                pass
        after = me.cpu_times()
        if after[2:4] == before[2:4]:  # no child reaped meanwhile: none counted twice or missed
            return total + sum(after[:4])  # user, system, children_user, children_system
    return total + sum(after[:4])


@dataclass(frozen=True)
class Mark:
    at: float  # monotonic
    busy_s: float
    ours_s: float


def mark() -> Mark:
    return Mark(time.monotonic(), _busy_s(), _ours_s())


def share(a: Mark, b: Mark) -> float:
    """Others' share of the CPUs between two marks."""
    others = (b.busy_s - a.busy_s) - (b.ours_s - a.ours_s)
    return max(0.0, others) / (max(b.at - a.at, 1e-3) * psutil.cpu_count())


class Machine(threading.Thread):
    """Started before what it watches, stopped (done.set()) after."""

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.pauses: list[tuple[float, float]] = []  # (monotonic when it began, seconds)
        self.marks: list[Mark] = []
        self.done = threading.Event()

    def run(self) -> None:
        last = next_mark = time.monotonic()
        while not self.done.wait(0.02):
            now = time.monotonic()
            if now - last - 0.02 > PAUSE_S:
                self.pauses.append((last, now - last))
            if now >= next_mark:
                self.marks.append(mark())
                next_mark = now + SAMPLE_S
            last = now

    def others(self, since: float, until: float) -> float:
        """Others' share of the CPUs in the busiest WINDOW_S within [since, until] (monotonic)
        (over the whole of it when it is shorter)."""
        marks = [m for m in self.marks if since <= m.at <= until]
        if len(marks) < 2:
            return 0.0
        if marks[-1].at - marks[0].at <= WINDOW_S:
            return share(marks[0], marks[-1])
        busiest, j = 0.0, 0
        for i, a in enumerate(marks):
            j = max(j, i + 1)
            while j < len(marks) and marks[j].at - a.at < WINDOW_S:
                j += 1
            if j == len(marks):
                break
            busiest = max(busiest, share(a, marks[j]))
        return busiest

    def paused(self, since: float, until: float) -> float:
        """Seconds of pauses that overlap [since, until]."""
        return sum(max(0.0, min(at + s, until) - max(at, since)) for at, s in self.pauses)
