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
import os
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import lru_cache

import jax
import jax.numpy as jnp
import numpy as np

from burstgym import capacity, prediction
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
from burstgym.workload.base import INT32_MAX, float_dtype

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
    slot_widths: tuple[int, ...] = (32, 64, 128)  # narrower tables a step may run at (burstgym.env); () none
    chunk_widths: tuple[int, ...] = (
        128,
    )  # fewer chunks per request a step may run at (burstgym.env); () none
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
        """Refuse impossible settings with a one-line ValueError naming the field: the type (a
        string, a bool or a float where an integer is expected, a bool or a string where a number
        is), the range, and the integer width the core stores it in (int32), before anything
        reaches JAX. NumPy scalars count as the Python numbers they hold."""
        for name, (low, high) in _INTEGERS.items():
            _check_int(name, getattr(self, name), low, high)
        for name in _OPTIONAL_INTEGERS:
            if getattr(self, name) is not None:
                _check_int(name, getattr(self, name), 1, INT32_MAX)
        for name, (low, high, inclusive, infinite) in _REALS.items():
            _check_real(name, getattr(self, name), low, high, inclusive, infinite)
        if self.slots is not None and self.slots > self.episode_length:
            raise ValueError(
                f"scenario setting 'slots' ({self.slots}) exceeds episode_length ({self.episode_length}): "
                "a node never holds more requests than the episode has"
            )
        if self.chunk_tokens % self.block_size:
            raise ValueError(
                f"scenario setting 'chunk_tokens' ({self.chunk_tokens}) must be a multiple of block_size "
                f"({self.block_size})"
            )
        if self.system_tokens % 512:
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
            v = getattr(self, name)
            if not isinstance(v, str) or v not in valid:
                raise ValueError(f"scenario setting {name!r} must be one of {valid}, got {v!r}")
        for name in ("prefix_caching", "padding"):
            if not isinstance(getattr(self, name), (bool, np.bool_)):
                raise ValueError(
                    f"scenario setting {name!r} must be True or False, got {getattr(self, name)!r}"
                )
        for name in ("slot_widths", "chunk_widths"):
            widths = getattr(self, name)
            if not isinstance(widths, tuple):
                raise ValueError(
                    f"scenario setting {name!r} must be a tuple of positive integers, got {widths!r}"
                )
            for w in widths:
                _check_int(name, w, 1, INT32_MAX, f" (each entry of {widths!r})")
        for name in ("profile", "speed"):
            v = getattr(self, name)
            if isinstance(v, tuple) and len(v) != self.n_nodes:
                raise ValueError(f"scenario setting {name!r} has {len(v)} entries for {self.n_nodes} nodes")
        for v in self.speed if isinstance(self.speed, tuple) else (self.speed,):
            _check_real("speed", v, 0.0, None, False, False)
        for v in self.profile if isinstance(self.profile, tuple) else (self.profile,):
            if not isinstance(v, str) or not v:
                raise ValueError(
                    "scenario setting 'profile' must be a profile name or a tuple of them, "
                    f"got {self.profile!r}"
                )
        if self.engine is not None and (not isinstance(self.engine, str) or not self.engine):
            raise ValueError(f"scenario setting 'engine' must be an engine name or None, got {self.engine!r}")
        if self.trace is not None and not isinstance(self.trace, (str, os.PathLike)):
            raise ValueError(f"scenario setting 'trace' must be a file path or None, got {self.trace!r}")


MAX_NODES = 4096  # per-node arrays and an observation of 11 N + 4 values
MAX_EPISODE = 2**24  # arrivals per episode: the stream and the request log are held in memory
MAX_TOKENS = 2**24  # tokens of one prompt, output or shared prefix (beyond any model's context)
MAX_TURNS = 1024  # turns of one conversation (the sessions are drawn as [sessions, turns] arrays)
# Chunk ids the shared prefixes name (groups x chunks of the longest prefix): every node's prefix
# cache holds arrays over the episode's chunk ids (burstgym.prefix_cache), so this bounds memory.
MAX_SHARED_CHUNKS = 2**16
MAX_CHUNK_IDS = 2**24  # every chunk id of an episode (shared and per-request)

