"""The Gymnasium face of BurstBalance: one cluster (`BurstBalanceEnv`) and many in one jitted call
(`BurstBalanceVectorEnv`, the `vector_entry_point` of `BurstBalance-v0`).

Both hand out NumPy arrays. Jitted functions are cached per static configuration, so creating
many environments of one scenario compiles once.
"""

from __future__ import annotations

import functools
from typing import Any

import gymnasium as gym
import jax
import numpy as np
from gymnasium.vector import AutoresetMode, VectorEnv
from gymnasium.vector.utils import batch_space

from burstgym import scenarios
from burstgym.env import BurstBalance
from burstgym.metrics import to_python
from burstgym.observation import OBS_HIGH, obs_size
from burstgym.types import EnvConfig, EnvParams


@functools.lru_cache(maxsize=32)
def compiled(cfg: EnvConfig) -> tuple[BurstBalance, dict[str, Any]]:
    """The functional env of `cfg` and its jitted entry points (compiled on first call)."""
    core = BurstBalance(cfg)
    fns = {
        "reset": jax.jit(core.reset),
        "step_env": jax.jit(core.step_env),
        "metrics": jax.jit(core.metrics),
        "batched_reset": jax.jit(core.batched_reset),
        "batched_step": jax.jit(core.batched_step, donate_argnums=(0,)),
    }
    return core, fns


def _spaces(cfg: EnvConfig) -> tuple[gym.spaces.Box, gym.spaces.Discrete]:
    obs = gym.spaces.Box(0.0, OBS_HIGH, shape=(obs_size(cfg.n_nodes),), dtype=np.float32)
    return obs, gym.spaces.Discrete(cfg.n_nodes)


def _check_action(action: Any, n_nodes: int) -> int:
    a = np.asarray(action)
    if a.shape != () or not np.issubdtype(a.dtype, np.integer) or not 0 <= int(a) < n_nodes:
        raise ValueError(f"action {action!r} is not a node index in [0, {n_nodes}) (Discrete({n_nodes}))")
    return int(a)


class BurstBalanceEnv(gym.Env):
    """Route each arriving LLM request to one of N batching inference nodes.

    :param scenario: a name from `burstgym.scenarios.SCENARIOS` (default "bursty").
    :param render_mode: None or "ansi" (a text table of the nodes).
    :param settings: overrides of `burstgym.scenarios.Settings` (n_nodes, load, profile, trace, ...).

    Observation, action and reward are documented in `burstgym.observation`, `burstgym.env` and
    `burstgym.reward`. `info["action_mask"]` marks the nodes that would accept the next request;
    at the end of an episode (truncated=True, after every request was served or dropped)
    `info["metrics"]` holds the serving metrics of `burstgym.metrics`.
    """

    metadata = {"render_modes": ["ansi"]}

    def __init__(self, scenario: str = "bursty", render_mode: str | None = None, **settings: Any):
        if render_mode not in (None, "ansi"):
            raise ValueError(f"render_mode {render_mode!r} is not supported; use None or 'ansi'")
        self.cfg, self.params = scenarios.make(scenario, **settings)
        self.scenario = scenario
        self.render_mode = render_mode
        self.core, self._fns = compiled(self.cfg)
        self.observation_space, self.action_space = _spaces(self.cfg)
        self._state = None

    @property
    def params_pytree(self) -> EnvParams:
        """The parameters the functional core runs with."""
        return self.params

    def reset(self, *, seed: int | None = None, options: dict | None = None) -> tuple[np.ndarray, dict]:
        super().reset(seed=seed)
        key = jax.random.key(int(self.np_random.integers(2**31 - 1)))
        obs, self._state = self._fns["reset"](key, self.params)
        mask = self.core.action_mask(self._state, self.params)
        return np.asarray(obs), {"action_mask": np.asarray(mask)}

    def step(self, action: Any) -> tuple[np.ndarray, float, bool, bool, dict]:
        if self._state is None:
            raise RuntimeError("call reset() before step()")
        a = _check_action(action, self.cfg.n_nodes)
        obs, self._state, reward, done, info = self._fns["step_env"](self._state, a, self.params)
        out = {"action_mask": np.asarray(info["action_mask"]), "dropped": bool(info["dropped"])}
        done = bool(done)
        if done:
            out["metrics"] = to_python(self._fns["metrics"](self._state, self.params))
        return np.asarray(obs), float(reward), False, done, out

    def render(self) -> str | None:
        if self.render_mode != "ansi" or self._state is None:
            return None
        s = self._state
        status = np.asarray(s.slots.status)
        phase = np.asarray(s.nodes.phase)
        names = ("idle", "busy", "asleep", "waking")
        lines = [f"t={float(s.time):.3f}s request {int(s.step)}/{self.cfg.episode_length}"]
        for n in range(self.cfg.n_nodes):
            lines.append(
                f"node {n}: {names[phase[n]]:6s} running={int((status[n] == 2).sum()):3d} "
                f"waiting={int((status[n] == 1).sum()):3d}"
            )
        return "\n".join(lines)


