"""Named scenarios: each a documented cluster, workload and objective, built into (config, params).

A scenario fixes what matters to the claim under test: the batching regime, how bursty the
arrivals are, how much the prompts share, the load as a fraction of capacity (see
`burstgym.capacity`), and the objective. `make("bursty", n_nodes=8, load=0.8)` overrides any
`Settings` field; unknown names and invalid values are refused with the field named.

Engine defaults follow vLLM v0.11.0 (vllm/engine/arg_utils.py `EngineArgs._set_default_args`,
OpenAI API server context): on GPUs with >= 70 GiB that are not A100s, `max_num_seqs` 1024 and
`max_num_batched_tokens` 8192; on others (A100 included) 256 and 2048. `block_size` 16 (CUDA
default, vllm/platforms/cuda.py), prefix caching and chunked prefill on (V1), KV capacity from
`gpu_memory_utilization` 0.9 (burstgym.latency.profiles).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import lru_cache

import jax.numpy as jnp
import numpy as np

from burstgym import capacity
from burstgym.latency import LatencyModel, PowerModel, Profile, load_profile
from burstgym.latency.power import flat_power_model
from burstgym.prefix_cache import entry_bound
from burstgym.types import ENDS, OBJECTIVES, REWARDS, SCHEDULERS, EnvConfig, EnvParams, NodeParams
from burstgym.workload import (
    ArrivalProcess,
    Conversations,
    GammaArrivals,
    LogNormalLengths,
    MMPPArrivals,
    PoissonArrivals,
    SharedPrefixes,
    TraceReplay,
    Workload,
    load_trace,
)

DEFAULT_PROFILE = "h100-llama-3-8b-tp1"
LARGE_GPU_BYTES = 70 * 2**30  # vLLM's threshold for the larger batch defaults
# Busy power: "roofline" follows the iteration's work (burstgym.latency.power, fitted); "flat" draws
# the board limit whenever an iteration runs, whatever it does: the simpler model, kept to measure
# how much of an energy result comes from the power model.
POWER_MODELS = ("roofline", "flat")

# Prefix sharing of the regime map: none, moderate (many groups, short prefixes, mild
# popularity skew) and heavy (few groups, long prefixes, strong skew).
PREFIX_LEVELS: dict[str, dict] = {
    "none": {"prefix_share": 0.0},
    "moderate": {"prefix_share": 1.0, "prefix_groups": 256, "prefix_zipf": 0.8, "prefix_median": 512.0},
    "heavy": {"prefix_share": 1.0, "prefix_groups": 16, "prefix_zipf": 1.2, "prefix_median": 2048.0},
}


@dataclass(frozen=True)
class Settings:
    """Every knob of a scenario; `make` accepts any of these as a keyword override."""

    n_nodes: int = 4  # nodes (replicas) in the cluster
    load: float = 0.6  # arrival rate as a fraction of the cluster's saturation capacity
    profile: str | tuple[str, ...] = DEFAULT_PROFILE  # latency profile, or one per node
    engine: str | None = (
        None  # serving-engine calibration (burstgym.latency.list_engines); None: the profile's
    )
    speed: float | tuple[float, ...] = 1.0  # iteration-time multiplier, or one per node
    episode_length: int = 512  # arrivals per episode
    scheduler: str = "continuous"  # "continuous" or "dynamic"
    max_num_seqs: int | None = None  # continuous: running-set limit; None: vLLM's default for the GPU
    max_num_batched_tokens: int | None = None  # continuous: token budget per iteration; None: vLLM's
    block_size: int = 16  # continuous: tokens per KV block (vLLM's CUDA default)
    kv_capacity_tokens: int | None = None  # None: the profile's KV capacity
    prefix_caching: bool = True  # continuous: automatic prefix caching (on in vLLM V1)
    max_batch_size: int = 16  # dynamic: batch launches when this many wait
    max_queue_delay: float = 0.05  # dynamic: or when the oldest has waited this long (s)
    padding: bool = True  # dynamic: pad prompts to the batch's longest, finished rows stay (static batching)
    queue_capacity: int = 64  # waiting requests per node beyond which arrivals are dropped
    slots: int | None = None  # requests a node's table holds; None: all it can hold
    slot_widths: tuple[int, ...] = (32, 128)  # narrower tables a step may run at (burstgym.env); () none
    sleep_timeout: float = math.inf  # seconds idle and empty before a node sleeps
    wake_delay: float = 0.0  # seconds from an arrival at a sleeping node until it can run
    sleep_power_fraction: float = 0.3  # sleeping power as a fraction of idle power (assumed)
    power: str = "roofline"  # busy power: the profile's energy roofline, or "flat" (its TDP whenever busy)
    objective: str = "latency"  # "latency", "excess" or "slo"
    reward: str = "accrual"  # "accrual" (as latency accrues) or "finish" (each request when it finishes)
    end: str = "drain"  # "drain" (serve everyone, terminate) or "cut" (stop at the next arrival, truncate)
    drop_penalty: float = 30.0  # objective cost of one drop, in seconds of latency
    energy_weight: float = 0.0  # objective cost per joule, in seconds
    ttft_weight: float = 0.0  # extra weight of TTFT in the latency objectives
    ttft_slo: float = 1.0  # seconds
    tpot_slo: float = 0.1  # seconds per output token
    reward_scale: float = 10.0  # rewards are divided by this
    rate_window: float = 2.0  # seconds, time constant of the observed arrival-rate estimate
    signal_interval: float = 0.0  # seconds between refreshes of the load signals (0: exact)
    burst_ratio: float = 8.0  # MMPP scenarios: arrival rate during a burst over the rate between bursts
    burst_on: float = 2.0  # MMPP scenarios: mean burst length (s)
    burst_off: float = 6.0  # MMPP scenarios: mean time between bursts (s)
    arrival_cv: float = 2.0  # Gamma-renewal scenarios: coefficient of variation of the gaps
    prompt_median: float = 256.0  # log-normal prompt lengths (tokens); the suffix with shared prefixes
    prompt_sigma: float = 1.0
    prompt_max: int = 4096
    output_median: float = 128.0  # log-normal output lengths (tokens)
    output_sigma: float = 1.0
    output_max: int = 1024
    prefix_share: float = 0.0  # fraction of requests that start with a shared group prefix
    prefix_groups: int = 64  # shared prefixes (system prompts, documents)
    prefix_zipf: float = 1.0  # popularity of group g proportional to (g + 1)^-prefix_zipf
    prefix_median: float = 2048.0  # log-normal shared-prefix lengths (tokens)
    prefix_sigma: float = 0.5
    prefix_max: int = 8192
    chunk_tokens: int = 256  # prefix-cache chunk of generated prompts (tokens; a multiple of block_size)
    conv_turns: float = 4.0  # conversation: mean turns per session
    conv_max_turns: int = 8
    think_time: float = 10.0  # conversation: mean seconds between a turn's arrival and the next
    system_tokens: int = 512  # conversation: system prompt shared by every session
    trace: str | None = None  # path of a trace file to replay (trace scenario)
    max_prefix_blocks: int = 512  # bound on a trace request's prefix blocks (a longer one is refused)

    def validate(self) -> None:
        """Refuse impossible settings, naming the field."""
        positive_int = (
            "n_nodes",
            "episode_length",
            "block_size",
            "max_batch_size",
            "queue_capacity",
            "prompt_max",
            "output_max",
            "prefix_groups",
            "prefix_max",
            "chunk_tokens",
            "conv_max_turns",
            "max_prefix_blocks",
        )
        for name in positive_int:
            _check_int(name, getattr(self, name))
        for name in ("max_num_seqs", "max_num_batched_tokens", "kv_capacity_tokens", "slots"):
            if getattr(self, name) is not None:
                _check_int(name, getattr(self, name))
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
            "prefix_median",
            "prefix_sigma",
            "prefix_zipf",
            "conv_turns",
            "think_time",
        )
        for name in positive:
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
                raise ValueError(f"scenario setting {name!r} must be a positive number, got {v!r}")
        non_negative = (
            "max_queue_delay",
            "wake_delay",
            "drop_penalty",
            "energy_weight",
            "ttft_weight",
            "sleep_power_fraction",
            "signal_interval",
        )
        for name in non_negative:
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
                raise ValueError(f"scenario setting {name!r} must be a finite number >= 0, got {v!r}")
        if not isinstance(self.sleep_timeout, (int, float)) or not self.sleep_timeout >= 0:
            raise ValueError(
                f"scenario setting 'sleep_timeout' must be >= 0 (inf: never), got {self.sleep_timeout!r}"
            )
        if not isinstance(self.burst_ratio, (int, float)) or not self.burst_ratio >= 1:
            raise ValueError(
                f"scenario setting 'burst_ratio' must be >= 1 (inf: silent gaps), got {self.burst_ratio!r}"
            )
        if not 0.0 <= self.prefix_share <= 1.0:
            raise ValueError(f"scenario setting 'prefix_share' must be in [0, 1], got {self.prefix_share!r}")
        if self.conv_turns < 1:
            raise ValueError(f"scenario setting 'conv_turns' must be >= 1, got {self.conv_turns!r}")
        if self.chunk_tokens % self.block_size:
            raise ValueError(
                f"scenario setting 'chunk_tokens' ({self.chunk_tokens}) must be a multiple of block_size "
                f"({self.block_size})"
            )
        if self.system_tokens < 0 or self.system_tokens % 512:
            raise ValueError(
                "scenario setting 'system_tokens' must be a whole number of 512-token chunks, "
                f"got {self.system_tokens!r}"
            )
        choices = {
            "scheduler": SCHEDULERS,
            "objective": OBJECTIVES,
            "reward": REWARDS,
            "end": ENDS,
            "power": POWER_MODELS,
        }
        for name, valid in choices.items():
            if getattr(self, name) not in valid:
                raise ValueError(
                    f"scenario setting {name!r} must be one of {valid}, got {getattr(self, name)!r}"
                )
        for name in ("prefix_caching", "padding"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(
                    f"scenario setting {name!r} must be True or False, got {getattr(self, name)!r}"
                )
        if not isinstance(self.slot_widths, tuple) or any(
            isinstance(w, bool) or not isinstance(w, (int, np.integer)) or w < 1 for w in self.slot_widths
        ):
            raise ValueError(
                "scenario setting 'slot_widths' must be a tuple of positive integers, "
                f"got {self.slot_widths!r}"
            )
        for name in ("profile", "speed"):
            v = getattr(self, name)
            if isinstance(v, tuple) and len(v) != self.n_nodes:
                raise ValueError(f"scenario setting {name!r} has {len(v)} entries for {self.n_nodes} nodes")
        speeds = self.speed if isinstance(self.speed, tuple) else (self.speed,)
        if any(isinstance(s, bool) or not isinstance(s, (int, float)) or not s > 0 for s in speeds):
            raise ValueError(f"scenario setting 'speed' must be positive, got {self.speed!r}")


def _check_int(name: str, v) -> None:
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
        raise ValueError(f"scenario setting {name!r} must be a positive integer, got {v!r}")


@dataclass(frozen=True)
class Scenario:
    """A named scenario: its reason for existing, its settings and how its arrivals look."""

    name: str
    reason: str
    arrivals: Callable[[Settings], ArrivalProcess | None]  # the arrival process at a nominal rate of 1 req/s
    settings: dict = field(default_factory=dict)


def _bursts(s: Settings) -> MMPPArrivals:
    """On/off bursts: `burst_ratio` times the base rate for ~`burst_on` s, every ~`burst_on + burst_off` s."""
    return MMPPArrivals(rate=1.0, burst_ratio=s.burst_ratio, mean_on=s.burst_on, mean_off=s.burst_off)


def _conversations(s: Settings) -> Conversations:
    return Conversations(
        rate=1.0,
        mean_turns=s.conv_turns,
        max_turns=s.conv_max_turns,
        think_time=s.think_time,
        system_tokens=s.system_tokens,
    )


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
            "The same bursts on a batching window (Triton dynamic batcher in front of a static-batch "
            "engine, prompts padded): concentrating requests fills batches before the window expires, "
            "so skew may pay here if anywhere.",
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
                "queue_capacity": 32,
                "prompt_median": 1024.0,
                "prompt_max": 8192,
            },
        ),
        Scenario(
            "prefix",
            "Shared system prompts and documents (64 prefixes of ~2k tokens, Zipf popularity, a "
            "~256-token question each; SGLang's generated-shared-prefix benchmark) under bursts: a node "
            "that holds a prefix skips its prefill, so affinity pays in TTFT until it overloads a node.",
            _bursts,
            {"prefix_share": 1.0, "load": 0.7},
        ),
        Scenario(
            "conversation",
            "Multi-turn chats (4 turns on average, 10 s think time, a shared system prompt): each turn "
            "resends the conversation so far, which only the node that served the last turn holds.",
            _conversations,
            {
                "load": 0.7,
                "prompt_median": 128.0,
                "prompt_max": 1024,
                "output_median": 128.0,
                "output_max": 512,
            },
        ),
        Scenario(
            "trace",
            "Replay of a real trace (`trace=PATH`: Azure LLM 2023, BurstGPT or Mooncake, whose block ids "
            "drive the prefix cache), time-scaled to the load, with the trace's own lengths.",
            lambda s: None,
            {"load": 0.7},
        ),
    )
}


def _per_node(value, n: int) -> tuple:
    return value if isinstance(value, tuple) else (value,) * n


@lru_cache(maxsize=16)
def _trace(path: str, max_blocks: int):
    return load_trace(path, max_blocks=max_blocks)


def _workload(scenario: Scenario, s: Settings) -> Workload:
    if scenario.name == "trace" or s.trace is not None:
        if s.trace is None:
            raise ValueError("scenario 'trace' needs a trace file: make('trace', trace='path/to/file.csv')")
        return Workload(arrivals=TraceReplay(_trace(str(s.trace), s.max_prefix_blocks)))
    prompt = LogNormalLengths(median=s.prompt_median, sigma=s.prompt_sigma, max_tokens=s.prompt_max)
    output = LogNormalLengths(median=s.output_median, sigma=s.output_sigma, max_tokens=s.output_max)
    prefix = None
    if s.prefix_share > 0:
        prefix = SharedPrefixes(
            groups=s.prefix_groups,
            zipf_exponent=s.prefix_zipf,
            prefix=LogNormalLengths(median=s.prefix_median, sigma=s.prefix_sigma, max_tokens=s.prefix_max),
            shared=s.prefix_share,
            chunk_tokens=s.chunk_tokens,
        )
    return Workload(arrivals=scenario.arrivals(s), prompt=prompt, output=output, prefix=prefix)


def vllm_batch_defaults(profile: Profile) -> tuple[int, int]:
    """(max_num_seqs, max_num_batched_tokens) vLLM v0.11.0 picks for this GPU (OpenAI API server)."""
    large = profile.gpu.memory_bytes >= LARGE_GPU_BYTES and "a100" not in profile.gpu.name.lower()
    return (1024, 8192) if large else (256, 2048)


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
    profiles = [load_profile(p, engine=s.engine) for p in _per_node(s.profile, n)]
    speeds = [float(v) for v in _per_node(s.speed, n)]
    workload = _workload(scenario, s)
    defaults = [vllm_batch_defaults(p) for p in profiles]
    seqs = [s.max_num_seqs or d[0] for d in defaults]
    budgets = [s.max_num_batched_tokens or d[1] for d in defaults]
    longest = workload.max_prompt + workload.max_output
    kv_tokens = [s.kv_capacity_tokens or p.kv_capacity_tokens for p in profiles]
    for i, kv in enumerate(kv_tokens):
        if kv < longest:
            raise ValueError(
                f"node {i}: KV capacity {kv} tokens cannot hold the longest request ({longest} tokens); "
                "lower prompt_max/output_max or pick a larger GPU profile"
            )
    prompts, outputs = capacity.sample_lengths(workload)
    caps = []
    for p, v, kv, seq, budget in zip(profiles, speeds, kv_tokens, seqs, budgets, strict=True):
        if s.scheduler == "continuous":
            caps.append(capacity.continuous_capacity(p.latency, v, seq, budget, kv, prompts, outputs))
        else:
            caps.append(
                capacity.dynamic_capacity(p.latency, v, s.max_batch_size, prompts, outputs, s.padding)
            )
    cluster_capacity = float(sum(c.rps for c in caps))
    rate = s.load * cluster_capacity
    workload = workload.with_rate(rate)

    def arr(values, dtype=None):
        return jnp.asarray(np.asarray(values), dtype=dtype)

    fdt = jnp.result_type(float)
    node_power = [
        p.power if s.power == "roofline" else flat_power_model(p.idle_power_w, p.busy_power_w)
        for p in profiles
    ]
    power = PowerModel(*(arr([float(getattr(m, f)) for m in node_power], fdt) for f in PowerModel._fields))
    nodes = NodeParams(
        latency=LatencyModel(
            *(arr([float(getattr(p.latency, f)) for p in profiles], fdt) for f in LatencyModel._fields)
        ),
        power=power,
        speed=arr(speeds, fdt),
        max_num_seqs=arr(seqs, jnp.int32),
        max_num_batched_tokens=arr(budgets, jnp.int32),
        block_size=arr([s.block_size] * n, jnp.int32),
        kv_blocks=arr([kv // s.block_size for kv in kv_tokens], jnp.int32),
        max_batch_size=arr([s.max_batch_size] * n, jnp.int32),
        max_queue_delay=arr([s.max_queue_delay] * n, fdt),
        queue_capacity=arr([s.queue_capacity] * n, jnp.int32),
        sleep_power_w=arr([p.idle_power_w * s.sleep_power_fraction for p in profiles], fdt),
        sleep_timeout=arr([s.sleep_timeout] * n, fdt),
        wake_delay=arr([s.wake_delay] * n, fdt),
        capacity_rps=arr([c.rps for c in caps], fdt),
        request_scale=arr([c.concurrency for c in caps], fdt),
    )
    params = EnvParams(
        nodes=nodes,
        drop_penalty=arr(s.drop_penalty, fdt),
        energy_weight=arr(s.energy_weight, fdt),
        ttft_weight=arr(s.ttft_weight, fdt),
        reward_scale=arr(s.reward_scale, fdt),
        ttft_slo=arr(s.ttft_slo, fdt),
        tpot_slo=arr(s.tpot_slo, fdt),
        capacity_rate=arr(cluster_capacity, fdt),
        arrival_rate=arr(rate, fdt),
        prompt_scale=arr(workload.mean_prompt, fdt),
        age_scale=arr(s.max_queue_delay if s.scheduler == "dynamic" else 1.0, fdt),
        rate_window=arr(s.rate_window, fdt),
        signal_interval=arr(s.signal_interval, fdt),
    )
    limit = max(seqs) if s.scheduler == "continuous" else s.max_batch_size
    exact = min(limit + s.queue_capacity, s.episode_length)
    chunk = workload.chunk_tokens
    if chunk and chunk % s.block_size:
        raise ValueError(
            f"the workload's prefix chunks ({chunk} tokens) are not whole KV blocks of {s.block_size}"
        )
    # Generated prompts are cut at whole chunks; a trace's last block of a prompt may be shorter.
    whole = not isinstance(workload.arrivals, TraceReplay)
    entries = max(
        entry_bound(kv // s.block_size, s.block_size, chunk or 512, seq, whole)
        for kv, seq in zip(kv_tokens, seqs, strict=True)
    )
    cfg = EnvConfig(
        n_nodes=n,
        episode_length=s.episode_length,
        scheduler=s.scheduler,
        workload=workload,
        objective=s.objective,
        reward=s.reward,
        end=s.end,
        slots=s.slots or exact,
        slot_widths=tuple(int(w) for w in s.slot_widths),
        prefix_caching=s.scheduler == "continuous" and s.prefix_caching and chunk > 0,
        chunk_tokens=chunk or 512,
        cache_entries=entries,
        padding=s.padding,
    )
    return cfg, params
