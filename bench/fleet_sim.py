"""The fleet beyond one machine, by simulation: a day of chat traffic peaking at 500,000
concurrent streams, served by replicas whose speed comes from a measured profile, scaled by the
fleet manager's own forecast and policy (fairway/fleet/forecast.py, policy.py: imported, not
re-written), against a static fleet sized for the peak and a reactive scaler with no forecast.

What is simulated, second by second (86,400 steps a run; a fluid model: streams are counts, not
objects, which is what makes half a million of them fit in seconds):

* arrivals: a seeded synthetic day (two daily peaks, a sudden spike, a minute-scale wobble),
  split into tiers (paid and business run in the paid lane, free, background) and Poisson-drawn;
* the router: places each reply on the least loaded replica with prefix affinity; in a fluid
  model that is an even spread, and the affinity is the share of prompt tokens found cached
  (bench/results/routing.json's measured hit rate), which only the uncached rest prefills;
* replicas: each admits replies into its batch while KV seats last (paid before free before
  background, FIFO within a lane), spends part of every second prefilling what it admitted and
  the rest in decode steps whose time grows with the batch (the profile), and ends a running
  reply at the rate its tokens come out; start-up delay before a new one serves; spot replicas
  reclaimed at random (Poisson), which drain at once and are replaced by the policy first;
* lanes at capacity: a free reply predicted to wait (the queue ahead of it over the drain rate,
  replies finished per second) longer than the limit is shed, or sent to the mini pool (a second
  pool of a smaller model, scaled by its own policy), as the lanes code does
  (fairway/router/pressure.py's pool_pressure, imported);
* the fleet manager: every 10 s, arrivals per second into HoltForecaster, a FleetView into
  ScalingPolicy.decide (replace, add, drain); the reactive peer gives the same policy the last
  observed rate instead of the forecast; the static peer never changes its count (it only
  replaces reclaimed replicas).

Figures per run: replicas at the peak, concurrent streams at the peak, TTFT p99 per tier, the
share of free replies shed or sent to the mini pool, replica-hours (each replica counts from
its start to the end of its drain). Two profiles: this CPU's replica (the bundled 135M model,
from bench/results/engine_vs_hf.json) and an H100-class one (Llama-3.1-8B; sources in PROFILES).

    .venv/bin/python bench/fleet_sim.py             # every run; results to bench/results/fleet_sim.json
    .venv/bin/python bench/fleet_sim.py --hours 2   # a quick look at the first two hours
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from fairway.domain import Lane  # noqa: E402
from fairway.fleet import FleetView, HoltForecaster, ScalingBounds, ScalingPolicy, ScalingTarget  # noqa: E402
from fairway.replica.registry import ReplicaInfo  # noqa: E402
from fairway.router.pressure import PressureSettings, pool_pressure  # noqa: E402

RESULTS = ROOT / "bench" / "results"
LANES = (Lane.PAID, Lane.FREE, Lane.BACKGROUND)
TIER_SHARE = {Lane.PAID: 0.25, Lane.FREE: 0.65, Lane.BACKGROUND: 0.10}  # of arrivals
TARGET_STREAMS = 500_000  # the seed's concurrent streams at the peak
DAY_S = 86_400
TICK_S = 10  # the fleet manager looks every 10 s
MAX_WAIT_S = 10.0  # a free reply predicted to wait longer is at capacity (the lanes' default)


@dataclass(frozen=True)
class Profile:
    """One replica's speed: a decode step takes step_fixed_s + step_per_seq_s * batch; prompts
    prefill at prefill_tps; it holds max_batch streams (KV seats); it serves start_s after it
    was started."""

    name: str
    model: str
    step_fixed_s: float
    step_per_seq_s: float
    prefill_tps: float
    max_batch: int
    start_s: float
    plan_batch: int  # the batch the fleet is sized for (below max_batch: TTFT headroom)
    source: str

    def step_s(self, batch: float) -> float:
        return self.step_fixed_s + self.step_per_seq_s * batch


def cpu_profile() -> Profile:
    """This machine's replica, from the engine benchmark's run (bench/results/engine_vs_hf.json):
    decode-only steps at their mean batch, and prompt tokens over the steps that carried them."""
    run = json.loads((RESULTS / "engine_vs_hf.json").read_text())
    split = run["fairway"]["step_time_split"]
    batch = split["decode_only_mean_batch"]
    step = split["decode_only_step_seconds"] / split["decode_only_steps"]
    fixed = step / 3  # assumed: a third of the step does not grow with the batch (one point measured)
    prompt_tokens = run["workload"]["prompt_tokens"]
    return Profile("cpu", f"{run['model']['name']} ({run['model']['dtype']}, {run['machine']['cpu_count']} cores)",
                   fixed, (step - fixed) / batch, prompt_tokens / split["prefill_step_seconds"],
                   max_batch=48, start_s=10.0, plan_batch=32,
                   source=f"bench/results/engine_vs_hf.json ({run['timestamp']}): decode-only step {step * 1000:.0f} ms "
                          f"at mean batch {batch:.1f}; {prompt_tokens} prompt tokens over "
                          f"{split['prefill_step_seconds']:.1f} s of prefill steps; max batch 48 = its 4,096 KV "
                          "blocks of 16 over ~1,300 tokens a stream; start 10 s (6 s measured idle, more loaded); "
                          "the fixed third of the step is assumed")


# NVIDIA's NIM benchmark of Llama-3.1-8B-Instruct (NIM 1.8.0) on H100: inter-token latency 4.63 ms at
# concurrency 1 and 12.65 ms at 200 (13,348 tokens/s), a straight line between them.
H100 = Profile(
    "h100", "Llama-3.1-8B-Instruct, one H100 80GB", step_fixed_s=0.00463, step_per_seq_s=(0.01265 - 0.00463) / 199,
    prefill_tps=30_000.0, max_batch=256, start_s=90.0, plan_batch=224,
    source="decode: NVIDIA NIM for LLMs benchmarking, Performance (docs.nvidia.com/nim/benchmarking/llm/1.0.0/"
           "performance), Llama-3.1-8b-instruct, NIM 1.8.0: ITL 4.63 ms at concurrency 1, 12.65 ms at 200 (13,348 "
           "tokens/s); the stored copy did not show that table's sequence lengths. prefill: 16 GFLOP a token (2 x 8B "
           "parameters) at ~50% of the H100 SXM's 989 TFLOPS dense BF16 (NVIDIA's H100 datasheet) = ~30k tokens/s. "
           "max batch 256 (vLLM's default max_num_seqs; 64 GB of KV at 128 KiB a token holds ~500k tokens). start "
           "90 s: 16 GB of weights and CUDA graphs, an assumption")
# The mini pool's model: Llama-3.2-1B on the same GPU, scaled from the 8B by the memory a step reads
# (weights 2.5 GB vs 16 GB; KV 32 KiB vs 128 KiB a token): an estimate, not a measurement.
H100_MINI = Profile(
    "h100-mini", "Llama-3.2-1B-Instruct, one H100 80GB", step_fixed_s=0.0025, step_per_seq_s=(0.01265 - 0.00463) / 199 / 4,
    prefill_tps=200_000.0, max_batch=512, start_s=45.0, plan_batch=384,
    source="scaled from the H100 8B profile by the bytes a decode step reads (weights 2.5 vs 16 GB, KV 32 vs 128 "
           "KiB a token), a 2.5 ms floor per step: an estimate")


@dataclass(frozen=True)
class Workload:
    prompt_tokens: float = 1_200.0  # a turn's whole prompt (system, history, new message)
    output_tokens: float = 300.0
    cache_hit: float = 0.9  # of prompt tokens found cached (replaced by routing.json's when present)
    spot_share: float = 0.6  # of replicas on spot capacity
    spot_mtbf_h: float = 8.0  # a spot replica is reclaimed once in this many hours, on average

    @property
    def prefill_tokens(self) -> float:
        return self.prompt_tokens * (1 - self.cache_hit)


def day_trace(seed: int, seconds: int) -> np.ndarray:
    """Relative arrival rate per second over a day, peak 1: a night trough, a midday and a
    bigger evening peak, a flash crowd (x1.8 for 20 minutes, reached in 3) at a seeded time of
    the evening, and a few per cent of minute-scale wobble."""
    rng = np.random.default_rng(seed)
    t = np.arange(DAY_S) / 3600.0
    shape = (0.18 + 0.55 * np.exp(-((t - 13.0) / 2.5) ** 2) + 0.80 * np.exp(-((t - 20.5) / 2.0) ** 2))
    start = rng.uniform(19.0, 21.5) * 3600
    rise = np.clip((np.arange(DAY_S) - start) / 180.0, 0, 1) * (np.arange(DAY_S) < start + 1200)
    shape = shape * (1 + 0.8 * rise)
    wobble = np.repeat(np.exp(rng.normal(0, 0.04, DAY_S // 60 + 1)), 60)[:DAY_S]
    shape = shape * wobble
    return (shape / shape.max())[:seconds]


@dataclass
class Pool:
    """One model's replicas, in aggregate: counts per state and per lane."""

    profile: Profile
    policy: ScalingPolicy | None  # None: a static fleet
    forecast: bool
    starting: list[float] = field(default_factory=list)  # when each starting replica will serve
    ready: int = 0
    draining: list[float] = field(default_factory=list)  # when each draining replica is gone
    running: dict[Lane, float] = field(default_factory=lambda: dict.fromkeys(LANES, 0.0))
    queued: dict[Lane, float] = field(default_factory=lambda: dict.fromkeys(LANES, 0.0))
    holt: HoltForecaster = field(default_factory=HoltForecaster)
    tick_arrivals: float = 0.0
    tick_ttfts: list[tuple[float, float]] = field(default_factory=list)  # (ttft, count) of this tick's admissions
    finished_last_s: float = 0.0
    service_now: float = 0.0  # this second's prefill and first step, for a reply admitted now
    replica_seconds: float = 0.0
    peak_ready: int = 0
    peak_streams: float = 0.0
    reclaims: int = 0
    actions: dict[str, int] = field(default_factory=dict)

    @property
    def desired(self) -> int:
        return self.ready + len(self.starting)

    def add(self, now: float, n: int) -> None:
        self.starting += [now + self.profile.start_s] * n

    def remove_ready(self, now: float, grace_s: float = 40.0) -> None:
        """A drain: it leaves routing now (its replies are handed on), gone after the grace."""
        if self.ready > 0:
            self.ready -= 1
            self.draining.append(now + grace_s)


