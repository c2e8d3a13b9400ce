"""Limits configuration: per-tier quotas, window shape, TTLs, admission bounds, Redis timeouts."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from fairway.domain import Tier


@dataclass(frozen=True)
class TierLimits:
    tokens_per_minute: int  # prompt + completion tokens, per user per model
    requests_per_minute: int  # per user, all models together


def default_tiers() -> dict[str, TierLimits]:
    # Background (batch) work is high-volume but the lowest lane; its quota keeps it from starving
    # nobody else, while lanes decide who runs first.
    return {
        Tier.FREE: TierLimits(tokens_per_minute=40_000, requests_per_minute=60),
        Tier.PAID: TierLimits(tokens_per_minute=400_000, requests_per_minute=600),
        Tier.BUSINESS: TierLimits(tokens_per_minute=2_000_000, requests_per_minute=3_000),
        Tier.BACKGROUND: TierLimits(tokens_per_minute=1_000_000, requests_per_minute=1_000),
    }


@dataclass
class LimitsConfig:
    tiers: dict[str, TierLimits] = field(default_factory=default_tiers)
    # model -> tier -> TPM: a bigger model can get a smaller quota than the tier default.
    model_tokens_per_minute: dict[str, dict[str, int]] = field(default_factory=dict)
    # Per client IP, whatever the user: one NAT can hold many users, so well above a user's RPM.
    ip_requests_per_minute: int = 1_200
    # Sliding window: `buckets` counters of window_s/buckets seconds each (1 s by default).
    window_s: float = 60.0
    buckets: int = 60
    idempotency_ttl_s: float = 24 * 3600.0
    # A claim not yet attached to a reply expires sooner (idempotency.py says why).
    idempotency_claim_ttl_s: float = 60.0
    # Admission, per gateway process.
    max_in_flight: int = 256
    max_waiting: int = 1_024
    admission_timeout_s: float = 5.0
    # Single-flight: how long a published reply id serves identical requests (keep it within the
    # token log's retention), and how long a follower waits for the leader to publish one.
    flight_ttl_s: float = 120.0
    flight_wait_s: float = 10.0
    # Redis: fail fast. No command here blocks server-side, so a second is plenty.
    prefix: str = "fairway:"
    connect_timeout_s: float = 0.5
    socket_timeout_s: float = 1.0
    # Tests inject a clock; None = Redis server time (one clock for all gateways) / time.monotonic.
    clock: Callable[[], float] | None = None

    def tier(self, tier: str) -> TierLimits:
        # An unknown tier gets the least privileged limits rather than a 500 on every request.
        return self.tiers.get(str(tier)) or self.tiers.get(Tier.FREE) or default_tiers()[Tier.FREE]

    def tokens_per_minute(self, tier: str, model: str) -> int:
        override = self.model_tokens_per_minute.get(model, {}).get(str(tier))
        return override if override is not None else self.tier(tier).tokens_per_minute

    @property
    def bucket_s(self) -> float:
        return self.window_s / self.buckets
