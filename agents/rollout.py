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
from burstgym.gym_env import check_error
from burstgym.observation import RouterView
from burstgym.types import EnvConfig

_SHARED: dict[EnvConfig, Any] = {}


class RouterLike(Protocol):
    name: str

    def reset(self, n_envs: int) -> None: ...

    def __call__(self, obs: np.ndarray, mask: np.ndarray | None, view: RouterView) -> np.ndarray: ...


@dataclass
class Episodes:
    """One router's episodes, one row per seed."""

    cost: np.ndarray  # [S] objective (minus the summed rewards times reward_scale; lower is better)
    metrics: dict[str, np.ndarray]  # [S] per metric, [S, N] for load_share
    ttft: np.ndarray  # [S, E] time to first token per request, NaN when dropped or unfinished
    e2e: np.ndarray  # [S, E] end-to-end latency per request, NaN when dropped or unfinished


def _shared_fns(cfg: EnvConfig):
    """The jitted batched step and metrics of `cfg`, shared by configurations differing in workload only."""
    key = dataclasses.replace(cfg, workload=None)
    if key not in _SHARED:
        core = BurstBalance(cfg)
        _SHARED[key] = (
            jax.jit(core.batched_step_env),
            jax.jit(jax.vmap(core.metrics, in_axes=(0, None))),
            jax.jit(jax.vmap(core.view, in_axes=(0, None))),
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
        self._step, self._metrics, self._view = _shared_fns(self.cfg)

    def run(self, routers: Sequence[RouterLike], seeds: Sequence[int], progress=None) -> dict[str, Episodes]:
        """Each router's episodes on `seeds`; `progress(k)` is called after each step if given."""
        n_seeds = len(seeds)
        tiled = np.tile(np.asarray(seeds), len(routers))
        keys = jax.vmap(jax.random.key)(jnp.asarray(tiled, dtype=jnp.uint32))
        obs, state = self._reset(keys, self.params)
        view = self._view(state, self.params)
        obs, view = jax.device_get((obs, view))
        mask = np.asarray(view.accepts) | ~np.asarray(view.accepts).any(axis=1, keepdims=True)
        for r in routers:
            r.reset(n_seeds)
        total = np.zeros(obs.shape[0])

        def part(tree, i):
            return jax.tree.map(lambda x: x[i * n_seeds : (i + 1) * n_seeds], tree)

        for k in range(self.cfg.episode_length):
            actions = np.concatenate(
                [r(part(obs, i), part(mask, i), part(view, i)) for i, r in enumerate(routers)]
            )
            actions = jnp.asarray(actions, dtype=jnp.int32)
            obs, state, reward, _, info = self._step(state, actions, self.params)
            view = self._view(state, self.params)
            obs, mask, reward, error, view = jax.device_get(
                (obs, info["action_mask"], reward, info["error"], view)
            )
            check_error(error, f" at request {k}")
            total += np.asarray(reward, dtype=np.float64)
            if progress is not None:
                progress(k)
        metrics = {k: np.asarray(v, dtype=np.float64) for k, v in self._metrics(state, self.params).items()}
        log = jax.device_get(state.log)
        ttft = np.where(log.dropped, np.nan, log.ttft).astype(np.float64)
        e2e = np.where(log.dropped, np.nan, log.e2e).astype(np.float64)
        cost = -total * float(self.params.reward_scale)
        out = {}
        for i, r in enumerate(routers):
            sl = slice(i * n_seeds, (i + 1) * n_seeds)
            out[r.name] = Episodes(cost[sl], {k: v[sl] for k, v in metrics.items()}, ttft[sl], e2e[sl])
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