def at_capacity(pool: Pool, max_wait_s: float) -> bool:
    """Whether a free reply would wait past the limit: the queue ahead of it (paid and free)
    over the pool's drain rate, decided by the routers' own rule (pressure.pool_pressure), on one
    replica standing for the average."""
    n = max(pool.ready, 1)
    ahead = pool.queued[Lane.PAID] + pool.queued[Lane.FREE]
    info = ReplicaInfo("average", "m", "q", 0, 0, waiting={"paid": ahead / n, "free": 0},
                       drain_rate=pool.finished_last_s / n or None)
    return pool_pressure([info], Lane.FREE, lambda r: 0, PressureSettings(max_wait_s=max_wait_s)).at_capacity


def serve_second(pool: Pool, now: int, arrivals: dict[Lane, float], work: Workload,
                 cohorts: dict[Lane, list[tuple[int, float]]]) -> None:
    """One second of the pool: start-ups and drains end, arrivals queue, seats fill in lane
    order, prefill then decode share the second, running replies end at their token rate."""
    prof = pool.profile
    up = [t for t in pool.starting if t <= now]
    if up:
        pool.starting = [t for t in pool.starting if t > now]
        pool.ready += len(up)
    pool.draining = [t for t in pool.draining if t > now]
    pool.replica_seconds += pool.ready + len(pool.starting) + len(pool.draining)
    for lane in LANES:
        pool.queued[lane] += arrivals.get(lane, 0.0)
    n = pool.ready
    seats = n * prof.max_batch - sum(pool.running.values())
    admitted_total = 0.0
    for lane in LANES:
        take = max(0.0, min(pool.queued[lane], seats))
        pool.queued[lane] -= take
        pool.running[lane] += take
        seats -= take
        admitted_total += take
        cohorts[lane].append((now, take))
    if n == 0:
        pool.finished_last_s = 0.0
        return
    batch = sum(pool.running.values()) / n
    prefill_share = min(0.9, admitted_total / n * work.prefill_tokens / prof.prefill_tps)
    tokens_per_stream = (1 - prefill_share) / prof.step_s(batch)  # decode steps this second
    end_share = min(1.0, tokens_per_stream / work.output_tokens)
    finished = 0.0
    for lane in LANES:
        done = pool.running[lane] * end_share
        pool.running[lane] -= done
        finished += done
    pool.finished_last_s = finished
    ttft_service = work.prefill_tokens / prof.prefill_tps + prof.step_s(batch) / max(1e-6, 1 - prefill_share)
    pool.tick_ttfts.append((ttft_service, admitted_total))
    pool.peak_ready = max(pool.peak_ready, n)
    pool.peak_streams = max(pool.peak_streams, sum(pool.running.values()))
    pool.service_now = ttft_service