class BurstBalanceVectorEnv(VectorEnv):
    """`num_envs` independent clusters stepped in one jitted, vmapped call (auto-reset inside jit).

    Autoreset mode is SAME_STEP: when an episode ends, the returned observation is the first of
    the next episode, `infos["final_obs"]` holds the last one and `infos["final_info"]["metrics"]`
    the finished episode's serving metrics (masked by `infos["_final_info"]`).
    """

    metadata = {"autoreset_mode": AutoresetMode.SAME_STEP}

    def __init__(self, num_envs: int = 1, scenario: str = "bursty", **settings: Any):
        if not isinstance(num_envs, int) or num_envs < 1:
            raise ValueError(f"num_envs must be a positive integer, got {num_envs!r}")
        settings.pop("max_episode_steps", None)
        self.cfg, self.params = scenarios.make(scenario, **settings)
        self.scenario = scenario
        self.num_envs = num_envs
        self.core, self._fns = compiled(self.cfg)
        self.single_observation_space, self.single_action_space = _spaces(self.cfg)
        self.observation_space = batch_space(self.single_observation_space, num_envs)
        self.action_space = batch_space(self.single_action_space, num_envs)
        self._states = None

    def reset(self, *, seed: int | None = None, options: dict | None = None) -> tuple[np.ndarray, dict]:
        super().reset(seed=seed)
        if seed is None:
            seed = int(self.np_random.integers(2**31 - 1))
        keys = jax.random.split(jax.random.key(seed), self.num_envs)
        obs, self._states = self._fns["batched_reset"](keys, self.params)
        mask = jax.vmap(self.core.action_mask, in_axes=(0, None))(self._states, self.params)
        return np.asarray(obs), {"action_mask": np.asarray(mask)}

    def step(self, actions: Any) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, dict]:
        if self._states is None:
            raise RuntimeError("call reset() before step()")
        a = np.asarray(actions)
        if a.shape != (self.num_envs,) or not np.issubdtype(a.dtype, np.integer):
            raise ValueError(f"actions must be {self.num_envs} integers, got shape {a.shape} dtype {a.dtype}")
        if a.min() < 0 or a.max() >= self.cfg.n_nodes:
            bad = int(np.flatnonzero((a < 0) | (a >= self.cfg.n_nodes))[0])
            raise ValueError(f"actions[{bad}] = {a[bad]} is not a node index in [0, {self.cfg.n_nodes})")
        obs, self._states, reward, done, info = self._fns["batched_step"](
            self._states, a.astype(np.int32), self.params
        )
        done = np.asarray(done)
        infos: dict[str, Any] = {"action_mask": np.asarray(info["action_mask"])}
        if done.any():
            infos["final_obs"] = np.asarray(info["final_obs"])
            infos["_final_obs"] = done
            infos["final_info"] = {
                "metrics": {k: np.asarray(v) for k, v in info["metrics"].items()},
                "_metrics": done,
            }
            infos["_final_info"] = done
        return np.asarray(obs), np.asarray(reward, dtype=np.float64), np.zeros_like(done), done, infos

    @property
    def states(self):
        """The batched functional state (a pytree of [num_envs, ...] arrays)."""
        return self._states