# name: (low, high) of the integer settings
_INTEGERS: dict[str, tuple[int, int]] = {
    "n_nodes": (1, MAX_NODES),
    "episode_length": (1, MAX_EPISODE),
    "block_size": (1, INT32_MAX),
    "max_batch_size": (1, INT32_MAX),
    "queue_capacity": (1, INT32_MAX),
    "prompt_max": (1, MAX_TOKENS),
    "output_max": (1, MAX_TOKENS),
    "prefix_groups": (1, INT32_MAX),
    "prefix_max": (1, MAX_TOKENS),
    "chunk_tokens": (1, INT32_MAX),
    "conv_max_turns": (1, MAX_TURNS),
    "system_tokens": (0, MAX_TOKENS),
    "max_prefix_blocks": (1, INT32_MAX),
}
_OPTIONAL_INTEGERS = ("max_num_seqs", "max_num_batched_tokens", "kv_capacity_tokens", "slots")
_OPEN, _CLOSED = False, True
# name: (low, high, low inclusive, inf allowed) of the real-valued settings
_REALS: dict[str, tuple[float, float | None, bool, bool]] = {
    **{
        name: (0.0, None, _OPEN, False)
        for name in (
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
            "think_time",
        )
    },
    **{
        name: (0.0, None, _CLOSED, False)
        for name in (
            "max_queue_delay",
            "wake_delay",
            "drop_penalty",
            "energy_weight",
            "ttft_weight",
            "sleep_power_fraction",
            "signal_interval",
        )
    },
    "sleep_timeout": (0.0, None, _CLOSED, True),  # inf: never sleeps
    "burst_ratio": (1.0, None, _CLOSED, True),  # inf: silent gaps between bursts
    "prefix_share": (0.0, 1.0, _CLOSED, False),
    "conv_turns": (1.0, None, _CLOSED, False),
}


def _is_int(v) -> bool:
    return isinstance(v, (int, np.integer)) and not isinstance(v, (bool, np.bool_))


def _is_real(v) -> bool:
    return isinstance(v, (int, float, np.integer, np.floating)) and not isinstance(v, (bool, np.bool_))


def _check_int(name: str, v, low: int, high: int, where: str = "") -> None:
    """`v` an integer (Python or NumPy, not a bool or a float) in [low, high]."""
    if not _is_int(v):
        kind = "a whole number given as a float" if isinstance(v, (float, np.floating)) else type(v).__name__
        raise ValueError(f"scenario setting {name!r} must be an integer, got {v!r} ({kind}){where}")
    if not low <= v <= high:
        what = "a positive integer" if low == 1 else f"an integer >= {low}"
        bound = " (int32)" if high == INT32_MAX else ""
        raise ValueError(f"scenario setting {name!r} must be {what} <= {high:,}{bound}, got {v!r}{where}")


def _check_real(name: str, v, low: float, high: float | None, inclusive: bool, infinite: bool) -> None:
    """`v` a number (Python or NumPy, not a bool or a string), finite unless `infinite`, above `low`
    (at `low` too when `inclusive`), at most `high`, and representable in JAX's float dtype."""
    if not _is_real(v):
        raise ValueError(f"scenario setting {name!r} must be a number, got {v!r} ({type(v).__name__})")
    x = float(v)
    if math.isnan(x) or (math.isinf(x) and not (infinite and x > 0)):
        raise ValueError(f"scenario setting {name!r} must be a finite number, got {v!r}")
    ok = (x >= low if inclusive else x > low) and (high is None or x <= high)
    if not ok:
        rng = f"in [{low:g}, {high:g}]" if high is not None else f"{'>=' if inclusive else '>'} {low:g}"
        raise ValueError(f"scenario setting {name!r} must be {rng}, got {v!r}")
    biggest = float(np.finfo(float_dtype()).max)
    if math.isfinite(x) and abs(x) > biggest:
        raise ValueError(
            f"scenario setting {name!r} ({v!r}) exceeds the largest {float_dtype()} ({biggest:g})"
        )


