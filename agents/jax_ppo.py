"""PPO written in JAX (PureJaxRL style) for the node-scoring router: the environment, the policy and
the update in jitted calls, with no Python step loop.

One `update` = a jitted rollout of `n_steps` routing decisions on `n_envs` clusters (normalise
the observation, score the nodes, sample, and the core's step with auto-reset), then one jitted
call of generalised advantage estimation and `n_epochs` passes of minibatch PPO updates with
optax. train.py calls it once per rollout (`--algo jax-ppo`) and logs, evaluates and checkpoints
between calls, as for SB3.

It trains the same model as SB3's PPO with `agents.policies.NodeScoringPolicy`, from the same
rl-zoo3 hyperparameter file (`agents/hyperparams.yml`):
- the network, its parameters and their initialisation are `agents.model`'s, which the SB3 policy
  calls too;
- the loss of SB3's PPO (stable_baselines3 v2.7, stable_baselines3/ppo/ppo.py `train`): clipped
  surrogate on per-minibatch normalised advantages, unclipped squared value error (`vf_coef`),
  entropy bonus (`ent_coef`), gradients clipped to `max_grad_norm`, Adam with eps 1e-5; an
  update stops before the first minibatch whose approximate KL exceeds 1.5 x `target_kl`;
- observations normalised by `agents.model.ObsStats`, as SB3's `agents.learners.NodeVecNormalize`
  normalises them, with the statistics updated after each rollout (VecNormalize updates
  them every step); rewards are not normalised;
- a drained episode end is a termination; a cut end (`end="cut"`) is a truncation, and the value
  of the final observation is added (discounted) to the last reward, as SB3 does;
- staggered first episodes (lengths uniform in 1..episode_length), as `JaxVecEnv(stagger=True)`;
- a behaviour-cloning warm start of actor and critic on a heuristic's rollouts (its JAX twin,
  `agents.routers`), as `agents.learners.behaviour_clone`.

The clusters step as the vector env steps them (`burstgym.gym_env.batched_step_fn`: one after
another on CPU, vmapped on an accelerator). On an accelerator a rollout is a loop over steps of
the whole batch (network and step); on CPU a loop over the clusters of each one's loop over its
steps (`_scan_clusters`), with the network run on one cluster's observation at a time, so that a
cluster's state is not copied out of the batch and back at every step (1.5x the PPO steps/s on
`prefix`, docs/performance.md). The actions are drawn as `jax.random.categorical` draws them,
from Gumbel noise drawn ahead for every step (`_draw_noise`); the network's outputs for one
cluster can differ in their last bits from those for a batch. On CPU the rollout runs in equal
parts of the clusters from one thread per usable core (`parts`), since one cluster's step runs
on one core.

A checkpoint (`.msgpack`) holds the network parameters and the observation statistics;
`JaxPolicyRouter.load` makes it a router with the heuristics' interface, which evaluate.py judges.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import flax.serialization
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax.training.train_state import TrainState

from agents import model, warm_start
from agents.model import Moments, ObsStats
from agents.routers.base import RuleState
from agents.warm_start import BC_LR, TeacherData
from burstgym import cluster, routing
from burstgym.compile_cache import jit
from burstgym.env import BurstBalance
from burstgym.gym_env import batched_step_fn, check_error
from burstgym.observation import GLOBAL_FEATURES, NODE_FEATURES, action_mask
from burstgym.rollout import chunk_size, usable_cores
from burstgym.types import EnvConfig, EnvParams

ALGO = "jax-ppo"
ADAM_EPS = 1e-5  # SB3's Adam epsilon for PPO policies
POLICY = "agents.policies.NodeScoringPolicy"  # the SB3 policy this learner reproduces
# Keys of an rl-zoo3 PPO entry this learner reads; any other constructor key is refused.
KEYS = (
    "policy",
    "n_steps",
    "batch_size",
    "n_epochs",
    "learning_rate",
    "gamma",
    "gae_lambda",
    "ent_coef",
    "vf_coef",
    "max_grad_norm",
    "clip_range",
    "target_kl",
    "normalize_advantage",
    "policy_kwargs",
)
RUN_KEYS = ("n_timesteps", "n_envs", "env_kwargs", "normalize")


# ------------------------------------------------------------------------------------ settings


@dataclass(frozen=True)
class PPOConfig:
    """PPO hyperparameters (SB3's names and defaults)."""

    n_steps: int = 2048
    batch_size: int = 64
    n_epochs: int = 10
    learning_rate: float = 3e-4
    lr_decay: bool = False  # "lin_<value>": linear decay to 0 over training
    gamma: float = 0.99
    gae_lambda: float = 0.95
    ent_coef: float = 0.0
    vf_coef: float = 0.5
    max_grad_norm: float = 0.5
    clip_range: float = 0.2
    target_kl: float | None = None
    normalize_advantage: bool = True
    hidden: int = 64
    norm_obs: bool = True

    @classmethod
    def from_entry(cls, entry: dict[str, Any], path: str = "hyperparameters") -> PPOConfig:
        """The settings of an rl-zoo3 PPO entry (`agents.hyperparams.load`); refuses keys this
        learner does not implement, naming them and `path`."""
        kw = {k: v for k, v in entry.items() if k not in RUN_KEYS}
        bad = sorted(set(kw) - set(KEYS))
        if bad:
            known = ", ".join(KEYS)
            raise ValueError(f"{path}: jax-ppo does not implement {', '.join(bad)} (known: {known})")
        policy = kw.pop("policy", POLICY)
        if policy != POLICY:
            raise ValueError(f"{path}: jax-ppo trains {POLICY} only, not policy {policy!r}")
        out: dict[str, Any] = {}
        lr = kw.pop("learning_rate", cls.learning_rate)
        if isinstance(lr, str):
            kind, _, value = lr.partition("_")
            if kind != "lin":
                raise ValueError(
                    f"{path}: learning_rate: unknown schedule {lr!r} (use 'lin_<x>' or a number)"
                )
            lr, out["lr_decay"] = float(value), True
        out["learning_rate"] = float(lr)
        if isinstance(kw.get("clip_range"), str):
            raise ValueError(f"{path}: jax-ppo takes a constant clip_range, not {kw['clip_range']!r}")
        arch = (kw.pop("policy_kwargs", None) or {}).get("net_arch") or [cls.hidden]
        out["hidden"] = int(arch[0])
        norm = entry.get("normalize", False)
        if isinstance(norm, dict):
            if norm.get("norm_reward", True):
                raise ValueError(f"{path}: jax-ppo does not normalise rewards: normalize.norm_reward: false")
            out["norm_obs"] = bool(norm.get("norm_obs", True))
        elif norm:
            raise ValueError(f"{path}: jax-ppo does not normalise rewards: normalize.norm_reward: false")
        else:
            out["norm_obs"] = False
        for k, v in kw.items():
            default = getattr(cls, k)
            out[k] = v if v is None or default is None or isinstance(v, bool) else type(default)(v)
        return cls(**out)


# ------------------------------------------------------------------------------------- network


def apply(variables: Any, obs: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(logits, value) of the shared network (`agents.model.forward`) with flax's variables
    convention, `{"params": parameters}`, which the train state and checkpoints keep."""
    return model.forward(variables["params"], obs)


def init_variables(key: jax.Array, n_nodes: int, hidden: int) -> dict[str, Any]:
    """Fresh network variables (`agents.model.init`) as jax arrays."""
    return {"params": jax.tree.map(jnp.asarray, model.init(key, n_nodes, hidden))}


def variable_shapes(n_nodes: int, hidden: int) -> dict[str, Any]:
    """The shapes and dtypes of the network's variables, as checkpoints are checked against."""
    return {
        "params": {
            name: {
                "kernel": jax.ShapeDtypeStruct((i, o), jnp.float32),
                "bias": jax.ShapeDtypeStruct((o,), jnp.float32),
            }
            for name, (i, o) in model.shapes(n_nodes, hidden).items()
        }
    }


# ------------------------------------------------------------------------------- the algorithm


class Parts(NamedTuple):
    """The clusters' states in the equal parts a rollout steps from one thread each
    (`JaxPPO.parts`), kept so between rollouts: joining them after a rollout and cutting them
    before the next would copy every cluster's state twice (`JaxPPO.cluster_states` joins them)."""

    parts: tuple  # burstgym.types.State per part, [B / parts] leading axis


class Runner(NamedTuple):
    """The clusters being trained on, between rollouts."""

    states: Any  # burstgym.types.State with a [B] leading axis, or its `Parts`
    obs: jax.Array  # [B, D] raw observations of the next decision
    key: jax.Array  # PRNG key
    ep_return: jax.Array  # [B] return so far of each running episode


class Transition(NamedTuple):
    obs: jax.Array  # normalised
    action: jax.Array
    logp: jax.Array
    value: jax.Array
    reward: jax.Array
    done: jax.Array


def gae(
    rewards: jax.Array, values: jax.Array, dones: jax.Array, last_value: jax.Array, gamma: float, lam: float
) -> tuple[jax.Array, jax.Array]:
    """(advantages, returns) [T, B] of a rollout by generalised advantage estimation (Schulman et
    al. 2016, eq. 16); `dones[t]`: the episode ended at step t, `last_value`: V of the observation
    after the last step."""

    def back(carry, x):
        adv, v_next = carry
        r, v, d = x
        live = 1.0 - d.astype(r.dtype)
        delta = r + gamma * v_next * live - v
        adv = delta + gamma * lam * live * adv
        return (adv, v), adv

    _, adv = jax.lax.scan(
        back, (jnp.zeros_like(last_value), last_value), (rewards, values, dones), reverse=True
    )
    return adv, adv + values


def _categorical(noise: jax.Array, logits: jax.Array) -> tuple[jax.Array, jax.Array]:
    """A sampled action per row and its log-probability: the Gumbel-max draw of
    `jax.random.categorical`, with its Gumbel noise (`_draw_noise`) drawn ahead."""
    action = jnp.argmax(noise + logits, axis=-1).astype(jnp.int32)
    logp = jnp.take_along_axis(jax.nn.log_softmax(logits), action[..., None], axis=-1)[..., 0]
    return action, logp


def _draw_noise(key: jax.Array, steps: int, shape: tuple[int, ...]) -> tuple[jax.Array, jax.Array]:
    """(the key left, [steps, *shape] Gumbel noise): for each step, the key split in two and the
    noise `jax.random.categorical(sub, logits)` would draw for logits of `shape` with the second,
    so a rollout samples each step's actions as `categorical` would, from the noise of its step."""

    def draw(k: jax.Array, _: None) -> tuple[jax.Array, jax.Array]:
        k, sub = jax.random.split(k)
        return k, jax.random.gumbel(sub, shape, jnp.float32)

    return jax.lax.scan(draw, key, None, length=steps)


def _scan_clusters(body: Callable, carry: Any, xs: Any, length: int) -> tuple[Any, Any]:
    """`jax.lax.scan(body, carry, xs, length=length)` for a `body` that steps a batch of clusters
    (the carry's leaves: cluster axis 0; `xs` and the outputs: time-major, cluster axis 1).

    On CPU each cluster runs its `length` steps in one loop, as a batch of one (a `lax.map` over
    the clusters outside the scan over steps): its state stays in that loop's carry, instead of
    being sliced out of the batch and written back at every step, as a scan over steps of the
    clusters' steps would (the core steps the clusters one after another on CPU either way,
    `batched_step_fn`). Elsewhere the clusters step together, vmapped."""
    if jax.default_backend() != "cpu":
        return jax.lax.scan(body, carry, xs, length=length)

    def one(args: tuple[Any, Any]) -> tuple[Any, Any]:
        c, x = args
        c, out = jax.lax.scan(
            body, jax.tree.map(lambda a: a[None], c), jax.tree.map(lambda a: a[:, None], x), length=length
        )
        return jax.tree.map(lambda a: a[0], c), jax.tree.map(lambda a: a[:, 0], out)

    carry, outs = jax.lax.map(one, (carry, jax.tree.map(lambda a: a.swapaxes(0, 1), xs)))
    return carry, jax.tree.map(lambda a: a.swapaxes(0, 1), outs)


def _cut(whole: Any, parts: int) -> tuple[Any, ...]:
    """`whole` (leaves with the cluster axis first) cut into `parts` equal parts of its clusters."""
    m = jax.tree.leaves(whole)[0].shape[0] // parts
    return tuple(jax.tree.map(lambda x, i=i: x[i * m : (i + 1) * m], whole) for i in range(parts))


def _concat(parts: tuple) -> Any:
    """The parts (leaves with the cluster axis first) joined on the cluster axis."""
    return jax.tree.map(lambda *x: jnp.concatenate(x), *parts)


def _join(parts: tuple, outs: tuple) -> tuple[Any, Any]:
    """The parts joined on the cluster axis (0) and their outputs on theirs (1: time-major)."""
    return _concat(parts), jax.tree.map(lambda *x: jnp.concatenate(x, axis=1), *outs)


_JITTED: dict[Any, Callable] = {}


@functools.cache
def _core(cfg: EnvConfig) -> BurstBalance:
    return BurstBalance(cfg)


@functools.cache
def _optimizer(ppo: PPOConfig, steps: int) -> optax.GradientTransformation:
    """Gradient clipping and Adam, SB3's; one object per setting, so that train states of equal
    settings share compiled code (the optimiser is static in the train state)."""
    lr = optax.linear_schedule(ppo.learning_rate, 0.0, steps) if ppo.lr_decay else ppo.learning_rate
    return optax.chain(optax.clip_by_global_norm(ppo.max_grad_norm), optax.adam(lr, eps=ADAM_EPS))


@dataclass
class JaxPPO:
    """PPO on `n_envs` clusters of (`cfg`, `params`); see the module docstring.

    `setup(seed)` resets the clusters (staggered first episodes with `stagger`) and initialises the
    network; `update()` runs one rollout and its update in one jitted call and returns its logs.
    """

    cfg: EnvConfig
    params: EnvParams
    ppo: PPOConfig
    n_envs: int
    total_timesteps: int
    stagger: bool = True
    core: BurstBalance = field(init=False)

    def __post_init__(self) -> None:
        if self.n_envs < 1 or self.ppo.n_steps < 1:
            raise ValueError("n_envs and n_steps must be positive")
        batch = self.n_envs * self.ppo.n_steps
        self.batch_size = min(self.ppo.batch_size, batch)  # as train.py caps SB3's
        if batch % self.batch_size:
            raise ValueError(
                f"batch_size {self.batch_size} must divide n_steps x n_envs = {batch} "
                "(jax-ppo uses whole minibatches)"
            )
        self.n_minibatches = batch // self.batch_size
        self.n_updates = max(math.ceil(self.total_timesteps / batch), 1)
        self.core = _core(self.cfg)
        self.num_timesteps = 0

    def _jit(self, name: str, fn: Callable, *extra: Any) -> Callable:
        """`burstgym.compile_cache.jit(fn, parallel=True)`, compiled once per process for every
        learner of the same static settings: `fn` reads only the configuration, the PPO settings
        and the batch layout from `self` (the scenario's parameters come as an argument), so it
        is shared by equal learners. (The learner's programs keep XLA:CPU's parallel task
        assignment: without it its rollouts and updates ran slower, docs/performance.md.)"""
        key = (name, self.cfg, self.ppo, self.n_envs, self.batch_size, self.n_updates, *extra)
        if key not in _JITTED:
            _JITTED[key] = jit(fn, parallel=True)
        return _JITTED[key]

    # ----------------------------------------------------------------------------- set-up

    def setup(self, seed: int, resume: Checkpoint | None = None) -> None:
        """Reset every cluster from `seed` and initialise the network and the optimiser; with
        `resume`, continue a saved run: its network, optimiser state (the learning-rate schedule
        runs over the saved and the new updates together, as SB3's resumed `learn`), statistics
        and step count."""
        key = jax.random.key(seed)
        key, k_net, k_env, k_len = jax.random.split(key, 4)
        keys = jax.random.split(k_env, self.n_envs)
        e = self.cfg.episode_length
        horizons = (
            jax.random.randint(k_len, (self.n_envs,), 1, e + 1, dtype=jnp.int32)
            if self.stagger
            else jnp.full(self.n_envs, e, jnp.int32)
        )
        obs, states = self._jit("reset", self.core.batched_reset)(keys, self.params, horizons)
        done = 0 if resume is None else resume.optimizer_steps
        steps = done + self.n_updates * self.ppo.n_epochs * self.n_minibatches
        tx = _optimizer(self.ppo, steps if self.ppo.lr_decay else 0)  # a constant rate needs no horizon
        variables = init_variables(k_net, self.cfg.n_nodes, self.ppo.hidden)
        self.train_state = TrainState.create(apply_fn=apply, params=variables, tx=tx)
        self.stats = ObsStats.empty().update(obs)  # VecNormalize counts the reset too
        self.runner = Runner(states, obs, key, jnp.zeros(self.n_envs, jnp.float32))
        if resume is not None:
            self._restore(resume)

    def _restore(self, ck: Checkpoint) -> None:
        """Take the network, optimiser state, statistics and step count of `ck` (refusing one
        that does not fit these settings, naming its file)."""
        if ck.train is None:
            raise ValueError(f"{ck.path}: holds no optimiser state (a checkpoint older than resuming)")
        if ck.hidden != self.ppo.hidden or (ck.stats is None) == self.ppo.norm_obs:
            raise ValueError(
                f"{ck.path}: a network of width {ck.hidden} {'without' if ck.stats is None else 'with'} "
                f"observation statistics; these settings train width {self.ppo.hidden} "
                f"{'with' if self.ppo.norm_obs else 'without'}"
            )
        _check_shapes(ck.path, "params", self.train_state.params, ck.params)
        try:
            opt_state = flax.serialization.from_state_dict(self.train_state.opt_state, ck.train["opt_state"])
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"{ck.path}: the optimiser state does not fit these settings ({e})") from None
        _check_shapes(ck.path, "opt_state", self.train_state.opt_state, opt_state)
        self.train_state = self.train_state.replace(
            params=jax.tree.map(jnp.asarray, ck.params),
            opt_state=jax.tree.map(jnp.asarray, opt_state),
            step=int(ck.train["step"]),  # a Python int, as TrainState.create gives: no retrace
        )
        if ck.stats is not None:
            self.stats = jax.tree.map(jnp.asarray, ck.stats)
        self.num_timesteps = ck.num_timesteps

    def normalize(self, stats: ObsStats, obs: jax.Array) -> jax.Array:
        return stats.normalize(obs) if self.ppo.norm_obs else obs

    # -------------------------------------------------------------------------- one update

    def update(self) -> dict[str, float]:
        """One rollout and its PPO update; returns the logs (SB3's `train/...` names, episode
        returns and serving metrics of the episodes that ended in the rollout)."""
        return self.learn(*self.collect())

    def collect(self) -> tuple[Runner, Any]:
        """`n_steps` steps of every cluster under the current policy: the clusters' runner after
        them and the rollout (transitions, raw observations, returns, metrics, errors), not yet
        learned from; `learn` takes both. `update` is the two in a row; apart, each can be timed."""
        return self._in_parts("rollout", self._rollout, self.train_state, self.stats)

    def learn(self, runner: Runner, rollout: Any) -> dict[str, float]:
        """The PPO update on a rollout that `collect` returned, and its logs (`update`)."""
        learn = self._jit("learn", self._learn_fn)
        # the update reads the runner's observations and key, not the clusters' states
        self.train_state, self.stats, runner_out, logs = learn(
            self.train_state, self.stats, runner._replace(states=None), rollout
        )
        self.runner = runner_out._replace(states=runner.states)
        logs = jax.device_get(logs)
        if int(logs.pop("error")):
            where = f" in the jax-ppo rollout ending at step {self.num_timesteps}"
            check_error(int(logs["error_bits"]), where)
        logs.pop("error_bits")
        self.num_timesteps += self.n_envs * self.ppo.n_steps
        return {k: float(v) for k, v in logs.items()}

    def parts(self) -> int:
        """Equal parts of the clusters that step at once, from one thread each: on CPU the largest
        divisor of `n_envs` up to the usable cores (each part's steps run one cluster after another
        on one core); elsewhere 1 (every cluster vmapped)."""
        if jax.default_backend() != "cpu":
            return 1
        return chunk_size(self.n_envs, usable_cores())

    def _in_parts(self, name: str, fn: Callable, *shared: Any, static: tuple = ()) -> tuple[Runner, Any]:
        """`fn(runner, env_params, *shared) -> (runner, outputs)`, jitted, on each part of the
        clusters (`parts`) at once from as many threads, each part with its own key split from the
        runner's; returns the runner of every cluster (its states in `Parts` where there are
        several, with the key left after the split) and the parts' outputs joined on the cluster
        axis (axis 1: outputs are time-major)."""
        k, r = self.parts(), self.runner
        keys = jax.random.split(r.key, k + 1)
        jitted = self._jit(name, fn, *static)
        states = r.states
        if isinstance(states, Parts) and len(states.parts) != k:
            states = self.cluster_states()
        if k == 1:  # every cluster in one call: nothing to cut or join
            runner, outs = jitted(r._replace(states=states, key=keys[1]), self.params, *shared)
            return runner._replace(key=keys[0]), outs
        # The states stay in their parts between rollouts (`Parts`); the rest is cut and joined in
        # one jitted call each: leaf by leaf outside jit, that was hundreds of dispatches per
        # rollout (docs/performance.md, "The JAX learner's per-cluster rollout loop").
        cut = self._jit("cut", functools.partial(_cut, parts=k), k)
        if not isinstance(states, Parts):
            states = Parts(cut(states))
        small = cut((r.obs, r.ep_return))

        def run(i: int) -> tuple[Runner, Any]:
            obs, ep_return = small[i]
            out = jitted(Runner(states.parts[i], obs, keys[i + 1], ep_return), self.params, *shared)
            return jax.block_until_ready(out)

        with ThreadPoolExecutor(k) as pool:
            runners, outs = zip(*pool.map(run, range(k)), strict=True)
        small = tuple((q.obs, q.ep_return) for q in runners)
        (obs, ep_return), outs = self._jit("join", _join, name, *static)(small, outs)
        return Runner(Parts(tuple(q.states for q in runners)), obs, keys[0], ep_return), outs

    def cluster_states(self) -> Any:
        """The clusters' states (`burstgym.types.State`, cluster axis first), joined where the
        runner keeps them in parts."""
        states = self.runner.states
        return self._jit("concat", _concat)(states.parts) if isinstance(states, Parts) else states

    def _rollout(self, runner: Runner, env_params: EnvParams, ts: TrainState, stats: ObsStats):
        step = functools.partial(batched_step_fn(self.core), params=env_params)
        p, cut = self.ppo, self.cfg.end == "cut"
        key, noise = _draw_noise(runner.key, p.n_steps, (runner.obs.shape[0], self.cfg.n_nodes))

        def body(carry: tuple, g: jax.Array):
            states, raw, ep_return = carry
            x = self.normalize(stats, raw)
            logits, value = ts.apply_fn(ts.params, x)
            action, logp = _categorical(g, logits)
            obs, states, reward, done, info = step(states, action)
            if cut:  # a truncation: bootstrap from the final observation inside the reward
                _, v_end = ts.apply_fn(ts.params, self.normalize(stats, info["final_obs"]))
                reward = reward + p.gamma * jnp.where(done, v_end, 0.0)
            ep_return = ep_return + reward
            out = (
                Transition(x, action, logp, value, reward, done),
                raw,
                ep_return,
                info["metrics"],
                info["error"],
            )
            return (states, obs, jnp.where(done, 0.0, ep_return)), out

        carry = (runner.states, runner.obs, runner.ep_return)
        (states, obs, ep_return), outs = _scan_clusters(body, carry, noise, p.n_steps)
        return Runner(states, obs, key, ep_return), outs

    def _loss(self, params, batch: Transition, adv: jax.Array, returns: jax.Array, clip: float):
        p = self.ppo
        logits, value = apply(params, batch.obs)
        logp_all = jax.nn.log_softmax(logits)
        logp = jnp.take_along_axis(logp_all, batch.action[:, None], axis=-1)[:, 0]
        if p.normalize_advantage and adv.shape[0] > 1:
            adv = (adv - adv.mean()) / (adv.std(ddof=1) + 1e-8)
        log_ratio = logp - batch.logp
        ratio = jnp.exp(log_ratio)
        pg = -jnp.minimum(adv * ratio, adv * jnp.clip(ratio, 1 - clip, 1 + clip)).mean()
        value_loss = ((returns - value) ** 2).mean()
        entropy = -(jnp.exp(logp_all) * logp_all).sum(axis=-1).mean()
        loss = pg - p.ent_coef * entropy + p.vf_coef * value_loss
        aux = {
            "policy_gradient_loss": pg,
            "value_loss": value_loss,
            "entropy_loss": -entropy,
            "approx_kl": ((ratio - 1) - log_ratio).mean(),
            "clip_fraction": (jnp.abs(ratio - 1) > clip).mean(),
            "loss": loss,
        }
        return loss, aux

    def _learn_fn(self, ts: TrainState, stats: ObsStats, runner: Runner, rollout: tuple):
        """GAE and the `n_epochs` x minibatch updates on one rollout (`_rollout`'s outputs), and
        the rollout's logs."""
        p = self.ppo
        tr, raw_obs, ep_return, metrics, error = rollout
        _, last_value = ts.apply_fn(ts.params, self.normalize(stats, runner.obs))
        adv, returns = gae(tr.reward, tr.value, tr.done, last_value, p.gamma, p.gae_lambda)
        flat = jax.tree.map(lambda x: x.reshape((-1,) + x.shape[2:]), (tr, adv, returns))
        n = flat[1].shape[0]
        key, k_epochs = jax.random.split(runner.key)
        runner = runner._replace(key=key)
        grad = jax.value_and_grad(self._loss, has_aux=True)

        def minibatch(carry, idx):
            ts, stopped = carry
            batch, a, g = jax.tree.map(lambda x: x[idx], flat)
            (_, aux), grads = grad(ts.params, batch, a, g, p.clip_range)
            stop = stopped if p.target_kl is None else stopped | (aux["approx_kl"] > 1.5 * p.target_kl)
            new = ts.apply_gradients(grads=grads)
            ts = jax.tree.map(lambda old, upd: jnp.where(stop, old, upd), ts, new)
            return (ts, stop), (aux, ~stop)

        def epoch(carry, k):
            perm = jax.random.permutation(k, n).reshape(self.n_minibatches, self.batch_size)
            return jax.lax.scan(minibatch, carry, perm)

        (ts, stopped), (aux, applied) = jax.lax.scan(
            epoch, (ts, jnp.bool_(False)), jax.random.split(k_epochs, p.n_epochs)
        )
        applied = applied.astype(jnp.float32)
        # SB3 logs the minibatches it trained on (and the one that stopped the update)
        weight = jnp.maximum(applied, jnp.zeros_like(applied).at[0, 0].set(1.0))
        logs = {f"train/{k}": (v * weight).sum() / weight.sum() for k, v in aux.items()}
        var = flat[2].var()
        logs["train/explained_variance"] = jnp.where(
            var > 0, 1 - (flat[2] - flat[0].value).var() / var, jnp.nan
        )
        logs["train/n_updates"] = applied.sum()
        logs["train/stopped_early"] = stopped.astype(jnp.float32)
        ended = tr.done.astype(jnp.float32)
        count = ended.sum()
        logs["rollout/episodes"] = count
        logs["rollout/ep_rew_mean"] = jnp.where(
            count > 0, (ep_return * ended).sum() / jnp.maximum(count, 1), jnp.nan
        )
        for k, v in metrics.items():
            if v.ndim == 2:  # a scalar per cluster
                logs[f"serving/{k}"] = jnp.where(
                    count > 0, (v * ended).sum() / jnp.maximum(count, 1), jnp.nan
                )
            else:  # per node
                share = (v * ended[..., None]).sum(axis=(0, 1)) / jnp.maximum(count, 1)
                for i in range(v.shape[-1]):
                    logs[f"serving/{k}_node{i}"] = jnp.where(count > 0, share[i], jnp.nan)
        logs["error"] = (error != 0).any()
        logs["error_bits"] = jnp.bitwise_or.reduce(error.reshape(-1))
        new_stats = stats.update(raw_obs) if p.norm_obs else stats
        return ts, new_stats, runner, logs

    # -------------------------------------------------------------------------- warm start

    def warm_start(
        self, teacher: Any, steps: int, epochs: int, batch_size: int, lr: float = BC_LR
    ) -> dict[str, float]:
        """Behaviour cloning, as `agents.learners.behaviour_clone` does for SB3: `teacher` (a router
        of the rollout engine, `burstgym.routing`: a rule, marginal-cost, or the lookahead bound,
        which reads the cluster's state) routes the training clusters for `steps` decisions; the
        observation statistics take in its observations; then `agents.warm_start.fit` fits the
        network to them (`epochs` passes of minibatches of `batch_size`). The clusters continue
        from where the teacher left them. Returns the fit's records."""
        n = self.cfg.n_nodes
        t = max(steps // self.n_envs, 1)
        gamma, cut = self.ppo.gamma, self.cfg.end == "cut"

        def collect(runner: Runner, env_params: EnvParams):
            step = functools.partial(batched_step_fn(self.core), params=env_params)
            zero = jnp.uint32(0)
            fresh = teacher.init(n, zero, zero)  # every cluster's rule state at an episode's start

            def fresh_for(b: int):
                return jax.tree.map(lambda a: jnp.broadcast_to(a, (b, *a.shape)), fresh)

            def body(carry, _):
                states, raw, rs = carry
                views = jax.vmap(self.core.view, in_axes=(0, None))(states, env_params)
                masks = jax.vmap(action_mask)(views)
                action, rs = jax.vmap(
                    lambda s, v, m, c: routing.act(teacher, s, v, m, cluster_state=c, params=env_params)
                )(rs, views, masks, states)
                obs, states, reward, done, info = step(states, action)
                rs = cluster.tree_where(done, fresh_for(done.shape[0]), rs)
                out = (raw, action, reward, done, info["final_obs"], info["error"])
                return (states, obs, rs), out

            (states, obs, _), data = _scan_clusters(
                body, (runner.states, runner.obs, fresh_for(runner.obs.shape[0])), None, t
            )
            return runner._replace(states=states, obs=obs), data

        self.runner, collected = self._in_parts("collect", collect, static=(teacher, t))
        obs, actions, rewards, dones, final_obs, error = collected
        bits = int(np.bitwise_or.reduce(np.asarray(error).reshape(-1)))
        if bits:
            check_error(bits, " in the warm start's rollout")
        if self.ppo.norm_obs:
            self.stats = self.stats.update(obs)
        key, sub = jax.random.split(self.runner.key)
        self.runner = self.runner._replace(key=key)
        x = functools.partial(self.normalize, self.stats)
        data = TeacherData(x(obs), actions, rewards, dones, dones & cut, x(final_obs), x(self.runner.obs))
        params, out = warm_start.fit(
            self.train_state.params["params"], data, gamma, sub, epochs, batch_size, lr
        )
        self.train_state = self.train_state.replace(params={"params": params})
        return out

    # ------------------------------------------------------------------------- checkpoints

    def save(self, path: str | Path) -> None:
        """Write the network parameters, observation statistics, optimiser state and step count
        to `path` (.msgpack, atomically): enough to route with and to resume from."""
        train = {
            "opt_state": flax.serialization.to_state_dict(jax.device_get(self.train_state.opt_state)),
            "step": int(self.train_state.step),
            "num_timesteps": int(self.num_timesteps),
        }
        stats = self.stats if self.ppo.norm_obs else None
        save_checkpoint(path, self.train_state.params, stats, self.ppo.hidden, train)

    def router(self, name: str = "learned", deterministic: bool = True) -> JaxPolicyRouter:
        """The current policy as a router (a snapshot: later updates do not change it)."""
        stats = self.stats if self.ppo.norm_obs else None
        return JaxPolicyRouter(
            jax.device_get(self.train_state.params),
            stats,
            self.cfg.n_nodes,
            self.ppo.hidden,
            name,
            deterministic,
        )


CHECKPOINT_FORMAT = "burstgym-jax-ppo"


def save_checkpoint(
    path: str | Path, params: Any, stats: ObsStats | None, hidden: int, train: dict[str, Any] | None = None
) -> None:
    """A checkpoint (flax msgpack: arrays and plain values only, nothing that runs when read):
    {"format", "version": 2, "params", "hidden", "stats" (absent: observations not normalised),
    "train" (optimiser state, optimiser steps, environment steps; absent: not resumable)}."""
    from agents.runs import atomic

    blob: dict[str, Any] = {
        "format": CHECKPOINT_FORMAT,
        "version": 2,
        "params": jax.device_get(params),
        "hidden": hidden,
    }
    if stats is not None:
        blob["stats"] = jax.device_get({"node": stats.node._asdict(), "glob": stats.glob._asdict()})
    if train is not None:
        blob["train"] = train
    with atomic(path) as tmp:
        tmp.write_bytes(flax.serialization.msgpack_serialize(blob))


class Checkpoint(NamedTuple):
    """A jax-ppo checkpoint as read by `load_checkpoint`: plain arrays, checked."""

    path: Path
    params: Any  # {"params": {layer: {"kernel", "bias"}}} float32 arrays
    hidden: int
    n_nodes: int
    stats: ObsStats | None
    train: dict[str, Any] | None  # {"opt_state", "step", "num_timesteps"}

    @property
    def num_timesteps(self) -> int:
        return 0 if self.train is None else int(self.train["num_timesteps"])

    @property
    def optimizer_steps(self) -> int:
        return 0 if self.train is None else int(self.train["step"])


def _check_shapes(path: Path, what: str, expected: Any, got: Any) -> None:
    """Refuse `got` unless it has `expected`'s tree structure, shapes and float/int kinds."""
    if jax.tree.structure(expected) != jax.tree.structure(got):
        raise ValueError(f"{path}: {what} has another structure than this network's")

    def layout(x: Any) -> tuple[tuple[int, ...], str]:
        if not (hasattr(x, "shape") and hasattr(x, "dtype")):
            x = np.asarray(x)
        return tuple(x.shape), np.dtype(x.dtype).kind

    for a, b in zip(jax.tree.leaves(expected), jax.tree.leaves(got), strict=True):
        if layout(a) != layout(b):
            raise ValueError(
                f"{path}: {what} holds an array of shape {layout(b)[0]} where {layout(a)[0]} belongs"
            )


def load_checkpoint(path: str | Path) -> Checkpoint:
    """Read a checkpoint written by `save_checkpoint` (version 2, or 1 without optimiser state)
    and check it against the network it describes; a missing, truncated or foreign file is
    refused in one line naming it. msgpack holds data only: reading it runs no code."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"checkpoint {str(path)!r} does not exist")
    try:
        blob = flax.serialization.msgpack_restore(path.read_bytes())
    except Exception as e:  # msgpack's errors for damaged data have no common base class
        raise ValueError(f"{path}: not a jax-ppo checkpoint (unreadable: {type(e).__name__})") from None
    if not isinstance(blob, dict) or "params" not in blob or "hidden" not in blob:
        raise ValueError(f"{path}: not a jax-ppo checkpoint (no params and hidden)")
    hidden = blob["hidden"]
    if isinstance(hidden, bool) or not isinstance(hidden, int) or not 1 <= hidden <= 2**16:
        raise ValueError(f"{path}: not a jax-ppo checkpoint (hidden {hidden!r} is not a layer width)")
    try:
        n_inputs = int(np.asarray(blob["params"]["params"]["value_0"]["kernel"]).shape[0])
    except (KeyError, TypeError, IndexError):
        raise ValueError(f"{path}: not a jax-ppo checkpoint (no value_0 kernel)") from None
    try:
        n_nodes = model.n_nodes_of(n_inputs)
    except ValueError:
        raise ValueError(
            f"{path}: the network's inputs ({n_inputs}) are not a BurstBalance observation"
        ) from None
    _check_shapes(path, "params", variable_shapes(n_nodes, hidden), blob["params"])
    stats = None
    if "stats" in blob:
        s = blob["stats"]
        want = ObsStats.empty()
        try:
            stats = ObsStats(Moments(**s["node"]), Moments(**s["glob"]))
        except (KeyError, TypeError):
            raise ValueError(f"{path}: stats must hold node and glob mean, var and count") from None
        _check_shapes(path, "stats", want, stats)
        if not all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(stats)):
            raise ValueError(f"{path}: stats hold non-finite numbers")
    train = blob.get("train")
    if train is not None:
        ok = isinstance(train, dict) and {"opt_state", "step", "num_timesteps"} <= set(train)
        ints = ok and all(
            isinstance(train[k], int) and not isinstance(train[k], bool) and train[k] >= 0
            for k in ("step", "num_timesteps")
        )
        if not ints:
            raise ValueError(f"{path}: train must hold opt_state and the step counts")
    return Checkpoint(path, blob["params"], hidden, n_nodes, stats, train)


class JaxPolicyRouter:
    """A node-scoring policy (a jax-ppo checkpoint, or an SB3 `NodeScoringPolicy`'s weights copied
    by `agents.learners.PolicyRouter.jax_router`) as a router: argmax of the logits (default) or
    sampled from them, on observations normalised with the statistics saved with the policy.

    Two faces: the heuristics' interface (`__call__` on a batch of observations, as
    `agents.learners.PolicyRouter`), and the JAX rollout engine's (`burstgym.rollout`: `init`,
    `act` on one cluster's observation, `weights`), so evaluate.py runs it inside the jitted episode
    with the other routers. It hashes and compares by its structure (nodes, width, statistics or
    none, argmax or sampled), not its weights, which the engine takes as an argument: routers of
    one shape share a compiled episode. Sampled actions draw from each episode's key in the engine
    (`fold_in(key(seed), episode seed)`), from one key per call here: same distribution, other draws.
    """

    family = "learned"
    observes = True  # burstgym.rollout passes the observation and `weights()` to `act`

    def __init__(
        self,
        params: Any,
        stats: ObsStats | None,
        n_nodes: int,
        hidden: int,
        name: str = "learned",
        deterministic: bool = True,
        seed: int = 0,
    ):
        self.params, self.stats, self.n_nodes, self.name = params, stats, n_nodes, name
        self.deterministic, self.hidden, self.seed = deterministic, hidden, seed
        self._build()

    def _build(self) -> None:
        self._key = jax.random.key(self.seed)
        self._act = jit(self._act_fn)

    def __getstate__(self) -> dict[str, Any]:  # picklable (Ray tasks): arrays and settings only
        keep = ("params", "stats", "n_nodes", "hidden", "name", "deterministic", "seed")
        return {k: jax.device_get(getattr(self, k)) for k in keep}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._build()

    @property
    def observation_shape(self) -> tuple[int, ...]:
        """The observation shape the policy takes."""
        return (self.n_nodes * len(NODE_FEATURES) + len(GLOBAL_FEATURES),)

    @classmethod
    def load(cls, path: str | Path, name: str = "learned", deterministic: bool = True) -> JaxPolicyRouter:
        """The router of a checkpoint written by `JaxPPO.save` (`load_checkpoint`: clear errors
        for a missing, damaged or foreign file)."""
        ck = load_checkpoint(path)
        return cls(ck.params, ck.stats, ck.n_nodes, ck.hidden, name, deterministic)

    def _act_fn(self, params, stats, obs, key, deterministic):
        x = obs if stats is None else stats.normalize(obs)
        logits = model.logits(params["params"], x)
        return jnp.where(deterministic, jnp.argmax(logits, axis=-1), jax.random.categorical(key, logits))

    def _structure(self) -> tuple[Any, ...]:
        return (JaxPolicyRouter, self.n_nodes, self.hidden, self.stats is None, bool(self.deterministic))

    def __hash__(self) -> int:
        return hash(self._structure())

    def __eq__(self, other: object) -> bool:
        return isinstance(other, JaxPolicyRouter) and self._structure() == other._structure()

    def weights(self) -> tuple[Any, ObsStats | None]:
        """The arrays `act` reads: network parameters and observation statistics."""
        return self.params, self.stats

    def init(self, n_nodes: int, seed: Any = None, stream: Any = 0) -> RuleState:
        """A fresh episode's state (`agents.routers.base.RuleState`: the sampling key)."""
        seed = self.seed if seed is None else seed
        key = jax.random.key(jnp.asarray(seed, jnp.uint32))
        key = jax.random.fold_in(key, jnp.asarray(stream, jnp.uint32))
        return RuleState(jnp.int32(0), jax.random.key_data(key), ())

    def act(
        self, state: RuleState, view: Any, mask: jax.Array, obs: jax.Array, weights: tuple[Any, Any]
    ) -> tuple[jax.Array, RuleState]:
        """The node for one cluster's observation `obs` [D] under `weights` (`mask` and `view` are
        not used, as in `__call__`)."""
        params, stats = weights
        x = obs if stats is None else stats.normalize(obs)
        logits = model.logits(params["params"], x)
        if self.deterministic:
            action = jnp.argmax(logits)
        else:
            key, sub = jax.random.split(jax.random.wrap_key_data(state.key))
            action = jax.random.categorical(sub, logits)
            state = state._replace(key=jax.random.key_data(key))
        return action.astype(jnp.int32), state._replace(counter=state.counter + 1)

    def jax_router(self) -> JaxPolicyRouter:
        """Itself: it already runs in the JAX rollout engine (`agents.rollout.jax_rule`)."""
        return self

    def reset(self, n_envs: int) -> None:
        """Restart the sampling key, so that a sampled episode is reproducible."""
        self._key = jax.random.key(self.seed)

    def __call__(self, obs: np.ndarray, mask: np.ndarray | None = None, view: Any = None) -> np.ndarray:
        """Actions for a batch of observations [B, D] (`mask` and `view` are not used: the policy
        was trained without masks, as SB3's PPO)."""
        obs = np.asarray(obs, dtype=np.float32)
        if obs.shape[-1:] != self.observation_shape:
            raise ValueError(
                f"observations of size {obs.shape[-1]} do not fit this {self.n_nodes}-node policy"
            )
        self._key, sub = jax.random.split(self._key)
        return np.asarray(self._act(self.params, self.stats, obs, sub, self.deterministic), dtype=np.int64)
