"""Named scenarios: each a documented cluster, workload and objective, built into (config, params).

A scenario fixes what matters to the claim under test: the batching regime, how bursty the
arrivals are, the load as a fraction of capacity (see `burstgym.capacity`), and the objective.
`make("bursty", n_nodes=8, load=0.8)` overrides any `Settings` field; unknown names and invalid
values are refused with the field named.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass, field

import jax.numpy as jnp
import numpy as np

from burstgym import capacity
from burstgym.latency import LatencyModel, Profile, load_profile
from burstgym.traces import load_trace
from burstgym.types import OBJECTIVES, SCHEDULERS, EnvConfig, EnvParams, NodeParams
from burstgym.workload import (
    ArrivalProcess,
    GammaArrivals,
    LogNormalLengths,
    MMPPArrivals,
    PoissonArrivals,
    TraceReplay,
    Workload,
)

DEFAULT_PROFILE = "h100-llama-3-8b-tp1"


@dataclass(frozen=True)
class Settings:
    """Every knob of a scenario; `make` accepts any of these as a keyword override."""

    n_nodes: int = 4  # nodes (replicas) in the cluster
    load: float = 0.6  # arrival rate as a fraction of the cluster's nominal capacity
    profile: str | tuple[str, ...] = DEFAULT_PROFILE  # latency profile, or one per node
    speed: float | tuple[float, ...] = 1.0  # iteration-time multiplier, or one per node
    episode_length: int = 512  # arrivals per episode
    scheduler: str = "continuous"  # "continuous" or "dynamic"
    max_num_seqs: int = 64  # continuous: running-set limit (vLLM max_num_seqs)
    max_num_batched_tokens: int = 2048  # continuous: token budget per iteration (chunked prefill)
    block_size: int = 16  # continuous: tokens per KV block (vLLM default)
    kv_capacity_tokens: int | None = None  # None: the profile's KV capacity
    max_batch_size: int = 16  # dynamic: batch launches when this many wait
    max_queue_delay: float = 0.05  # dynamic: or when the oldest has waited this long (s)
    queue_capacity: int = 64  # waiting requests per node beyond which arrivals are dropped
    sleep_timeout: float = math.inf  # seconds idle and empty before a node sleeps
    wake_delay: float = 0.0  # seconds from an arrival at a sleeping node until it can run
    sleep_power_fraction: float = 0.3  # sleeping power as a fraction of idle power (assumed)
    objective: str = "latency"  # "latency" or "slo"
    drop_penalty: float = 30.0  # objective cost of one drop, in seconds of latency
    energy_weight: float = 0.0  # objective cost per joule, in seconds
    ttft_slo: float = 1.0  # seconds
    tpot_slo: float = 0.1  # seconds per output token
    reward_scale: float = 10.0  # rewards are divided by this
    rate_window: float = 2.0  # seconds, time constant of the observed arrival-rate estimate
    burst_ratio: float = 8.0  # MMPP scenarios: arrival rate during a burst over the rate between bursts
    burst_on: float = 2.0  # MMPP scenarios: mean burst length (s)
    burst_off: float = 6.0  # MMPP scenarios: mean time between bursts (s)
    arrival_cv: float = 2.0  # Gamma-renewal scenarios: coefficient of variation of the gaps
    prompt_median: float = 256.0  # log-normal prompt lengths (tokens)
    prompt_sigma: float = 1.0
    prompt_max: int = 4096
    output_median: float = 128.0  # log-normal output lengths (tokens)
    output_sigma: float = 1.0
    output_max: int = 1024
    trace: str | None = None  # path of a trace file to replay (trace scenario)

    def validate(self) -> None:
        """Refuse impossible settings, naming the field."""
        positive_int = (
            "n_nodes",
            "episode_length",
            "max_num_seqs",
            "max_num_batched_tokens",
            "block_size",
            "max_batch_size",
            "queue_capacity",
            "prompt_max",
            "output_max",
        )
        for name in positive_int:
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
                raise ValueError(f"scenario setting {name!r} must be a positive integer, got {v!r}")
        positive = (
            "load",
            "burst_on",
            "burst_off",
            "arrival_cv",
            "reward_scale",
            "rate_window",
            "ttft_slo",
            "tpot_slo",
            "prompt_median",
            "output_median",
            "prompt_sigma",
            "output_sigma",
        )
        for name in positive:
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
                raise ValueError(f"scenario setting {name!r} must be a positive number, got {v!r}")
        non_negative = (
            "max_queue_delay",
            "wake_delay",
            "drop_penalty",
            "energy_weight",
            "sleep_power_fraction",
        )
        for name in non_negative:
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
                raise ValueError(f"scenario setting {name!r} must be a finite number >= 0, got {v!r}")
        if not isinstance(self.sleep_timeout, (int, float)) or not self.sleep_timeout >= 0:
            raise ValueError(
                f"scenario setting 'sleep_timeout' must be >= 0 (inf: never), got {self.sleep_timeout!r}"
            )
        if not isinstance(self.burst_ratio, (int, float)) or not self.burst_ratio >= 1:
            raise ValueError(
                f"scenario setting 'burst_ratio' must be >= 1 (inf: silent gaps), got {self.burst_ratio!r}"
            )
        if self.scheduler not in SCHEDULERS:
            raise ValueError(
                f"scenario setting 'scheduler' must be one of {SCHEDULERS}, got {self.scheduler!r}"
            )
        if self.objective not in OBJECTIVES:
            raise ValueError(
                f"scenario setting 'objective' must be one of {OBJECTIVES}, got {self.objective!r}"
            )
        for name in ("profile", "speed"):
            v = getattr(self, name)
            if isinstance(v, tuple) and len(v) != self.n_nodes:
                raise ValueError(f"scenario setting {name!r} has {len(v)} entries for {self.n_nodes} nodes")
        speeds = self.speed if isinstance(self.speed, tuple) else (self.speed,)
        if any(not isinstance(s, (int, float)) or not s > 0 for s in speeds):
            raise ValueError(f"scenario setting 'speed' must be positive, got {self.speed!r}")
        if (
            self.kv_capacity_tokens is not None
            and self.kv_capacity_tokens < self.prompt_max + self.output_max
        ):
            raise ValueError(
                "scenario setting 'kv_capacity_tokens' must hold the longest request (prompt_max + "
                f"output_max = {self.prompt_max + self.output_max}), got {self.kv_capacity_tokens}"
            )


@dataclass(frozen=True)
class Scenario:
    """A named scenario: its reason for existing, its settings and how its arrivals look."""

    name: str
    reason: str
    arrivals: Callable[[Settings], ArrivalProcess]  # the arrival process at a nominal rate of 1 req/s
    settings: dict = field(default_factory=dict)


def _bursts(s: Settings) -> MMPPArrivals:
    """On/off bursts: `burst_ratio` times the base rate for ~`burst_on` s, every ~`burst_on + burst_off` s."""
    return MMPPArrivals(rate=1.0, burst_ratio=s.burst_ratio, mean_on=s.burst_on, mean_off=s.burst_off)


SCENARIOS: dict[str, Scenario] = {
    s.name: s
    for s in (
        Scenario(
            "steady",
            "Poisson arrivals on continuous batching at moderate load: the baseline where balancing "
            "should be hard to beat.",
            lambda s: PoissonArrivals(rate=1.0),
        ),
        Scenario(
            "bursty",
            "Heavy on/off bursts (MMPP: 8x the base rate during bursts of ~2 s) on continuous batching: "
            "the regime the claim is about, where a burst reaching one node builds a big batch.",
            _bursts,
        ),
        Scenario(
            "bursty-dynamic",
            "The same bursts on a batching window (Triton dynamic batcher): concentrating requests fills "
            "batches before the window expires, so skew may pay here if anywhere.",
            _bursts,
            {"scheduler": "dynamic", "load": 0.5},
        ),
        Scenario(
            "energy",
            "Low load with sleep states and energy in the objective: consolidating traffic lets idle "
            "nodes sleep, at the price of wake-up delays and bigger batches.",
            lambda s: GammaArrivals(rate=1.0, cv=s.arrival_cv),
            {"load": 0.2, "sleep_timeout": 5.0, "wake_delay": 2.0, "energy_weight": 1e-3},
        ),
        Scenario(
            "overload",
            "Bursts beyond capacity on a memory-tight node (Llama-2-7B's 512 KiB/token KV cache on A100, "
            "long prompts): skew turns into preemptions and drops.",
            _bursts,
            {
                "load": 1.2,
                "profile": "a100-llama-2-7b-tp1",
                "max_num_seqs": 128,
                "queue_capacity": 32,
                "prompt_median": 1024.0,
                "prompt_max": 8192,
            },
        ),
        Scenario(
            "trace",
            "Replay of a real trace (`trace=PATH`: Azure LLM 2023, BurstGPT or Mooncake), time-scaled to "
            "the load, with the trace's own prompt and output lengths.",
            lambda s: None,
            {"load": 0.7},
        ),
    )
}


def _per_node(value, n: int) -> tuple:
    return value if isinstance(value, tuple) else (value,) * n


def _workload(scenario: Scenario, s: Settings) -> Workload:
    if scenario.name == "trace" or s.trace is not None:
        if s.trace is None:
            raise ValueError("scenario 'trace' needs a trace file: make('trace', trace='path/to/file.csv')")
        return Workload(arrivals=TraceReplay(load_trace(s.trace)))
    return Workload(
        arrivals=scenario.arrivals(s),
        prompt=LogNormalLengths(median=s.prompt_median, sigma=s.prompt_sigma, max_tokens=s.prompt_max),
        output=LogNormalLengths(median=s.output_median, sigma=s.output_sigma, max_tokens=s.output_max),
    )


def _node_capacity(
    profile: Profile, speed: float, kv_tokens: int, s: Settings, wl: Workload, outputs
) -> float:
    if s.scheduler == "continuous":
        return capacity.continuous_capacity_rps(
            profile.latency, speed, s.max_num_seqs, kv_tokens, wl.mean_prompt, wl.mean_output
        )
    return capacity.dynamic_capacity_rps(profile.latency, speed, s.max_batch_size, wl.mean_prompt, outputs)


def settings_for(name: str, **overrides) -> tuple[Scenario, Settings]:
    """The scenario and its settings with `overrides` applied and validated."""
    if name not in SCENARIOS:
        raise ValueError(f"unknown scenario {name!r}; valid scenarios: {', '.join(SCENARIOS)}")
    scenario = SCENARIOS[name]
    known = {f.name for f in dataclasses.fields(Settings)}
    unknown = sorted(set(overrides) - known)
    if unknown:
        raise ValueError(
            f"unknown scenario setting {unknown[0]!r}; valid settings: {', '.join(sorted(known))}"
        )
    overrides = {k: (tuple(v) if isinstance(v, list) else v) for k, v in overrides.items() if v is not None}
    s = Settings(**{**scenario.settings, **overrides})
    s.validate()
    return scenario, s


def make(name: str, **overrides) -> tuple[EnvConfig, EnvParams]:
    """Build the static config and the parameters of scenario `name` (see `Settings` for overrides)."""
    scenario, s = settings_for(name, **overrides)
    n = s.n_nodes
    profiles = [load_profile(p) for p in _per_node(s.profile, n)]
    speeds = [float(v) for v in _per_node(s.speed, n)]
    workload = _workload(scenario, s)
    longest = s.prompt_max + s.output_max
    if workload.prompt is None:
        longest = int(np.max(workload.arrivals.trace.prompt) + np.max(workload.arrivals.trace.output))
    kv_tokens = [s.kv_capacity_tokens or p.kv_capacity_tokens for p in profiles]
    for i, kv in enumerate(kv_tokens):
        if kv < longest:
            raise ValueError(
                f"node {i}: KV capacity {kv} tokens cannot hold the longest request ({longest} tokens); "
                "lower prompt_max/output_max or pick a larger GPU profile"
            )
    outputs = capacity.sample_outputs(workload) if s.scheduler == "dynamic" else None
    caps = [
        _node_capacity(p, v, kv, s, workload, outputs)
        for p, v, kv in zip(profiles, speeds, kv_tokens, strict=True)
    ]
    cluster_capacity = float(sum(caps))
    workload = workload.with_rate(s.load * cluster_capacity)

    def arr(values, dtype=None):
        return jnp.asarray(np.asarray(values), dtype=dtype)

    fdt = jnp.result_type(float)
    nodes = NodeParams(
        latency=LatencyModel(
            *(arr([float(getattr(p.latency, f)) for p in profiles], fdt) for f in LatencyModel._fields)
        ),
        speed=arr(speeds, fdt),
        max_num_seqs=arr([s.max_num_seqs] * n, jnp.int32),
        max_num_batched_tokens=arr([s.max_num_batched_tokens] * n, jnp.int32),
        block_size=arr([s.block_size] * n, jnp.int32),
        kv_blocks=arr([kv // s.block_size for kv in kv_tokens], jnp.int32),
        max_batch_size=arr([s.max_batch_size] * n, jnp.int32),
        max_queue_delay=arr([s.max_queue_delay] * n, fdt),
        queue_capacity=arr([s.queue_capacity] * n, jnp.int32),
        busy_power_w=arr([p.busy_power_w for p in profiles], fdt),
        idle_power_w=arr([p.idle_power_w for p in profiles], fdt),
        sleep_power_w=arr([p.idle_power_w * s.sleep_power_fraction for p in profiles], fdt),
        sleep_timeout=arr([s.sleep_timeout] * n, fdt),
        wake_delay=arr([s.wake_delay] * n, fdt),
    )
    running_limit = s.max_num_seqs if s.scheduler == "continuous" else s.max_batch_size
    params = EnvParams(
        nodes=nodes,
        drop_penalty=arr(s.drop_penalty, fdt),
        energy_weight=arr(s.energy_weight, fdt),
        reward_scale=arr(s.reward_scale, fdt),
        ttft_slo=arr(s.ttft_slo, fdt),
        tpot_slo=arr(s.tpot_slo, fdt),
        capacity_rate=arr(cluster_capacity, fdt),
        prompt_scale=arr(workload.mean_prompt, fdt),
        age_scale=arr(s.max_queue_delay if s.scheduler == "dynamic" else 1.0, fdt),
        rate_window=arr(s.rate_window, fdt),
    )
    cfg = EnvConfig(
        n_nodes=n,
        episode_length=s.episode_length,
        scheduler=s.scheduler,
        workload=workload,
        objective=s.objective,
        slots=running_limit + s.queue_capacity,
    )
    return cfg, params