def _plain(v):
    """NumPy scalars as the Python numbers they hold (tuples element-wise), lists as tuples."""
    if isinstance(v, (list, tuple)):
        return tuple(_plain(x) for x in v)
    if isinstance(v, np.generic) and not isinstance(v, np.bool_):
        return v.item()
    if isinstance(v, np.bool_):
        return bool(v)
    return v


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
        path = str(s.trace)
        trace = _trace(path, s.max_prefix_blocks)
        try:
            return Workload(arrivals=TraceReplay(trace))
        except ValueError as e:  # what replay needs of a trace (two requests, a positive duration)
            raise ValueError(f"{path}: {e}") from None
    if s.prefix_share > 0:
        chunks = -(-s.prefix_max // s.chunk_tokens)
        if s.prefix_groups * chunks > MAX_SHARED_CHUNKS:
            raise ValueError(
                f"scenario setting 'prefix_groups' ({s.prefix_groups:,}) x {chunks} chunks per prefix "
                f"(prefix_max {s.prefix_max} / chunk_tokens {s.chunk_tokens}) names more than "
                f"{MAX_SHARED_CHUNKS:,} shared chunk ids; at most {MAX_SHARED_CHUNKS // chunks:,} groups "
                "at these settings"
            )
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


class LoadWarning(UserWarning):
    """A setting asks for a load the episode cannot show (see `make`)."""


def _check_chunk_ids(workload: Workload, s: Settings) -> None:
    """Refuse an episode whose prefix chunks need more ids than `MAX_CHUNK_IDS` (the core numbers
    them in int32 and every node's prefix cache holds arrays over them). The count is the shape
    the workload's own sampler produces, traced without running it."""
    shapes = jax.eval_shape(lambda key: workload.sample(key, s.episode_length), jax.random.key(0))
    ids = int(shapes.chunk_tokens.shape[0])
    if ids > MAX_CHUNK_IDS:
        raise ValueError(
            f"scenario settings name {ids:,} prefix chunk ids per episode, above the bound of "
            f"{MAX_CHUNK_IDS:,}: lower 'episode_length' ({s.episode_length:,}) or raise 'chunk_tokens' "
            f"({s.chunk_tokens})"
        )


def _warn_unreachable_load(s: Settings, caps: list[capacity.Capacity]) -> None:
    """Warn (`LoadWarning`) when a load above 1 cannot show in the episode: under continuous
    batching the nodes' running sets hold about `sum(concurrency)` requests at saturation; an
    episode with no more arrivals than that can admit every request at once, so a balanced router
    queues and drops nothing whatever the load (docs/workloads.md, "Overload")."""
    held = sum(c.concurrency for c in caps)
    if s.scheduler == "continuous" and s.load > 1 and s.episode_length <= held:
        warnings.warn(
            f"load {s.load:g} cannot show in an episode of {s.episode_length:,} arrivals: the "
            f"{s.n_nodes} nodes' running sets hold about {held:,.0f} requests at saturation, so a "
            "balanced router admits every arrival at once and the excess load shows only as slower "
            f"iterations, not as queues or drops; overload needs episode_length well above {held:,.0f} "
            "(docs/workloads.md, 'Overload')",
            LoadWarning,
            stacklevel=3,
        )


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
    overrides = {k: _plain(v) for k, v in overrides.items() if v is not None}
    s = Settings(**{**scenario.settings, **overrides})
    s.validate()
    # numbers as floats where floats are meant (an int above int32 would overflow in JAX)
    return scenario, dataclasses.replace(s, **{name: float(getattr(s, name)) for name in _REALS})


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
                "lower prompt_max/output_max, raise kv_capacity_tokens or pick a larger GPU profile"
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
    fdt = jnp.result_type(float)
    smallest, largest = float(np.finfo(fdt).tiny), float(np.finfo(fdt).max)
    for i, c in enumerate(caps):
        if not smallest <= c.rps <= largest:
            raise ValueError(
                f"node {i}: settings give a capacity of {c.rps:g} requests/s, which {fdt} cannot hold "
                "(check 'speed' and the batch limits)"
            )
    rate = s.load * cluster_capacity
    if not smallest <= rate <= largest:
        raise ValueError(
            f"scenario setting 'load' ({s.load:g}) gives an arrival rate of {rate:g} requests/s "
            f"(capacity {cluster_capacity:g}/s), which {fdt} cannot hold"
        )
    workload = workload.with_rate(rate)
    _check_chunk_ids(workload, s)
    _warn_unreachable_load(s, caps)

    def arr(values, dtype=None):
        return jnp.asarray(np.asarray(values), dtype=dtype)

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
        lengths=prediction.length_stats(workload, s.max_batch_size),
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
        chunk_widths=tuple(int(w) for w in s.chunk_widths),
        prefix_caching=s.scheduler == "continuous" and s.prefix_caching and chunk > 0,
        chunk_tokens=chunk or 512,
        cache_entries=entries,
        padding=s.padding,
    )
    return cfg, params
