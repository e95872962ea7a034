"""The Gymnasium face of BurstBalance: one cluster (`BurstBalanceEnv`) and many in one jitted call
(`BurstBalanceVectorEnv`, the `vector_entry_point` of `BurstBalance-v0`).

Both hand out NumPy arrays, fetched from the device in one transfer per step. Jitted functions
are cached per static configuration, so creating many environments of one scenario compiles once.

Episode ends follow `Settings.end`: with "drain" (default) the last routing step serves every
accepted request, so the episode *terminates* (the MDP has reached its end); with "cut" the
episode stops with requests still in flight and is *truncated* (a time limit, bootstrap from the
last observation). Stepping a finished episode without a reset raises, as does any error bit the
core raises (a slot table overflowed, an event loop ran away, the cache's stamps overflowed):
nothing is dropped or capped silently.
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
from burstgym.cluster import map_clusters
from burstgym.compile_cache import jit
from burstgym.env import BurstBalance
from burstgym.metrics import to_python
from burstgym.observation import OBS_HIGH, RouterView, obs_size
from burstgym.types import (
    ERROR_CACHE_FULL,
    ERROR_RUNAWAY,
    ERROR_SLOT_OVERFLOW,
    ERROR_STAMP_OVERFLOW,
    RUNNING,
    WAITING,
    EnvConfig,
    EnvParams,
)

_ERRORS = {
    ERROR_SLOT_OVERFLOW: "a node's slot table overflowed: raise `slots` (requests a node can hold)",
    ERROR_RUNAWAY: "an event loop exceeded its bound between two arrivals (a node that never finishes)",
    ERROR_STAMP_OVERFLOW: "the prefix cache's release counter overflowed: shorten `episode_length`",
    ERROR_CACHE_FULL: "a node's prefix cache had no room for a chunk, every entry pinned: raise "
    "`EnvConfig.cache_entries` (parameters changed by hand past what `scenarios.make` sized it for)",
}
_PHASES = ("idle", "busy", "asleep", "waking")


@functools.lru_cache(maxsize=32)
def compiled(cfg: EnvConfig) -> tuple[BurstBalance, dict[str, Any]]:
    """The functional env of `cfg` and its jitted entry points (compiled on first call)."""
    core = BurstBalance(cfg)
    batched_view = jax.vmap(core.view, in_axes=(0, None))
    fns = {
        "reset": jit(lambda key, params: _reset_with_mask(core, key, params)),
        "step_env": jit(core.step_env),
        "metrics": jit(core.metrics),
        "view": jit(core.view),
        "batched_reset": jit(core.batched_reset),
        "batched_mask": jit(jax.vmap(core.action_mask, in_axes=(0, None))),
        "batched_step": jit(batched_step_fn(core), donate_argnums=(0,)),
        "batched_view": jit(batched_view),
    }
    return core, fns


def batched_step_fn(core: BurstBalance):
    """(states, actions, params) -> the step with auto-reset of a batch of clusters (the vector env's,
    the JAX learner's): on CPU the clusters one after another in one call (`map_clusters` over
    `core.step`), since a vmapped step runs every cluster's event loop for as long as the
    busiest cluster needs (`bursty`, 64 clusters in one thread: 25,377 decisions/s one at a time
    against 9,643 vmapped, docs/performance.md); elsewhere vmapped (`core.batched_step`). The
    infos agree where a consumer reads them (`metrics` only where an episode ended)."""
    if jax.default_backend() != "cpu":
        return core.batched_step

    def step(states, actions, params):
        return map_clusters(lambda sa: core.step(sa[0], sa[1], params), (states, actions))

    return step


def _reset_with_mask(core: BurstBalance, key: jax.Array, params: EnvParams):
    obs, state = core.reset(key, params)
    return obs, state, core.action_mask(state, params)


def check_error(error: Any, where: str = "") -> None:
    """Raise the core's error bits (`State.error`, one or a batch) as a RuntimeError naming each."""
    bits = int(np.bitwise_or.reduce(np.asarray(error, dtype=np.int64).ravel()))
    if bits:
        reasons = "; ".join(msg for bit, msg in _ERRORS.items() if bits & bit)
        raise RuntimeError(f"simulation error{where}: {reasons}")


