"""A snapshot of the engine's counters, for logs, metrics and benchmarks."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class EngineStats:
    num_running: int
    num_waiting: int
    kv_blocks_total: int
    kv_blocks_used: int
    kv_slots_total: int  # token slots = blocks * block size
    kv_slots_used: int  # slots in blocks held by sequences
    kv_tokens_live: int  # tokens of running sequences actually stored in those slots
    prefix_cache_queries: int  # prompt tokens looked up, in tokens
    prefix_cache_hits: int
    num_preemptions: int
    num_steps: int
    step_seconds: float  # wall time inside step()
    forward_seconds: float  # of which: model forward and sampling
    # Speculative decoding: verifications with draft tokens, draft tokens checked, and accepted.
    spec_decode_num_drafts: int = 0
    spec_decode_num_draft_tokens: int = 0
    spec_decode_num_accepted_tokens: int = 0

    @property
    def spec_decode_acceptance_rate(self) -> float:
        n = self.spec_decode_num_draft_tokens
        return self.spec_decode_num_accepted_tokens / n if n else 0.0

    @property
    def kv_usage(self) -> float:
        return self.kv_blocks_used / self.kv_blocks_total if self.kv_blocks_total else 0.0

    @property
    def kv_utilization(self) -> float:
        """Live tokens over allocated slots: how little of the allocated cache is padding."""
        return self.kv_tokens_live / self.kv_slots_used if self.kv_slots_used else 1.0
