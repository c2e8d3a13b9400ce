"""Prometheus metrics, named the way vLLM names its own (`fairway:` instead of `vllm:`).

Where each is measured:
* replica (where the tokens happen): time to first token, inter-token latency, end-to-end
  latency, prompt and generation tokens (labels model, tier), and the engine's own counters,
  read from each engine's last EngineStats when scraped (labels model, replica);
* gateway's accounting (once per reply, in whichever gateway records its end): replies ended, by
  finish reason (vLLM's request_success, labels model and finished_reason);
* gateway: chat requests by HTTP status and outcome (each request once, a shared generation's
  too: tokens and latencies above count generations, this counts requests), active SSE streams
  (label model), requests refused by a limit (label type), and the router's placements (labels
  model, reason).

The embedded server (`fairway serve`) has both in one process: its /metrics shows everything. At
scale each gateway serves its own /metrics, and each replica process serves its own on its health
port (fairway/replica/health.py); Prometheus scrapes them all and sums.
* fleet manager (`fairway fleet --metrics-port`): its replicas by state, the arrivals it saw and
  forecast, its scaling actions (labels direction, reason), and whether it is holding the fleet as
  it is because a source of its signals is unreachable (label source).
"""

from __future__ import annotations

import gc
import threading
import time
from collections.abc import Iterator
from typing import Any

from prometheus_client import REGISTRY, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from fairway.domain import FinishReason

# vLLM's buckets, trimmed: CPU replicas are slower, GPU ones faster; both fit.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0)
ITL_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
               480.0, 960.0)

TIME_TO_FIRST_TOKEN = Histogram("fairway:time_to_first_token_seconds",
                                "Time from submission to the first token, per reply.", ["model", "tier"],
                                buckets=TTFT_BUCKETS)
INTER_TOKEN_LATENCY = Histogram("fairway:inter_token_latency_seconds", "Time between consecutive tokens.",
                                ["model", "tier"], buckets=ITL_BUCKETS)
E2E_REQUEST_LATENCY = Histogram("fairway:e2e_request_latency_seconds",
                                "Time from submission to the final event, per reply.", ["model", "tier"],
                                buckets=E2E_BUCKETS)
PROMPT_TOKENS = Counter("fairway:prompt_tokens", "Prompt tokens of finished replies.", ["model", "tier"])
GENERATION_TOKENS = Counter("fairway:generation_tokens", "Generated tokens.", ["model", "tier"])
REQUEST_SUCCESS = Counter("fairway:request_success", "Replies that ended, by why (vLLM's name): stop, length, "
                          "tool_calls, content_filter, abort (cancelled or failed). A generation shared by identical "
                          "requests (single flight) counts once, as the token counters do.",
                          ["model", "finished_reason"])
CHAT_REQUESTS = Counter("fairway:chat_requests", "Chat completion requests this gateway answered, by HTTP status "
                        "and outcome: generated (a generation of its own), shared (single flight: an identical "
                        "request's generation), replayed (an idempotent resend), resumed (last_received_token_index), "
                        "else the error's code.",
                        ["status", "outcome"])
ACTIVE_STREAMS = Gauge("fairway:active_streams", "SSE streams this gateway is sending now.", ["model"])
ROUTER_PLACEMENTS = Counter("fairway:router_placements", "Replies placed by this gateway's router, by why that "
                            "replica: affinity (the most cached prefix), overflow (the best-scoring one was "
                            "too loaded), least-loaded (nothing cached anywhere), round-robin.",
                            ["model", "reason"])
FREE_AT_CAPACITY = Counter("fairway:free_at_capacity", "Free requests that found their model's pool at capacity "
                           "(predicted wait over the limit), by what they got: shed (503), mini (the mini "
                           "pool served), shorten (fewer max tokens).", ["model", "treatment"])
RATE_LIMITED = Counter("fairway:rate_limited", "Requests refused by a limit: tokens (TPM), requests (RPM), "
                       "admission (the gateway's queue was full or timed out).", ["type"])

FLEET_REPLICAS = Gauge("fairway:fleet_replicas", "The fleet manager's replicas: target, desired (the backend's), "
                       "ready, serving (announced, not draining).", ["state"])
FLEET_ARRIVALS = Gauge("fairway:fleet_arrivals_per_second", "Replies arriving per second over the fleet "
                       "(last sample), and the forecast the manager scales for.", ["kind"])
FLEET_HORIZON = Gauge("fairway:fleet_forecast_horizon_seconds", "How far ahead the fleet manager's forecast "
                      "looks: --lead, or the replicas' measured start-up time plus a tick when longer.")
FLEET_SCALING = Counter("fairway:fleet_scaling", "Scaling actions of the fleet manager.", ["direction", "reason"])
FLEET_HOLDING = Gauge("fairway:fleet_holding", "1 while the fleet manager keeps the fleet as it is because a "
                      "source of its signals does not answer (label source: registry, backend).", ["source"])


