"""OpenAI's rate-limit headers, from the state of a user's request window and token window."""

from __future__ import annotations

import math

from fairway.limits.window import WindowState


def format_reset(seconds: float) -> str:
    """A duration the way OpenAI writes it (Go's time.Duration): "0s", "17ms", "1s", "7.66s",
    "6m0s", "1h2m3s". Sub-second values in whole milliseconds, rounded up, so a client that
    waits exactly this long is never early."""
    if seconds <= 0:
        return "0s"
    ms = math.ceil(seconds * 1000)
    if ms < 1000:
        return f"{ms}ms"
    hours, ms = divmod(ms, 3_600_000)
    minutes, ms = divmod(ms, 60_000)
    secs = f"{ms / 1000:.3f}".rstrip("0").rstrip(".")
    if hours:
        return f"{hours}h{minutes}m{secs}s"
    if minutes:
        return f"{minutes}m{secs}s"
    return f"{secs}s"


def request_rate_headers(requests: WindowState) -> dict[str, str]:
    """The x-ratelimit-*-requests headers alone: a per-IP 429 carries its own window's, and none
    of the user's (a client backing off reads the limit that refused it)."""
    return {
        "x-ratelimit-limit-requests": str(requests.limit),
        "x-ratelimit-remaining-requests": str(requests.remaining),
        "x-ratelimit-reset-requests": format_reset(requests.reset_s),
    }


def rate_limit_headers(requests: WindowState, tokens: WindowState) -> dict[str, str]:
    return {
        **request_rate_headers(requests),
        "x-ratelimit-limit-tokens": str(tokens.limit),
        "x-ratelimit-remaining-tokens": str(tokens.remaining),
        "x-ratelimit-reset-tokens": format_reset(tokens.reset_s),
    }
