"""Errors the limits layer raises on purpose; each maps to one answer the gateway gives."""

from __future__ import annotations

import math


class LimitsError(Exception):
    """Base class for everything fairway.limits raises on purpose."""


class LimitsUnavailable(LimitsError):
    """The shared store (Redis) cannot be reached in time. The gateway answers 503 at once
    rather than hang, and never admits a request it could not count."""


class Overloaded(LimitsError):
    """No admission slot came free in time, or the waiting room is full (gateway: 503 + Retry-After)."""

    def __init__(self, retry_after: float, reason: str) -> None:
        super().__init__(f"overloaded ({reason}); retry after {retry_after:.1f}s")
        self.retry_after = retry_after
        self.reason = reason  # "queue_full" (refused without waiting) or "timeout" (waited, no slot)

    @property
    def retry_after_header(self) -> str:
        """Retry-After takes whole seconds (RFC 9110); round up so clients never come back early."""
        return str(max(1, math.ceil(self.retry_after)))
