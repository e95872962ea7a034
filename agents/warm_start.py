"""The warm start both learners use: behaviour cloning of a router (one of `TEACHERS`) by the shared network
(`agents.model`) on that router's rollouts. Each learner collects the rollouts its own way (SB3's
on its vector env, `agents.learners.collect_teacher`; the JAX learner inside its jitted clusters,
`agents.jax_ppo.JaxPPO.warm_start`) into a `TeacherData`; `fit` is the one fit, in JAX, of the
network's parameters, which either learner then holds."""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from agents import model
from agents.routers import ROUTERS, SCENARIO_ROUTERS, scenario_rule
from burstgym.types import EnvConfig, EnvParams

# What `--bc-teacher` accepts: the model-based router (the default: in docs/headroom.md's table it
# reaches the lookahead bound's gain within the CIs wherever that gain is resolved but under the
# batching window) and every rule of agents.routers.
# `lookahead` (the bound, agents/lookahead.py: it reads the cluster's state and the true output
# lengths) teaches the JAX learner only, which collects inside the jitted clusters.
TEACHERS = (*SCENARIO_ROUTERS, "lookahead", *ROUTERS)


def teacher(name: str, cfg: EnvConfig, params: EnvParams) -> Any:
    """The router called `name` (one of `TEACHERS`) for the scenario `cfg`, `params`."""
    if name == "lookahead":
        from agents.lookahead import Lookahead

        return Lookahead(cfg)
    return scenario_rule(name, cfg, params)


BC_EPOCHS, BC_BATCH, BC_LR = 20, 256, 1e-3  # docs/agents.md, "Training set-up"


class TeacherData(NamedTuple):
    """A heuristic's rollout on B clusters, time-major ([T, B, ...]), observations as the network
    reads them (normalised where the learner normalises)."""

    obs: Any  # [T, B, D]
    actions: Any  # [T, B] the teacher's nodes
    rewards: Any  # [T, B] (unnormalised)
    dones: Any  # [T, B] the episode ended at this step
    truncated: Any  # [T, B] ... by truncation: bootstrap from terminal_obs
    terminal_obs: Any  # [T, B, D] the final observation where truncated (anything elsewhere)
    last_obs: Any  # [B, D] the observation after the last step


def returns(
    rewards: jax.Array, dones: jax.Array, bootstrap: jax.Array, last_value: jax.Array, gamma: float
) -> jax.Array:
    """Discounted returns [T, B] of a rollout: `bootstrap[t]` is added (discounted) where an episode
    ended at step t (0 for a termination, the final observation's value for a truncation),
    `last_value` continues the episodes still running at the end."""

    def back(future: jax.Array, xs: tuple[jax.Array, ...]) -> tuple[jax.Array, jax.Array]:
        r, d, b = xs
        g = r + gamma * jnp.where(d, b, future)
        return g, g

    return jax.lax.scan(back, last_value, (rewards, dones, bootstrap), reverse=True)[1]


def fit(
    params: model.Params,
    data: TeacherData,
    gamma: float,
    key: jax.Array,
    epochs: int = BC_EPOCHS,
    batch_size: int = BC_BATCH,
    lr: float = BC_LR,
) -> tuple[dict[str, Any], dict[str, float]]:
    """Fit the actor (cross-entropy on the teacher's actions) and the critic (squared error to the
    discounted returns, bootstrapped from the critic where the data stop before the episode does,
    recomputed every epoch) to `data`: `epochs` passes of shuffled minibatches of `batch_size`
    (the last partial one left out) with Adam at `lr`.

    Returns the fitted parameters (jax arrays) and {"agreement": fraction of the teacher's actions
    the actor takes (argmax), "value_explained_variance": the critic's explained variance of the
    returns (as SB3's `train/explained_variance`, on the imitation data),
    "value_explained_variance_initial": the same before the fit, "samples": the number of
    observations}."""

    def f32(x: Any) -> jax.Array:
        return jnp.asarray(x, jnp.float32)

    arrays = TeacherData(
        f32(data.obs),
        jnp.asarray(data.actions, jnp.int32),
        f32(data.rewards),
        jnp.asarray(data.dones, bool),
        jnp.asarray(data.truncated, bool),
        f32(data.terminal_obs),
        f32(data.last_obs),
    )
    samples = int(np.prod(np.shape(data.actions)))
    size = min(batch_size, samples)
    params = jax.tree.map(f32, params)
    fitted, out = _fit(params, arrays, jnp.float32(gamma), key, epochs, size, lr)
    return fitted, {**{k: float(v) for k, v in jax.device_get(out).items()}, "samples": samples}


@functools.partial(jax.jit, static_argnames=("epochs", "size", "lr"))
def _fit(params, data: TeacherData, gamma, key, epochs: int, size: int, lr: float):
    tx = optax.adam(lr)
    m = data.actions.size
    x = data.obs.reshape(m, -1)
    y = data.actions.reshape(-1)
    n_batches = m // size

    def targets(params):
        boot = jnp.where(data.truncated, model.value(params, data.terminal_obs), 0.0)
        last = model.value(params, data.last_obs)
        return returns(data.rewards, data.dones, boot, last, gamma).reshape(-1)

    def loss(params, idx, g):
        logits, value = model.forward(params, x[idx])
        ce = -jnp.take_along_axis(jax.nn.log_softmax(logits), y[idx][:, None], axis=-1).mean()
        return ce + ((value - g[idx]) ** 2).mean()

    def epoch(carry, k):
        g = jax.lax.stop_gradient(targets(carry[0]))
        perm = jax.random.permutation(k, m)[: n_batches * size].reshape(n_batches, size)

        def minibatch(c, idx):
            params, opt = c
            updates, opt = tx.update(jax.grad(loss)(params, idx, g), opt, params)
            return (optax.apply_updates(params, updates), opt), None

        return jax.lax.scan(minibatch, carry, perm)[0], None

    def explained_variance(params):
        g = targets(params)
        return 1 - (g - model.value(params, x)).var() / g.var()

    ev0 = explained_variance(params)
    params, _ = jax.lax.scan(epoch, (params, tx.init(params)), jax.random.split(key, epochs))[0]
    agree = (jnp.argmax(model.logits(params, x), axis=-1) == y).mean()
    return params, {
        "agreement": agree,
        "value_explained_variance": explained_variance(params),
        "value_explained_variance_initial": ev0,
    }
