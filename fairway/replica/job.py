"""A generation job: what a gateway asks a replica to produce for one reply.

It crosses the reply bus as JSON, so it holds plain data only. The sampling fields are those of
the engine's SamplingParams; the replica builds and validates those (a gateway imports no torch).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from fairway.domain import Lane


def replica_queue(replica_id: str) -> str:
    """The bus queue a replica claims from: one per replica, so the router decides placement."""
    return f"replica:{replica_id}"


@dataclass
class GenerationJob:
    reply_id: str
    model: str
    prompt_token_ids: list[int]
    sampling: dict[str, Any] = field(default_factory=dict)  # SamplingParams keyword arguments
    lane: str = Lane.FREE.value
    tier: str = ""  # the user's tier (metrics labels); the lane is what schedules
    submitted_at: float = 0.0  # wall clock (epoch s) when the gateway submitted it: TTFT counts from here
    tools: dict[str, Any] = field(default_factory=dict)  # fairway.tools.ToolSet.to_dict(); empty: no tools
    tenant: str = ""  # the user it answers: the sandbox's tenant (its fair share of runs)
    # Times a failover handed it on. From 1 the reply may have tokens in its log already: the
    # replica carries on after them (worker.serve).
    attempt: int = 0
    # Which run of the reply it produces (Reply.restarts when submitted: 0 at first, the claimed
    # run at a restart; a handoff keeps it): its appends name it, so a log made again for a later
    # run refuses them, and a replica still running an earlier run gives way to it (worker.serve).
    # None: a gateway of the previous version said nothing, and nothing is checked.
    run: int | None = 0

    def to_dict(self) -> dict[str, Any]:
        # A copy, of plain data. (dataclasses.asdict deep-copies the prompt's token ids one by one,
        # and this runs twice per chat request.)
        return {**vars(self), "prompt_token_ids": list(self.prompt_token_ids),
                "sampling": {k: list(v) if isinstance(v, list) else dict(v) if isinstance(v, dict) else v
                             for k, v in self.sampling.items()}}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> GenerationJob:
        return cls(
            reply_id=str(data["reply_id"]),
            model=str(data["model"]),
            prompt_token_ids=[int(t) for t in data["prompt_token_ids"]],
            sampling=dict(data.get("sampling") or {}),
            lane=str(data.get("lane") or Lane.FREE.value),
            tier=str(data.get("tier") or ""),
            submitted_at=float(data.get("submitted_at") or 0.0),
            tools=dict(data.get("tools") or {}),
            tenant=str(data.get("tenant") or ""),
            attempt=int(data.get("attempt") or 0),
            run=None if data.get("run") is None else int(data["run"]),
        )