def manage(pool: Pool, now: int, observed_rps: float) -> None:
    """The fleet manager's tick: the real forecaster and policy on this pool's numbers."""
    if pool.policy is None:
        if pool.desired < pool.actions.setdefault("static", pool.desired):  # replace what was reclaimed
            pool.add(now, pool.actions["static"] - pool.desired)
        return
    pool.holt.observe(observed_rps, TICK_S)
    lead = pool.policy.target_of.lead_s
    demand = max(pool.holt.forecast(0), pool.holt.forecast(lead)) if pool.forecast else observed_rps
    weights = sum(c for _, c in pool.tick_ttfts)
    ttft_p99 = _weighted_quantile(pool.tick_ttfts, 0.99) if weights else None
    pool.tick_ttfts = []
    view = FleetView(at=float(now), desired=pool.desired, serving=pool.ready, forecast_rps=demand,
                     ttft_p99_s=ttft_p99, waiting=int(sum(pool.queued.values())))
    decision = pool.policy.decide(view)
    if decision.add:
        pool.add(now, decision.add)
    for _ in range(decision.drain):
        pool.remove_ready(now)
    if decision.add or decision.drain:
        pool.actions[decision.reason] = pool.actions.get(decision.reason, 0) + 1


def reclaim(pool: Pool, now: int, rng: np.random.Generator, work: Workload) -> None:
    """Spot reclaims this second: each drains at once (a 30 s notice), counted out of the
    pool; the policy replaces it at its next tick."""
    rate = pool.ready * work.spot_share / (work.spot_mtbf_h * 3600)
    for _ in range(min(pool.ready, int(rng.poisson(rate)))):
        pool.remove_ready(now, grace_s=30.0)
        pool.reclaims += 1


