"""Usage and telemetry: per-reply usage records and cost (accounting.py, pricing.py) and the
Prometheus metrics (metrics.py).

Kept import-free here: the replica imports fairway.usage.metrics, and must not pull in the
gateway or the store through this package.
"""
