"""Which of a model's live replicas gets a request: prefix affinity, then overflow.

Score: how many of the prompt's leading full KV blocks a replica reports cached (its heartbeat's
prefix summary). The best-scoring replica saves the most prefill, and keeping a conversation on
one replica keeps its history's blocks in one cache instead of copies in several.

Overflow: affinity alone would pile every conversation that shares a system prompt onto the one
replica that cached it first. So a replica whose load exceeds the least loaded one's by more than
both thresholds (absolute and relative) is passed over: the request goes to the best-scoring
replica within them, the least loaded itself when no other scores. The least loaded always is.

Round-robin, for comparison (bench/routing.py): each in turn, load and cache ignored.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

from fairway.replica.registry import ReplicaInfo
from fairway.router.pressure import PressureSettings

Routing = Literal["affinity", "round-robin"]
ROUTINGS: tuple[Routing, ...] = ("affinity", "round-robin")


@dataclass
class RouterSettings:
    routing: Routing = "affinity"
    # Overflow when the best-scoring replica has more than overflow_abs replies AND more than
    # overflow_rel times as many again as the least loaded.
    overflow_abs: int = 4
    overflow_rel: float = 0.5
    cache_s: float = 0.5  # how long a look at the registry serves (heartbeats come every 0.5 s)
    pressure: PressureSettings = field(default_factory=PressureSettings)  # free requests at capacity


@dataclass(frozen=True)
class Choice:
    replica: ReplicaInfo
    score: int  # leading prompt blocks it has cached
    reason: Literal["affinity", "overflow", "least-loaded", "round-robin"]


def within(load: int, least: int, settings: RouterSettings) -> bool:
    """Not overloaded next to the least loaded replica."""
    excess = load - least
    return excess <= settings.overflow_abs or excess <= settings.overflow_rel * least


def choose(candidates: list[ReplicaInfo], load: Callable[[ReplicaInfo], int], score: Callable[[ReplicaInfo], int],
           settings: RouterSettings, turn: int) -> Choice:
    """Candidates in a stable order (by id); turn rotates ties (and round-robin)."""
    if settings.routing == "round-robin":
        return Choice(candidates[turn % len(candidates)], 0, "round-robin")
    loads = {r.id: load(r) for r in candidates}
    scores = {r.id: score(r) for r in candidates}
    least = min(loads.values())
    top = max(scores.values())
    ok = [r for r in candidates if within(loads[r.id], least, settings)]
    best = max(scores[r.id] for r in ok)
    # Among the best-scoring acceptable replicas, the least loaded; ties rotate.
    ties = [r for r in ok if scores[r.id] == best]
    lightest = min(loads[r.id] for r in ties)
    ties = [r for r in ties if loads[r.id] == lightest]
    picked = ties[turn % len(ties)]
    reason = "least-loaded" if top == 0 else "affinity" if best == top else "overflow"
    return Choice(picked, best, reason)
