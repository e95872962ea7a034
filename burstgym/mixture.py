"""A distribution of clusters and workloads, so one router can be trained across many of them.

`draw(seed, k)` returns `k` groups of scenario settings, each drawn independently from the
distribution below; a vector env built on them (`agents.sb3_vec_env.JaxVecEnv(groups=...)`) steps
an equal share of its clusters in each. The groups override the settings of the base scenario
`BASE` (on/off MMPP arrivals on continuous batching with prefix caching), so `burst_ratio` 1 is
Poisson arrivals and `prefix_share` 0 is a workload without shared prefixes.

Why per group and not per episode: a workload's shape (arrival process, length distributions,
prefix groups) is part of the compiled configuration (`EnvConfig.workload`), so every distinct
draw is one more compiled step. A run draws `k` of them (8 by default) and keeps them; another
seed draws others. The node count is fixed (the observation has one block of features per node).

The ranges cover the named scenarios and widen them; the real traces in ../shared/data are a
guide only (Azure LLM 2023 code: median prompt 1,469 tokens, output 13, inter-arrival CV 13;
Mooncake synthetic: median prompt 11,587, output 69), and they are never trained on: they are
what a router trained here is judged on.

| setting | distribution |
|---|---|
| `load` | uniform 0.3 to 1.0 of the cluster's capacity |
| `burst_ratio` | log-uniform 1 to 16 (1: Poisson) |
| `burst_on`, `burst_off` | uniform 1 to 4 s, uniform 2 to 10 s |
| `prefix_share` | 0 with probability 1/4, else uniform 0.3 to 1 |
| `prefix_groups` | log-uniform 8 to 512 |
| `prefix_zipf` | uniform 0.6 to 1.4 |
| `prefix_median` | log-uniform 256 to 4,096 tokens |
| `prompt_median` | log-uniform 64 to 1,024 tokens (`prompt_max` 4,096) |
| `output_median` | log-uniform 32 to 512 tokens (`output_max` 1,024) |
| `speed` | 1 on every node with probability 1/2, else uniform 0.5 to 1.5 per node |
| `signal_interval` | 0 (exact signals) with probability 2/3, else uniform 0.05 to 1 s |
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from burstgym.scenarios import settings_for

BASE = "bursty"  # the scenario every group overrides
NAME = "mixture"  # how train.py calls a run trained on draws of this distribution
# Settings every group draws (a run may not set them for all groups).
DRAWN = (
    "load",
    "burst_ratio",
    "burst_on",
    "burst_off",
    "prompt_median",
    "output_median",
    "prefix_share",
    "prefix_groups",
    "prefix_zipf",
    "prefix_median",
    "speed",
    "signal_interval",
)


def _log_uniform(rng: np.random.Generator, low: float, high: float) -> float:
    return float(math.exp(rng.uniform(math.log(low), math.log(high))))


def draw_one(rng: np.random.Generator, n_nodes: int) -> dict[str, Any]:
    """One group's settings (overrides of `BASE`), drawn from the table of the module docstring."""
    s: dict[str, Any] = {
        "load": round(float(rng.uniform(0.3, 1.0)), 4),
        "burst_ratio": round(_log_uniform(rng, 1.0, 16.0), 4),
        "burst_on": round(float(rng.uniform(1.0, 4.0)), 4),
        "burst_off": round(float(rng.uniform(2.0, 10.0)), 4),
        "prompt_median": round(_log_uniform(rng, 64.0, 1024.0), 1),
        "output_median": round(_log_uniform(rng, 32.0, 512.0), 1),
    }
    if rng.uniform() < 0.75:
        s.update(
            prefix_share=round(float(rng.uniform(0.3, 1.0)), 4),
            prefix_groups=int(round(_log_uniform(rng, 8.0, 512.0))),
            prefix_zipf=round(float(rng.uniform(0.6, 1.4)), 4),
            prefix_median=round(_log_uniform(rng, 256.0, 4096.0), 1),
        )
    else:
        s["prefix_share"] = 0.0
    if rng.uniform() < 0.5:
        s["speed"] = [round(float(v), 4) for v in rng.uniform(0.5, 1.5, size=n_nodes)]
    if rng.uniform() < 1 / 3:
        s["signal_interval"] = round(float(rng.uniform(0.05, 1.0)), 4)
    return s


def check_undrawn(settings: dict[str, Any], flag: str) -> None:
    """Refuse, naming `flag`, settings that every group draws for itself (they would be overridden)."""
    drawn = sorted(set(settings) & set(DRAWN))
    if drawn:
        raise ValueError(f"{flag} draws setting {drawn[0]!r} per group; do not set it")


def draw(seed: int, k: int, n_nodes: int = 4) -> list[dict[str, Any]]:
    """`k` groups of settings drawn with `seed`, each validated as overrides of `BASE`."""
    if not isinstance(k, int) or k < 1:
        raise ValueError(f"the mixture needs at least one group, got {k!r}")
    rng = np.random.default_rng([seed, 0x6D6978])  # a stream of its own, apart from the run's seed
    groups = [draw_one(rng, n_nodes) for _ in range(k)]
    for g in groups:
        settings_for(BASE, n_nodes=n_nodes, **g)
    return groups
