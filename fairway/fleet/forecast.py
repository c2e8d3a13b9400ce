"""Demand forecast: Holt's linear trend (double exponential smoothing) over per-second arrivals.

Two smoothed numbers are kept: the level (arrivals per second now, noise smoothed away) and the
trend (how fast the level changes, per second). Each new rate x, dt seconds after the last one:

    level' = alpha * x + (1 - alpha) * (level + trend * dt)
    trend' = beta * (level' - level) / dt + (1 - beta) * trend

and the forecast h seconds ahead is level + trend * h. A ramp shows in the trend before it shows
in the queues, so the fleet can start a replica one start-up time ahead of the load it is for;
alpha and beta set how fast level and trend forget (larger: quicker, noisier). Holt's method
needs no history window and no fitting, and is explained in one paragraph.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class HoltForecaster:
    alpha: float = 0.3
    beta: float = 0.1
    level: float | None = None  # None until the first observation
    trend: float = 0.0

    def __post_init__(self) -> None:
        for name in ("alpha", "beta"):
            value = getattr(self, name)
            if not 0.0 < value <= 1.0:
                raise ValueError(f"the forecast's {name} must be in (0, 1], got {value}")

    def observe(self, rate: float, dt: float = 1.0) -> None:
        """A new arrivals-per-second figure, dt seconds after the previous one."""
        if self.level is None:
            self.level = rate
            return
        dt = max(dt, 1e-3)
        previous = self.level
        self.level = self.alpha * rate + (1 - self.alpha) * (previous + self.trend * dt)
        self.trend = self.beta * (self.level - previous) / dt + (1 - self.beta) * self.trend

    def forecast(self, horizon_s: float) -> float:
        """Arrivals per second expected horizon_s from now (never below zero); 0 before any data."""
        if self.level is None:
            return 0.0
        return max(0.0, self.level + self.trend * horizon_s)
