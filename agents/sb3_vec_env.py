"""A Stable-Baselines3 `VecEnv` fed straight from the batched JAX core (`BurstBalanceVectorEnv`).

One jitted call steps every cluster; the only per-environment Python work is the list of info
dicts SB3 requires. Finished episodes carry `terminal_observation`, Monitor-style `episode`
statistics ({"r": return, "l": length, "t": seconds since creation}) and the serving `metrics`
of `burstgym.metrics` (scalars; `load_share` as a list).

With `end="drain"` (default) an episode ends once every request was served or dropped, so its
rewards already sum to minus the whole objective: nothing is left to bootstrap, and the end is a
termination (`TimeLimit.truncated` False). With `end="cut"` requests are still in flight at the
end, the end is a truncation (`TimeLimit.truncated` True) and SB3 bootstraps from
`terminal_observation`, as Gymnasium's face reports.

`stagger=True` gives each cluster's first episode its own length, drawn uniformly from
1..episode_length (the core's reset `horizon`), so the clusters' episodes end at different steps
and every rollout mixes early, middle and late parts of episodes instead of all clusters sitting
at the same point of the same-length episode. Later episodes have the full length.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import gymnasium as gym
import jax
import jax.numpy as jnp
import numpy as np
from stable_baselines3.common.vec_env.base_vec_env import VecEnv, VecEnvIndices, VecEnvStepReturn

from burstgym.gym_env import BurstBalanceVectorEnv
from burstgym.rollout import usable_cores


class JaxVecEnv(VecEnv):
    """`num_envs` BurstBalance clusters of `scenario` (with `settings` overrides) as an SB3 VecEnv.

    :param num_envs: clusters stepped together.
    :param scenario: a name from `burstgym.scenarios.SCENARIOS`.
    :param seed: seed of the first reset (later resets happen inside jit).
    :param stagger: first episodes of random lengths in 1..episode_length, one per cluster.
    :param settings: `burstgym.scenarios.Settings` overrides.
    """

    render_mode = None

    def __init__(
        self,
        num_envs: int,
        scenario: str = "bursty",
        seed: int | None = None,
        stagger: bool = False,
        **settings: Any,
    ):
        self.venv = BurstBalanceVectorEnv(num_envs, scenario, **settings)
        self.stagger = stagger
        self._rng = np.random.default_rng(seed)
        super().__init__(num_envs, self.venv.single_observation_space, self.venv.single_action_space)
        self.scenario = scenario
        self.settings = settings
        self._seeds = [seed] + [None] * (num_envs - 1)
        self._actions: np.ndarray | None = None
        self._mask = np.ones((num_envs, self.venv.cfg.n_nodes), dtype=bool)
        self._returns = np.zeros(num_envs)
        self._lengths = np.zeros(num_envs, dtype=np.int64)
        self._t0 = time.time()

    @property
    def n_nodes(self) -> int:
        """Nodes in each cluster."""
        return self.venv.cfg.n_nodes

    def reset(self) -> np.ndarray:
        if self.stagger:
            obs, mask = self._staggered_reset(self._seeds[0])
        else:
            obs, info = self.venv.reset(seed=self._seeds[0])
            mask = info["action_mask"]
        self._reset_seeds()
        self._mask = mask
        self._returns[:] = 0.0
        self._lengths[:] = 0
        self.reset_infos = [{"action_mask": m} for m in self._mask]
        return np.array(obs)  # a writable copy: torch refuses read-only arrays

    def _staggered_reset(self, seed: int | None) -> tuple[np.ndarray, np.ndarray]:
        """The vector env's reset (same keys from `seed`) with one first-episode length per cluster."""
        v, n = self.venv, self.num_envs
        if seed is None:
            seed = int(self._rng.integers(2**31 - 1))
        else:
            self._rng = np.random.default_rng(seed)
        horizons = jnp.asarray(self._rng.integers(1, v.cfg.episode_length + 1, size=n), dtype=jnp.int32)
        keys = jax.random.split(jax.random.key(seed), n)
        obs, v._states = v._fns["batched_reset"](keys, v.params, horizons)
        return jax.device_get((obs, v._fns["batched_mask"](v._states, v.params)))

    def step_async(self, actions: np.ndarray) -> None:
        self._actions = np.asarray(actions).reshape(self.num_envs).astype(np.int64)

    def step_wait(self) -> VecEnvStepReturn:
        obs, reward, terminated, truncated, info = self.venv.step(self._actions)
        done = terminated | truncated
        self._mask = info["action_mask"]
        self._returns += reward
        self._lengths += 1
        infos: list[dict[str, Any]] = [{} for _ in range(self.num_envs)]
        if done.any():
            metrics = info["final_info"]["metrics"]
            elapsed = round(time.time() - self._t0, 6)
            for i in np.flatnonzero(done):
                infos[i] = {
                    "terminal_observation": info["final_obs"][i],
                    "TimeLimit.truncated": bool(truncated[i]),
                    "episode": {"r": float(self._returns[i]), "l": int(self._lengths[i]), "t": elapsed},
                    "metrics": {k: v[i].tolist() if v.ndim > 1 else float(v[i]) for k, v in metrics.items()},
                }
            self._returns[done] = 0.0
            self._lengths[done] = 0
        return np.array(obs), reward.astype(np.float32), done, infos

    def action_masks(self) -> np.ndarray:
        """[num_envs, n_nodes] bool: nodes that would accept each cluster's next request."""
        return self._mask.copy()

    def router_views(self):
        """What each cluster's router sees of its next request (`RouterView`, NumPy, batch first)."""
        return self.venv.router_views()

    def close(self) -> None:
        self.venv.close()

    def get_attr(self, attr_name: str, indices: VecEnvIndices = None) -> list[Any]:
        own = ("render_mode", "scenario", "settings", "n_nodes", "action_masks", "stagger")
        value = getattr(self, attr_name) if attr_name in own else getattr(self.venv, attr_name)
        return [value for _ in self._get_indices(indices)]

    def set_attr(self, attr_name: str, value: Any, indices: VecEnvIndices = None) -> None:
        setattr(self.venv, attr_name, value)

    def env_method(self, method_name: str, *method_args, indices: VecEnvIndices = None, **kwargs) -> list:
        idx = self._get_indices(indices)
        if method_name == "action_masks":
            return [self._mask[i].copy() for i in idx]
        raise AttributeError(f"JaxVecEnv has no per-environment method {method_name!r}")

    def env_is_wrapped(self, wrapper_class: type[gym.Wrapper], indices: VecEnvIndices = None) -> list[bool]:
        return [False for _ in self._get_indices(indices)]

    def seed(self, seed: int | None = None) -> Sequence[None | int]:
        """Seed the next reset (the clusters' keys are split from this one seed)."""
        self._seeds = [seed] + [None] * (self.num_envs - 1)
        return [None if seed is None else seed + i for i in range(self.num_envs)]

    def get_images(self) -> Iterable[np.ndarray]:
        return []