def spaces(n_nodes: int) -> tuple[gym.spaces.Box, gym.spaces.Discrete]:
    """The observation and action spaces of one cluster of `n_nodes` nodes."""
    obs = gym.spaces.Box(0.0, OBS_HIGH, shape=(obs_size(n_nodes),), dtype=np.float32)
    return obs, gym.spaces.Discrete(n_nodes)


def _spaces(cfg: EnvConfig) -> tuple[gym.spaces.Box, gym.spaces.Discrete]:
    return spaces(cfg.n_nodes)


def _check_action(action: Any, n_nodes: int) -> int:
    a = np.asarray(action)
    if a.shape != () or not np.issubdtype(a.dtype, np.integer) or not 0 <= int(a) < n_nodes:
        raise ValueError(f"action {action!r} is not a node index in [0, {n_nodes}) (Discrete({n_nodes}))")
    return int(a)


class BurstBalanceEnv(gym.Env):
    """Route each arriving LLM request to one of N batching inference nodes.

    :param scenario: a name from `burstgym.scenarios.SCENARIOS` (default "bursty").
    :param render_mode: None, "ansi" (a text table of the nodes) or "rgb_array" (a bar chart).
    :param settings: overrides of `burstgym.scenarios.Settings` (n_nodes, load, profile, trace, ...).

    Observation, action and reward are documented in `burstgym.observation`, `burstgym.env` and
    `burstgym.reward`. `info["action_mask"]` marks the nodes that would accept the next request;
    at the end of an episode `info["metrics"]` holds the serving metrics of `burstgym.metrics`.
    `router_view()` returns what a router sees of the next request, in natural units.
    """

    metadata = {"render_modes": ["ansi", "rgb_array"], "render_fps": 4}

    def __init__(self, scenario: str = "bursty", render_mode: str | None = None, **settings: Any):
        if render_mode not in (None, *self.metadata["render_modes"]):
            raise ValueError(f"render_mode {render_mode!r} is not supported; use None, 'ansi' or 'rgb_array'")
        self.cfg, self.params = scenarios.make(scenario, **settings)
        self.scenario = scenario
        self.render_mode = render_mode
        self.core, self._fns = compiled(self.cfg)
        self.observation_space, self.action_space = _spaces(self.cfg)
        self._state = None
        self._done = False

    @property
    def params_pytree(self) -> EnvParams:
        """The parameters the functional core runs with."""
        return self.params

    @property
    def state(self):
        """The functional state of the current episode (None before `reset`)."""
        return self._state

    def reset(self, *, seed: int | None = None, options: dict | None = None) -> tuple[np.ndarray, dict]:
        super().reset(seed=seed)
        key = jax.random.key(int(self.np_random.integers(2**31 - 1)))
        obs, self._state, mask = self._fns["reset"](key, self.params)
        self._done = False
        obs, mask = jax.device_get((obs, mask))
        return obs, {"action_mask": mask}

    def step(self, action: Any) -> tuple[np.ndarray, float, bool, bool, dict]:
        if self._state is None:
            raise RuntimeError("call reset() before step()")
        if self._done:
            raise RuntimeError("the episode has ended: call reset() before step()")
        a = _check_action(action, self.cfg.n_nodes)
        obs, self._state, reward, done, info = self._fns["step_env"](self._state, a, self.params)
        obs, reward, done, info, step = jax.device_get((obs, reward, done, info, self._state.step))
        check_error(info["error"], f" at request {int(step) - 1}")  # one transfer per step
        out: dict[str, Any] = {"action_mask": info["action_mask"], "dropped": bool(info["dropped"])}
        done = bool(done)
        if done:
            self._done = True
            out["metrics"] = to_python(self._fns["metrics"](self._state, self.params))
        drain = self.cfg.end == "drain"
        return obs, float(reward), done and drain, done and not drain, out

    def router_view(self) -> RouterView:
        """What a router sees of the next request (`burstgym.observation.RouterView`, NumPy)."""
        if self._state is None:
            raise RuntimeError("call reset() before router_view()")
        return jax.device_get(self._fns["view"](self._state, self.params))

    def _nodes(self) -> dict[str, np.ndarray]:
        s = jax.device_get(self._state)
        view = jax.device_get(self.router_view())
        return {
            "running": (s.slots.status == RUNNING).sum(axis=1),
            "waiting": (s.slots.status == WAITING).sum(axis=1),
            "phase": s.nodes.phase,
            "kv": np.asarray(view.kv_util),
            "cache": np.asarray(view.cache_used),
            "hit": np.asarray(view.hit_tokens),
            "prompt": float(view.prompt),
            "clock": float(s.clock),
            "step": int(s.step),
        }

    def render(self) -> str | np.ndarray | None:
        if self.render_mode is None or self._state is None:
            return None
        n = self._nodes()
        if self.render_mode == "ansi":
            lines = [f"t={n['clock']:.3f}s request {n['step']}/{self.cfg.episode_length}"]
            for i in range(self.cfg.n_nodes):
                lines.append(
                    f"node {i}: {_PHASES[n['phase'][i]]:6s} running={n['running'][i]:4d} "
                    f"waiting={n['waiting'][i]:4d} kv={n['kv'][i]:5.1%} cache={n['cache'][i]:5.1%} "
                    f"hit={int(n['hit'][i])}/{int(n['prompt'])}"
                )
            return "\n".join(lines)
        return self._render_rgb(n)

    def _render_rgb(self, n: dict[str, Any]) -> np.ndarray:
        """An RGB frame: per node running and waiting requests (bars) and its power state (tick
        label); on a second axis the KV share held by running requests and by the prefix cache;
        the arriving request's prompt and each node's cached prefix of it (tick label, title)."""
        try:
            from matplotlib.backends.backend_agg import FigureCanvasAgg
            from matplotlib.figure import Figure
        except ImportError:  # not in the base install
            raise gym.error.DependencyNotInstalled(
                'render_mode="rgb_array" draws with matplotlib: pip install "burstgym[train]" (or matplotlib)'
            ) from None

        fig = Figure(figsize=(6.4, 3.6), dpi=80)
        FigureCanvasAgg(fig)
        ax = fig.add_subplot()
        x = np.arange(self.cfg.n_nodes)
        ax.bar(x - 0.2, n["running"], 0.4, label="running")
        ax.bar(x + 0.2, n["waiting"], 0.4, label="waiting")
        ticks = [
            f"{i} {_PHASES[p]}\nhit {int(h)}"
            for i, (p, h) in enumerate(zip(n["phase"], n["hit"], strict=True))
        ]
        ax.set_xticks(x, ticks)
        ax.set_ylabel("requests")
        ax.set_title(
            f"t = {n['clock']:.2f} s, request {n['step']}/{self.cfg.episode_length}: "
            f"{int(n['prompt'])} prompt tokens",
            fontsize="medium",
        )
        kv = ax.twinx()
        kv.plot(x, n["kv"], "k.", markersize=10, label="KV: running")
        kv.plot(x, n["cache"], "rx", markersize=8, label="KV: prefix cache")
        kv.set_ylim(0, 1)
        kv.set_ylabel("share of KV blocks")
        ax.legend(loc="upper left", fontsize="small")
        kv.legend(loc="upper right", fontsize="small")
        fig.tight_layout()
        fig.canvas.draw()
        return np.asarray(fig.canvas.buffer_rgba())[..., :3].copy()


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
        obs, mask = jax.device_get((obs, self._fns["batched_mask"](self._states, self.params)))
        return obs, {"action_mask": mask}

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
        obs, reward, done, info = jax.device_get((obs, reward, done, info))
        check_error(info["error"])
        infos: dict[str, Any] = {"action_mask": info["action_mask"]}
        if done.any():
            infos["final_obs"] = info["final_obs"]
            infos["_final_obs"] = done
            infos["final_info"] = {"metrics": info["metrics"], "_metrics": done}
            infos["_final_info"] = done
        drain = self.cfg.end == "drain"
        terminated = done if drain else np.zeros_like(done)
        truncated = np.zeros_like(done) if drain else done
        return obs, np.asarray(reward, dtype=np.float64), terminated, truncated, infos

    def router_views(self) -> RouterView:
        """What the routers of all clusters see of their next requests (NumPy, batch first)."""
        if self._states is None:
            raise RuntimeError("call reset() before router_views()")
        return jax.device_get(self._fns["batched_view"](self._states, self.params))

    @property
    def states(self):
        """The batched functional state (a pytree of [num_envs, ...] arrays)."""
        return self._states
