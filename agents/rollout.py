"""Evaluation rollouts: many routers over the same seeded episodes (common random numbers), in one
batch of clusters stepped by the functional core without auto-reset, so each episode's final
state (per-request log included) is kept.

Every router gets the same request streams: the batch holds `len(routers) x len(seeds)` clusters
and cluster `r * S + s` replays seed `s` under router `r`. One jitted step serves all
configurations that differ only in their workload (load, arrival process), because the step never
reads the workload; each such configuration only compiles its own (small) reset.

Two engines run the episodes. Routers that are JAX rules (`jax_rule`: every router of
`agents.routers`, given as a rule or as its batched face, and the learned node-scoring policies of
both learners) run in `burstgym.rollout`, whole episodes in one jitted scan; the others (an SB3
policy the JAX network does not express, any custom Python router) are stepped here one arrival
at a time, the router called on each step's observations, mask and views. Both paths step the
clusters with per-cluster parameters (`burstgym.rollout.step_clusters`), so a rule gets
bit-identical episodes from either (tests/test_jax_rollout.py) as long as it draws no random
numbers (the engine folds each episode's seed into a rule's key, the step-by-step face each
cluster's index). `run(..., engine="numpy")` steps every router here.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import jax
import jax.numpy as jnp
import numpy as np

from agents.routers.base import BatchedRouter
from burstgym import rollout as jax_rollout
from burstgym import scenarios
from burstgym.compile_cache import jit
from burstgym.env import BurstBalance
from burstgym.gym_env import check_error
from burstgym.observation import RouterView
from burstgym.rollout import per_cluster, step_clusters
from burstgym.types import EnvConfig

ENGINES = ("auto", "numpy", "jax")

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


def jax_rule(router: Any) -> Any:
    """The JAX rule the rollout engine runs for `router` (`burstgym.routing.Router`), or None
    for a router only Python can call. A router with a `jax_router()` method (the learned
    policies) gives its own, or None when it cannot be converted."""
    if callable(getattr(router, "jax_router", None)):
        return router.jax_router()
    if isinstance(router, BatchedRouter):
        return router.rule
    if callable(getattr(router, "init", None)) and callable(getattr(router, "act", None)):
        return router
    return None


def _shared_fns(cfg: EnvConfig):
    """The jitted batched step, metrics and view of `cfg` (per-cluster parameters), shared by
    configurations differing in workload only."""
    key = dataclasses.replace(cfg, workload=None)
    if key not in _SHARED:
        core = BurstBalance(cfg)
        _SHARED[key] = (
            jit(functools.partial(step_clusters, core, one_at_a_time=jax.default_backend() == "cpu")),
            jit(jax.vmap(core.metrics)),
            jit(jax.vmap(core.view)),
        )
    return _SHARED[key]


class Rollout:
    """Runs routers on `scenario` (with `settings` overrides) over seeded episodes."""

    def __init__(self, scenario: str, **settings: Any):
        self.scenario = scenario
        self.settings = settings
        self.cfg, self.params = scenarios.make(scenario, **settings)
        self.core = BurstBalance(self.cfg)
        self._reset = jit(jax.vmap(self.core.reset))
        self._step, self._metrics, self._view = _shared_fns(self.cfg)

    def run(
        self, routers: Sequence[RouterLike], seeds: Sequence[int], progress=None, engine: str = "auto"
    ) -> dict[str, Episodes]:
        """Each router's episodes on `seeds`; `progress(k)` is called after each step if given
        (after the whole episode for routers run by the JAX engine). `engine`: "auto" runs routers
        that are JAX rules in the JAX engine and the others step by step, "numpy" steps every
        router, "jax" refuses routers that are not JAX rules."""
        if engine not in ENGINES:
            raise ValueError(f"unknown engine {engine!r}; valid engines: {', '.join(ENGINES)}")
        rules = [None if engine == "numpy" else jax_rule(r) for r in routers]
        if engine == "jax" and any(t is None for t in rules):
            names = [r.name for r, t in zip(routers, rules, strict=True) if t is None]
            raise ValueError(f"routers that are not JAX rules: {', '.join(names)}")
        fast = [i for i, t in enumerate(rules) if t is not None]
        slow = [i for i, t in enumerate(rules) if t is None]
        episodes: dict[int, Episodes] = {}
        first_error = None
        if fast:
            batch = jax_rollout.rollout(self.cfg, self.params, [rules[i] for i in fast], seeds, check=False)
            first_error = batch.first_error()
            n = len(seeds)
            for j, i in enumerate(fast):
                sl = slice(j * n, (j + 1) * n)
                metrics = {k: np.asarray(v[sl], dtype=np.float64) for k, v in batch.metrics.items()}
                episodes[i] = Episodes(
                    batch.objective[sl],
                    metrics,
                    batch.ttft[sl].astype(np.float64),
                    batch.e2e[sl].astype(np.float64),
                )
        if slow:
            stepped = self._step_by_step([routers[i] for i in slow], seeds, progress, first_error)
            episodes.update(zip(slow, stepped, strict=True))
        elif first_error is not None:
            check_error(first_error[1], f" at request {first_error[0]}")
        elif progress is not None:
            for k in range(self.cfg.episode_length):
                progress(k)
        return {routers[i].name: episodes[i] for i in range(len(routers))}

    def _step_by_step(
        self,
        routers: Sequence[RouterLike],
        seeds: Sequence[int],
        progress,
        first_error: tuple[int, int] | None,
    ) -> list[Episodes]:
        """Episodes of `routers` stepped one arrival at a time; `first_error` (step, bits) of the
        routers run elsewhere is raised at its step with whatever errors these raise there."""
        n_seeds = len(seeds)
        n_nodes = self.cfg.n_nodes
        routers = [r if callable(r) else BatchedRouter(r, n_nodes) for r in routers]
        tiled = np.tile(np.asarray(seeds), len(routers))
        keys = jax.vmap(jax.random.key)(jnp.asarray(tiled, dtype=jnp.uint32))
        params = per_cluster(self.params, tiled.size)
        obs, state = self._reset(keys, params)
        view = self._view(state, params)
        obs, view = jax.device_get((obs, view))
        mask = np.asarray(view.accepts) | ~np.asarray(view.accepts).any(axis=1, keepdims=True)
        for r in routers:
            if isinstance(r, BatchedRouter):
                r.reset(n_seeds, streams=seeds)  # the streams the JAX engine folds in
            else:
                r.reset(n_seeds)
        total = np.zeros(obs.shape[0])

        def part(tree, i):
            return jax.tree.map(lambda x: x[i * n_seeds : (i + 1) * n_seeds], tree)

        for k in range(self.cfg.episode_length):
            actions = np.concatenate(
                [r(part(obs, i), part(mask, i), part(view, i)) for i, r in enumerate(routers)]
            )
            actions = jnp.asarray(actions, dtype=jnp.int32)
            obs, state, reward, _, info = self._step(state, actions, params)
            view = self._view(state, params)
            obs, mask, reward, error, view = jax.device_get(
                (obs, info["action_mask"], reward, info["error"], view)
            )
            bits = np.bitwise_or.reduce(np.asarray(error, dtype=np.int64).ravel())
            if first_error is not None and first_error[0] == k:
                bits |= first_error[1]
            check_error(bits, f" at request {k}")
            total += np.asarray(reward, dtype=np.float64)
            if progress is not None:
                progress(k)
        metrics = {k: np.asarray(v, dtype=np.float64) for k, v in self._metrics(state, params).items()}
        log = jax.device_get(state.log)
        ttft = np.where(log.dropped, np.nan, log.ttft).astype(np.float64)
        e2e = np.where(log.dropped, np.nan, log.e2e).astype(np.float64)
        cost = -total * float(self.params.reward_scale)
        out = []
        for i in range(len(routers)):
            sl = slice(i * n_seeds, (i + 1) * n_seeds)
            out.append(Episodes(cost[sl], {k: v[sl] for k, v in metrics.items()}, ttft[sl], e2e[sl]))
        return out
