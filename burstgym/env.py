"""BurstBalance: the functional environment (gymnax / Jumanji style).

One step routes one arriving request to one of N nodes; simulated time then advances to the next
arrival while every node runs its scheduler. State and parameters are pytrees, `step_env` is
pure and jittable, and `batched_step` runs many clusters in one jitted call with auto-reset
inside jit (the reset branch is a `lax.cond` taken only when an episode ends).

- Observation: `burstgym.observation` (float32 vector, every field documented there).
- Action: the index of the node that receives the arriving request.
- Reward: `burstgym.reward` (minus the objective accrued in the step).
- Episode: `episode_length` arrivals; the last step drains every accepted request, so each
  request's full latency is in the episode (the step returns `done`, a truncation in Gymnasium).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from burstgym import cluster
from burstgym.metrics import episode_metrics
from burstgym.observation import observe
from burstgym.reward import slo_met, step_reward
from burstgym.types import EMPTY, IDLE, NO_REQUEST, EnvConfig, EnvParams, NodeState, RequestLog, Slots, State


class BurstBalance:
    """The functional environment: pure functions of (state, action, params) for one cluster."""

    def __init__(self, cfg: EnvConfig):
        self.cfg = cfg

    def reset(self, key: jax.Array, params: EnvParams) -> tuple[jax.Array, State]:
        """Draw a request stream and return the first observation and the initial state."""
        cfg = self.cfg
        key, sub = jax.random.split(key)
        req = cfg.workload.sample(sub, cfg.episode_length)
        n, s, e = cfg.n_nodes, cfg.slots, cfg.episode_length
        fdt = req.arrival.dtype
        t0 = req.arrival[0]
        zi = jnp.zeros((n, s), jnp.int32)
        slots = Slots(
            req=jnp.full((n, s), NO_REQUEST, jnp.int32),
            status=jnp.full((n, s), EMPTY, jnp.int32),
            arrival=jnp.zeros((n, s), fdt),
            prompt=zi,
            output=zi,
            computed=zi,
            generated=zi,
            sched=zi,
        )
        zf = jnp.zeros(n, fdt)
        nodes = NodeState(
            phase=jnp.full(n, IDLE, jnp.int32),
            iter_end=zf,
            repeat=jnp.ones(n, jnp.int32),
            wake_end=zf,
            idle_since=zf + t0,
            last_time=zf + t0,
            energy_j=zf,
            busy_s=zf,
            routed=jnp.zeros(n, jnp.int32),
        )
        log = RequestLog(
            node=jnp.full(e, -1, jnp.int32),
            dropped=jnp.zeros(e, bool),
            first_token=jnp.full(e, jnp.nan, fdt),
            finish=jnp.full(e, jnp.nan, fdt),
            preemptions=jnp.zeros(e, jnp.int32),
        )
        state = State(
            key=key,
            requests=req,
            step=jnp.int32(0),
            time=t0,
            t_end=jnp.asarray(jnp.nan, fdt),
            rate_estimate=1.0 / params.rate_window.astype(fdt),
            slots=slots,
            nodes=nodes,
            log=log,
        )
        return observe(state, params, cfg), state

    def step_env(
        self, state: State, action: jax.Array, params: EnvParams
    ) -> tuple[jax.Array, State, jax.Array, jax.Array, dict[str, jax.Array]]:
        """Route request `state.step` to node `action` and advance to the next arrival.

        Returns (observation, state, reward, done, info). Out-of-range actions are the caller's
        to refuse (the Gymnasium faces do); here they are clipped so jit stays total.
        """
        cfg = self.cfg
        req = state.requests
        k = state.step
        node = jnp.clip(action, 0, cfg.n_nodes - 1).astype(jnp.int32)
        r = cluster.route(
            state.slots, state.nodes, state.log, k, req.arrival[k], req.prompt[k], req.output[k], node, params
        )
        last = k == cfg.episode_length - 1
        nxt = jnp.minimum(k + 1, cfg.episode_length - 1)
        t_next = jnp.where(last, jnp.inf, req.arrival[nxt])
        zero = jnp.zeros(cfg.n_nodes, state.time.dtype)
        acc = cluster.Accrual(latency_s=zero, energy_j=zero)
        slots, nodes, log, acc = cluster.advance(r.slots, r.nodes, r.log, acc, t_next, last, params, cfg)
        t_end = jnp.where(last, jnp.maximum(state.time, nodes.last_time.max()), jnp.nan)
        until = jnp.where(last, t_end, t_next)
        slots, nodes, log, acc = cluster.advance(slots, nodes, log, acc, until, jnp.bool_(False), params, cfg)
        everyone = jnp.ones(cfg.n_nodes, bool)
        nodes, acc = cluster.accrue(slots, nodes, acc, jnp.full(cfg.n_nodes, until), everyone, params)

        met_now = jnp.int32(0)
        if cfg.objective == "slo":
            met_now = slo_met(req, log, params).sum() - slo_met(req, state.log, params).sum()
        reward = step_reward(acc, r.dropped, met_now, cfg.objective, params)

        gap = jnp.where(last, 0.0, req.arrival[nxt] - req.arrival[k])
        rate = state.rate_estimate * jnp.exp(-gap / params.rate_window) + jnp.where(
            last, 0.0, 1.0 / params.rate_window
        )
        new = state._replace(
            step=k + 1,
            time=jnp.where(last, t_end, t_next),
            t_end=t_end,
            rate_estimate=rate,
            slots=slots,
            nodes=nodes,
            log=log,
        )
        info = {"dropped": r.dropped, "action_mask": self.action_mask(new, params)}
        return observe(new, params, cfg), new, reward, last, info

    def action_mask(self, state: State, params: EnvParams) -> jax.Array:
        """[N] bool: nodes that would accept the next request; all True when every node would drop."""
        ok = ~cluster.would_drop(state.slots, params)
        return jnp.where(ok.any(), ok, True)

    def metrics(self, state: State, params: EnvParams) -> dict[str, jax.Array]:
        """Episode metrics of a finished episode (see `burstgym.metrics`)."""
        return episode_metrics(
            state.requests, state.log, state.nodes.energy_j, state.nodes.routed, state.t_end, params
        )

    def step(
        self, state: State, action: jax.Array, params: EnvParams
    ) -> tuple[jax.Array, State, jax.Array, jax.Array, dict[str, Any]]:
        """`step_env` with auto-reset: when the episode ends the returned state and observation
        are those of a new episode (drawn with `state.key`); the info carries `final_obs` and
        the finished episode's `metrics`."""
        obs, new, reward, done, info = self.step_env(state, action, params)

        def restart(_):
            o, s = self.reset(new.key, params)
            return o, s, self.metrics(new, params)

        def carry_on(_):
            return obs, new, jax.tree.map(jnp.zeros_like, jax.eval_shape(lambda: self.metrics(new, params)))

        obs2, state2, metrics = jax.lax.cond(done, restart, carry_on, None)
        mask = jnp.where(done, self.action_mask(state2, params), info["action_mask"])
        info = {**info, "action_mask": mask, "final_obs": obs, "metrics": metrics}
        return obs2, state2, reward, done, info

    def batched_reset(self, keys: jax.Array, params: EnvParams) -> tuple[jax.Array, State]:
        """Reset a batch of clusters, one key each (shared parameters)."""
        return jax.vmap(self.reset, in_axes=(0, None))(keys, params)

    def batched_step(
        self, states: State, actions: jax.Array, params: EnvParams
    ) -> tuple[jax.Array, State, jax.Array, jax.Array, dict[str, Any]]:
        """Step a batch of clusters; clusters whose episode ended are reset inside the same call.

        The reset (and the finished episodes' metrics) sit behind one `lax.cond` on "any episode
        ended", so ordinary steps pay nothing for them.
        """
        obs, new, reward, done, info = jax.vmap(self.step_env, in_axes=(0, 0, None))(states, actions, params)
        metric_shape = jax.eval_shape(lambda s: jax.vmap(self.metrics, in_axes=(0, None))(s, params), new)

        def restart(_):
            metrics = jax.vmap(self.metrics, in_axes=(0, None))(new, params)
            o, s = self.batched_reset(new.key, params)
            s = cluster.tree_where(done, s, new)
            o = jnp.where(done[:, None], o, obs)
            mask = jax.vmap(self.action_mask, in_axes=(0, None))(s, params)
            return o, s, metrics, mask

        def carry_on(_):
            zeros = jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), metric_shape)
            return obs, new, zeros, info["action_mask"]

        obs2, states2, metrics, mask = jax.lax.cond(done.any(), restart, carry_on, None)
        info = {**info, "action_mask": mask, "final_obs": obs, "metrics": metrics}
        return obs2, states2, reward, done, info