class EngineCollector(Collector):
    """The engines' counters, read at scrape time from AsyncEngine.last_stats (set after every
    engine step), so the engine loop pays nothing for being observed."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._engines: dict[str, tuple[str, Any]] = {}  # replica id -> (model, AsyncEngine)

    def track(self, replica_id: str, model: str, engine: Any) -> None:
        with self._lock:
            self._engines[replica_id] = (model, engine)

    def untrack(self, replica_id: str) -> None:
        with self._lock:
            self._engines.pop(replica_id, None)

    def collect(self) -> Iterator[Any]:
        labels = ["model", "replica"]
        kv = GaugeMetricFamily("fairway:kv_cache_usage_perc", "KV cache blocks in use (1 = 100%).", labels=labels)
        running = GaugeMetricFamily("fairway:num_requests_running", "Sequences in the running batch.", labels=labels)
        waiting = GaugeMetricFamily("fairway:num_requests_waiting", "Sequences waiting to be scheduled.",
                                    labels=labels)
        queries = CounterMetricFamily("fairway:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                                      labels=labels)
        hits = CounterMetricFamily("fairway:prefix_cache_hits", "Prompt tokens found in the prefix cache.",
                                   labels=labels)
        preemptions = CounterMetricFamily("fairway:num_preemptions", "Sequences preempted (recomputed later).",
                                          labels=labels)
        # Speculative decoding, as vLLM counts it: verifications with draft tokens, draft tokens
        # checked, draft tokens accepted, and the share accepted.
        drafts = CounterMetricFamily("fairway:spec_decode_num_drafts", "Verifications of draft tokens.",
                                     labels=labels)
        draft_tokens = CounterMetricFamily("fairway:spec_decode_num_draft_tokens", "Draft tokens proposed.",
                                           labels=labels)
        accepted = CounterMetricFamily("fairway:spec_decode_num_accepted_tokens", "Draft tokens accepted.",
                                       labels=labels)
        rate = GaugeMetricFamily("fairway:spec_decode_draft_acceptance_rate",
                                 "Draft tokens accepted over proposed, since start (0 before any).", labels=labels)
        with self._lock:
            engines = list(self._engines.items())
        for replica_id, (model, engine) in engines:
            stats = engine.last_stats
            values = [model, replica_id]
            kv.add_metric(values, stats.kv_usage)
            running.add_metric(values, stats.num_running)
            waiting.add_metric(values, stats.num_waiting)
            queries.add_metric(values, stats.prefix_cache_queries)
            hits.add_metric(values, stats.prefix_cache_hits)
            preemptions.add_metric(values, stats.num_preemptions)
            drafts.add_metric(values, stats.spec_decode_num_drafts)
            draft_tokens.add_metric(values, stats.spec_decode_num_draft_tokens)
            accepted.add_metric(values, stats.spec_decode_num_accepted_tokens)
            rate.add_metric(values, stats.spec_decode_acceptance_rate)
        yield from (kv, running, waiting, queries, hits, preemptions, drafts, draft_tokens, accepted, rate)


ENGINES = EngineCollector()
REGISTRY.register(ENGINES)


def observe_reply(model: str, tier: str, ttft_s: float | None, e2e_s: float, prompt_tokens: int,
                  generation_tokens: int) -> None:
    """At a reply's end, with the counts its usage record gets."""
    if ttft_s is not None:
        TIME_TO_FIRST_TOKEN.labels(model, tier).observe(ttft_s)
    E2E_REQUEST_LATENCY.labels(model, tier).observe(e2e_s)
    PROMPT_TOKENS.labels(model, tier).inc(prompt_tokens)
    GENERATION_TOKENS.labels(model, tier).inc(generation_tokens)


_SUCCESS_MODELS: set[str] = set()


def observe_success(model: str, finish_reason: str | None, failed: bool) -> None:
    """One ended reply under its finish reason (FinishReason's values, the code base's one list);
    a failed one, or a reason not in the list, as abort. A model's every reason is shown from its
    first reply on, at 0 until it happens, so a rate over it starts at once (as vLLM does)."""
    if model not in _SUCCESS_MODELS:
        _SUCCESS_MODELS.add(model)
        for reason in FinishReason:
            REQUEST_SUCCESS.labels(model, reason.value)
    known = {reason.value for reason in FinishReason}
    reason = FinishReason.ABORT.value if failed or finish_reason not in known else str(finish_reason)
    REQUEST_SUCCESS.labels(model, reason).inc()


# Safety (fairway/safety/): measured where the check runs, the gateway (input, api) or the replica (output).
SAFETY_CHECK_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)
SAFETY_FLAGGED = Counter("fairway:safety_flagged", "Texts flagged by the safety check, per category: stage input "
                         "(a refused message), output (a stopped reply) or api (/v1/moderations).",
                         ["stage", "category"])
SAFETY_CHECK_SECONDS = Histogram("fairway:safety_check_seconds", "Time the safety classifiers took per check.",
                                 ["stage"], buckets=SAFETY_CHECK_BUCKETS)


def observe_safety(stage: str, seconds: float, flagged_categories: list[str]) -> None:
    SAFETY_CHECK_SECONDS.labels(stage).observe(seconds)
    for category in flagged_categories:
        SAFETY_FLAGGED.labels(stage, category).inc()


# The cyclic garbage collector stops the whole process while it runs (every stream's events wait):
# each collection's time, by generation, in every process that imports this module.
# fairway/server_gc.py sets how often each generation is collected, which sets these pauses.
GC_PAUSE_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)
GC_PAUSE = Histogram("fairway:gc_pause_seconds", "Time the process stood still in one cyclic garbage collection.",
                     ["generation"], buckets=GC_PAUSE_BUCKETS)


class _GcTimer:
    """Times each collection: gc.callbacks calls it as one starts and as it stops (collections never
    overlap: they run under the GIL, and nothing a callback allocates starts another)."""

    def __init__(self) -> None:
        self.started = 0.0
        self.pauses = [GC_PAUSE.labels(str(generation)) for generation in range(3)]

    def __call__(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self.started = time.perf_counter()
        else:
            self.pauses[info["generation"]].observe(time.perf_counter() - self.started)


gc.callbacks.append(_GcTimer())