def _weighted_quantile(pairs: list[tuple[float, float]], q: float) -> float:
    values = np.array([v for v, _ in pairs])
    weights = np.array([w for _, w in pairs])
    order = np.argsort(values)
    cum = np.cumsum(weights[order])
    return float(values[order][min(len(values) - 1, np.searchsorted(cum, q * cum[-1]))])


def replica_rps(prof: Profile, work: Workload) -> float:
    """Replies a second one replica serves at its planned batch (Little's law: batch over a
    reply's duration at that batch)."""
    return prof.plan_batch / (work.output_tokens * prof.step_s(prof.plan_batch))


def policy_for(prof: Profile, work: Workload, peak_rps: float, mode: str) -> ScalingPolicy | None:
    if mode == "static":
        return None
    per = replica_rps(prof, work)
    peak_need = math.ceil(peak_rps / (per * 0.8))
    bounds = ScalingBounds(min_replicas=max(2, peak_need // 50), max_replicas=peak_need * 2,
                           step=max(1, peak_need // 20), cooldown_s=30.0, idle_s=300.0)
    return ScalingPolicy(bounds, ScalingTarget(replica_rps=per, ttft_target_s=2.0, headroom=0.8,
                                               lead_s=prof.start_s + TICK_S, queue_per_replica=8.0))


def simulate(prof: Profile, mini: Profile | None, mode: str, treatment: str, work: Workload, seed: int,
             seconds: int, peak_rps: float) -> dict:
    """One day (or its first `seconds`) on one profile, one scaler, one treatment of free
    replies at capacity; peak_rps: arrivals per second at the day's peak."""
    rng = np.random.default_rng(seed)
    rel = day_trace(seed, seconds)
    pools = {"main": Pool(prof, policy_for(prof, work, peak_rps, mode), forecast=mode == "forecast")}
    if treatment == "mini" and mini is not None:
        # The mini pool is sized for what it may get: the free share of the spike above the main pool's plan.
        mini_peak = peak_rps * TIER_SHARE[Lane.FREE] * 0.5
        pools["mini"] = Pool(mini, policy_for(mini, work, mini_peak, mode if mode != "static" else "forecast"),
                             forecast=True)
    per = replica_rps(prof, work)
    start_n = math.ceil(peak_rps / (per * 0.8)) if mode == "static" else math.ceil(rel[0] * peak_rps / (per * 0.8))
    pools["main"].ready = start_n
    if "mini" in pools:
        pools["mini"].ready = pools["mini"].policy.bounds.min_replicas
    cohorts = {name: {lane: [] for lane in LANES} for name in pools}
    arrived = {name: {lane: np.zeros(seconds) for lane in LANES} for name in pools}
    service = {name: np.zeros(seconds) for name in pools}
    free_total = free_shed = free_mini = 0.0
    for now in range(seconds):
        rate = rel[now] * peak_rps
        drawn = {lane: float(rng.poisson(rate * TIER_SHARE[lane])) for lane in LANES}
        free_total += drawn[Lane.FREE]
        to_mini = {}
        if at_capacity(pools["main"], MAX_WAIT_S):
            if treatment == "mini" and "mini" in pools:
                to_mini = {Lane.FREE: drawn[Lane.FREE]}
                free_mini += drawn[Lane.FREE]
            else:
                free_shed += drawn[Lane.FREE]
            drawn[Lane.FREE] = 0.0
        for name, pool in pools.items():
            got = drawn if name == "main" else to_mini
            for lane in LANES:
                arrived[name][lane][now] = got.get(lane, 0.0)
            pool.tick_arrivals += sum(got.values())
            serve_second(pool, now, got, work, cohorts[name])
            service[name][now] = pool.service_now
            reclaim(pool, now, rng, work)
            if now % TICK_S == TICK_S - 1:
                manage(pool, now, pool.tick_arrivals / TICK_S)
                pool.tick_arrivals = 0.0
    return {
        "profile": prof.name, "scaler": mode, "free_at_capacity": treatment,
        "peak_arrivals_per_s": round(peak_rps),
        "replicas_at_peak": {name: p.peak_ready for name, p in pools.items()},
        "concurrent_streams_at_peak": round(pools["main"].peak_streams),
        "ttft_p99_s": {str(lane): _ttft_p99(cohorts["main"][lane], arrived["main"][lane], service["main"])
                       for lane in LANES},
        "mini_ttft_p99_s": (_ttft_p99(cohorts["mini"][Lane.FREE], arrived["mini"][Lane.FREE], service["mini"])
                            if "mini" in pools else None),
        "free_shed_share": free_shed / free_total if free_total else 0.0,
        "free_to_mini_share": free_mini / free_total if free_total else 0.0,
        "replica_hours": {name: round(p.replica_seconds / 3600, 1) for name, p in pools.items()},
        "spot_reclaims": {name: p.reclaims for name, p in pools.items()},
        "scaling_actions": {name: p.actions for name, p in pools.items()},
    }


def calibrate(prof: Profile, work: Workload, seed: int, seconds: int) -> float:
    """The peak arrival rate at which the forecast-scaled fleet runs TARGET_STREAMS at once at
    the day's peak: a first guess from the planned batch's reply time, then one correction (a
    stream's duration depends on the batch the fleet ends up running)."""
    guess = TARGET_STREAMS / (work.output_tokens * prof.step_s(prof.plan_batch))
    first = simulate(prof, None, "forecast", "shed", work, seed, seconds, guess)
    return guess * TARGET_STREAMS / max(1.0, first["concurrent_streams_at_peak"])


def _ttft_p99(admitted: list[tuple[int, float]], arrived: np.ndarray, service: np.ndarray) -> float | None:
    """TTFT p99 of one lane: each second's arrivals wait, FIFO, until the lane's cumulative
    admissions reach them (interpolated within the second), then the prefill and first step."""
    admitted_per_s = np.zeros(len(arrived))
    for now, n in admitted:
        admitted_per_s[now] += n
    cum_in, cum_out = np.cumsum(arrived), np.cumsum(admitted_per_s)
    mask = arrived > 0
    if not mask.any():
        return None
    t_in = np.nonzero(mask)[0]
    # the second in which the last of each cohort is admitted
    done = np.searchsorted(cum_out, cum_in[mask] - 1e-6)
    served = done < len(arrived)
    wait = np.where(served, done - t_in, len(arrived) - t_in).astype(float)
    ttft = wait + service[np.minimum(done, len(arrived) - 1)]
    order = np.argsort(ttft)
    cum = np.cumsum(arrived[mask][order])
    return round(float(ttft[order][min(len(order) - 1, np.searchsorted(cum, 0.99 * cum[-1]))]), 3)


def measured_cache_hit(default: float) -> tuple[float, str]:
    path = RESULTS / "routing.json"
    try:
        hit = json.loads(path.read_text())["results"]["affinity"]["prefix_cache_hit_rate"]
        return float(hit), f"bench/results/routing.json (affinity routing's prefix-cache hit rate, {hit:.3f})"
    except (OSError, KeyError, ValueError):
        return default, "assumed"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hours", type=float, default=24.0, help="simulate the first hours of the day")
    parser.add_argument("--seed", type=int, default=16)
    parser.add_argument("--out", default=str(RESULTS / "fleet_sim.json"))
    args = parser.parse_args()
    seconds = int(args.hours * 3600)
    hit, hit_source = measured_cache_hit(Workload.cache_hit)
    work = Workload(cache_hit=hit)
    runs = [(H100, H100_MINI, mode, "mini") for mode in ("forecast", "reactive", "static")]
    runs += [(H100, None, "forecast", "shed"), (cpu_profile(), None, "forecast", "shed")]
    began = time.monotonic()
    peaks = {prof.name: calibrate(prof, work, args.seed, seconds) for prof in {r[0] for r in runs}}
    results = []
    for prof, mini, mode, treatment in runs:
        t0 = time.monotonic()
        results.append(simulate(prof, mini, mode, treatment, work, args.seed, seconds, peaks[prof.name]))
        results[-1]["sim_seconds"] = round(time.monotonic() - t0, 1)
    print_table(results)
    out = {"when": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"), "seed": args.seed,
           "hours": args.hours, "target_streams": TARGET_STREAMS, "tick_s": TICK_S, "max_wait_s": MAX_WAIT_S,
           "pressure_rule": "fairway.router.pressure.pool_pressure",
           "workload": asdict(work), "cache_hit_source": hit_source, "tier_share": {str(k): v for k, v in TIER_SHARE.items()},
           "profiles": {p.name: asdict(p) for p in (H100, H100_MINI, cpu_profile())},
           "runs": results, "wall_s": round(time.monotonic() - began, 1)}
    Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
    print(f"\n{len(results)} runs in {out['wall_s']} s; results in {args.out}")
    return 0


def print_table(results: list[dict]) -> None:
    print(f"{'profile':8} {'scaler':9} {'at cap.':7} {'replicas@peak':>14} {'streams@peak':>13} "
          f"{'TTFT p99 paid/free/bg (s)':>27} {'free shed':>9} {'free->mini':>10} {'replica-h':>10}")
    for r in results:
        ttft = "/".join("-" if v is None else f"{v:.2f}" for v in r["ttft_p99_s"].values())
        reps = "+".join(str(v) for v in r["replicas_at_peak"].values())
        hours = "+".join(f"{v:,.0f}" for v in r["replica_hours"].values())
        print(f"{r['profile']:8} {r['scaler']:9} {r['free_at_capacity']:7} {reps:>14} {r['concurrent_streams_at_peak']:>13,} "
              f"{ttft:>27} {r['free_shed_share']:>9.3%} {r['free_to_mini_share']:>10.3%} {hours:>10}")


if __name__ == "__main__":
    sys.exit(main())
