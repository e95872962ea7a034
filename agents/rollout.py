"""Evaluation rollouts: many routers over the same seeded episodes (common random numbers), in one
batch of clusters stepped by the functional core without auto-reset, so each episode's final
state (per-request log included) is kept.

Every router gets the same request streams: the batch holds `len(routers) x len(seeds)` clusters
and cluster `r * S + s` replays seed `s` under router `r`. One jitted step serves all
configurations that differ only in their workload (load, arrival process), because the step never
reads the workload; each such configuration only compiles its own (small) reset.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import jax
import jax.numpy as jnp
import numpy as np
from scipy import stats

from burstgym import scenarios
from burstgym.env import BurstBalance
from burstgym.types import EnvConfig

_SHARED: dict[EnvConfig, Any] = {}


class RouterLike(Protocol):
    name: str

    def reset(self, n_envs: int) -> None: ...

    def __call__(self, obs: np.ndarray, mask: np.ndarray | None = None) -> np.ndarray: ...


@dataclass
class Episodes:
    """One router's episodes, one row per seed."""

    cost: np.ndarray  # [S] objective (minus the summed rewards times reward_scale; lower is better)
    metrics: dict[str, np.ndarray]  # [S] per metric, [S, N] for load_share
    e2e: np.ndarray  # [S, E] end-to-end latency per request, NaN when dropped


def _shared_fns(cfg: EnvConfig):
    """The jitted batched step and metrics of `cfg`, shared by configurations differing in workload only."""
    key = dataclasses.replace(cfg, workload=None)
    if key not in _SHARED:
        core = BurstBalance(cfg)
        _SHARED[key] = (
            jax.jit(jax.vmap(core.step_env, in_axes=(0, 0, None))),
            jax.jit(jax.vmap(core.metrics, in_axes=(0, None))),
        )
    return _SHARED[key]


class Rollout:
    """Runs routers on `scenario` (with `settings` overrides) over seeded episodes."""

    def __init__(self, scenario: str, **settings: Any):
        self.scenario = scenario
        self.settings = settings
        self.cfg, self.params = scenarios.make(scenario, **settings)
        self.core = BurstBalance(self.cfg)
        self._reset = jax.jit(jax.vmap(self.core.reset, in_axes=(0, None)))
        self._step, self._metrics = _shared_fns(self.cfg)

    def run(self, routers: Sequence[RouterLike], seeds: Sequence[int], progress=None) -> dict[str, Episodes]:
        """Each router's episodes on `seeds`; `progress(k)` is called after each step if given."""
        n_seeds = len(seeds)
        tiled = np.tile(np.asarray(seeds), len(routers))
        keys = jax.vmap(jax.random.key)(jnp.asarray(tiled, dtype=jnp.uint32))
        obs, state = self._reset(keys, self.params)
        obs = np.asarray(obs)
        mask = np.ones((obs.shape[0], self.cfg.n_nodes), dtype=bool)
        for r in routers:
            r.reset(n_seeds)
        total = np.zeros(obs.shape[0])
        for k in range(self.cfg.episode_length):
            actions = np.concatenate(
                [
                    r(obs[i * n_seeds : (i + 1) * n_seeds], mask[i * n_seeds : (i + 1) * n_seeds])
                    for i, r in enumerate(routers)
                ]
            )
            actions = jnp.asarray(actions, dtype=jnp.int32)
            obs, state, reward, _, info = self._step(state, actions, self.params)
            obs, mask = np.asarray(obs), np.asarray(info["action_mask"])
            total += np.asarray(reward, dtype=np.float64)
            if progress is not None:
                progress(k)
        metrics = {k: np.asarray(v, dtype=np.float64) for k, v in self._metrics(state, self.params).items()}
        log, req = state.log, state.requests
        e2e = np.where(np.asarray(log.dropped), np.nan, np.asarray(log.finish) - np.asarray(req.arrival))
        cost = -total * float(self.params.reward_scale)
        out = {}
        for i, r in enumerate(routers):
            sl = slice(i * n_seeds, (i + 1) * n_seeds)
            out[r.name] = Episodes(cost[sl], {k: v[sl] for k, v in metrics.items()}, e2e[sl])
        return out


def ci95(x: np.ndarray) -> tuple[float, float]:
    """Mean and half-width of the 95% confidence interval (Student t over the samples)."""
    x = np.asarray(x, dtype=np.float64)
    x = x[np.isfinite(x)]
    if x.size == 0:
        return float("nan"), float("nan")
    if x.size < 2:
        return float(x.mean()), float("nan")
    half = stats.t.ppf(0.975, x.size - 1) * x.std(ddof=1) / np.sqrt(x.size)
    return float(x.mean()), float(half)