class MixtureVecEnv(VecEnv):
    """Clusters of several configurations (`burstgym.mixture` groups) as one SB3 VecEnv: group g's
    clusters are a `JaxVecEnv` of `scenario` with `settings` and then `groups[g]` applied, and take
    consecutive places of the batch (`num_envs` shared as evenly as it divides). Every group has
    the same node count, so the observation and action spaces agree. The groups step at once from
    one thread per usable CPU core (`threads`): each group's step is its own compiled program, and
    on a CPU each runs on one core.

    :param groups: settings overrides, one mapping per group.
    :param seed: the first reset's seed; each group's is spawned from it (`numpy.random.SeedSequence`).
    :param threads: groups stepped at once (default: `burstgym.rollout.usable_cores()`).
    """

    render_mode = None

    def __init__(
        self,
        num_envs: int,
        groups: Sequence[dict[str, Any]],
        scenario: str = "bursty",
        seed: int | None = None,
        stagger: bool = False,
        threads: int | None = None,
        **settings: Any,
    ):
        if not groups:
            raise ValueError("a mixture needs at least one group of settings")
        if num_envs < len(groups):
            raise ValueError(f"n_envs ({num_envs}) must be at least the mixture's groups ({len(groups)})")
        threads = usable_cores() if threads is None else threads
        if threads < 1:
            raise ValueError(f"threads must be at least 1, got {threads}")
        self.sizes = [num_envs // len(groups) + (g < num_envs % len(groups)) for g in range(len(groups))]
        seeds = self._spawn(seed, len(groups))
        self.subs = [
            JaxVecEnv(n, scenario, seed=s, stagger=stagger, **{**settings, **g})
            for n, s, g in zip(self.sizes, seeds, groups, strict=True)
        ]
        spaces = {(e.observation_space.shape, e.action_space.n) for e in self.subs}
        if len(spaces) > 1:
            raise ValueError(f"the mixture's groups have different observation or action spaces: {spaces}")
        super().__init__(num_envs, self.subs[0].observation_space, self.subs[0].action_space)
        self.scenario, self.settings, self.groups, self.stagger = scenario, settings, list(groups), stagger
        ends = np.cumsum([0, *self.sizes])
        self._slices = [slice(int(a), int(b)) for a, b in zip(ends[:-1], ends[1:], strict=True)]
        self._pool = ThreadPoolExecutor(min(threads, len(self.subs)))

    @staticmethod
    def _spawn(seed: int | None, k: int) -> list[int | None]:
        if seed is None:
            return [None] * k
        return [int(s.generate_state(1)[0]) for s in np.random.SeedSequence(seed).spawn(k)]

    @property
    def n_nodes(self) -> int:
        """Nodes in each cluster."""
        return self.subs[0].n_nodes

    def reset(self) -> np.ndarray:
        obs = np.concatenate(list(self._pool.map(lambda e: e.reset(), self.subs)))
        self.reset_infos = [info for e in self.subs for info in e.reset_infos]
        return obs

    def step_async(self, actions: np.ndarray) -> None:
        actions = np.asarray(actions).reshape(self.num_envs)
        for e, sl in zip(self.subs, self._slices, strict=True):
            e.step_async(actions[sl])

    def step_wait(self) -> VecEnvStepReturn:
        parts = list(self._pool.map(lambda e: e.step_wait(), self.subs))
        obs, reward, done, infos = (list(x) for x in zip(*parts, strict=True))
        return (
            np.concatenate(obs),
            np.concatenate(reward),
            np.concatenate(done),
            [info for group in infos for info in group],
        )

    def action_masks(self) -> np.ndarray:
        """[num_envs, n_nodes] bool: nodes that would accept each cluster's next request."""
        return np.concatenate([e.action_masks() for e in self.subs])

    def router_views(self) -> list:
        """What each group's routers see of their next requests: one batched `RouterView` per group
        (`agents.routers.GroupedRouter` reads them), since their shapes differ (a group without
        shared prefixes has no chunk ids)."""
        return [e.router_views() for e in self.subs]

    def close(self) -> None:
        for e in self.subs:
            e.close()
        self._pool.shutdown()

    def get_attr(self, attr_name: str, indices: VecEnvIndices = None) -> list[Any]:
        own = ("render_mode", "scenario", "settings", "groups", "n_nodes", "stagger")
        if attr_name not in own:
            raise AttributeError(f"MixtureVecEnv has no attribute {attr_name!r} shared by its groups")
        return [getattr(self, attr_name) for _ in self._get_indices(indices)]

    def set_attr(self, attr_name: str, value: Any, indices: VecEnvIndices = None) -> None:
        for e in self.subs:
            e.set_attr(attr_name, value)

    def env_method(self, method_name: str, *method_args, indices: VecEnvIndices = None, **kwargs) -> list:
        if method_name == "action_masks":
            masks = self.action_masks()
            return [masks[i].copy() for i in self._get_indices(indices)]
        raise AttributeError(f"MixtureVecEnv has no per-environment method {method_name!r}")

    def env_is_wrapped(self, wrapper_class: type[gym.Wrapper], indices: VecEnvIndices = None) -> list[bool]:
        return [False for _ in self._get_indices(indices)]

    def seed(self, seed: int | None = None) -> Sequence[None | int]:
        """Seed the next reset of every group (each group's seed spawned from `seed`)."""
        for e, s in zip(self.subs, self._spawn(seed, len(self.subs)), strict=True):
            e.seed(s)
        return [None if seed is None else seed + i for i in range(self.num_envs)]

    def get_images(self) -> Iterable[np.ndarray]:
        return []
