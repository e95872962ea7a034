"""`lookahead`: an upper reference that routes with the simulator's knowledge of the future.

Never deployable: for each arriving request it forks the cluster once per candidate node and runs
the core's own step (`BurstBalance.batched_step_env`, one definition of the physics) on every fork,
with the true output lengths the router never sees. The fork routes the request to its node and the
episode is cut after it, so the step drains the cluster: every request already in it and the new
one run to completion with no further arrivals, and the step's reward is minus the objective that
accrues until then (their latency, drops, energy). The node whose fork costs least wins. With
`horizon=k` the next k arrivals follow in each fork, routed by `base` (any router of the rollout
engine), before the drain.

It is a greedy one-step policy with perfect information about the requests already routed, not
the optimum: it knows every output length, but judges each decision as if it were the last (or the
last but k), so it can lose to a router whose choices pay off later (filling a batching window,
letting a node sleep). The headroom table (`evaluation.headroom`) reports each router's gain
against it; where a router beats it, the table shows that too.

The candidates are vectorised: the N forks are one batch of the core's batched step, so their slot
width is chosen once for all of them (burstgym.env, "Slot widths"). In the rollout engine it runs
with `reads_state` (burstgym.rollout): `act` gets the cluster's whole `State`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, ClassVar

import jax
import jax.numpy as jnp

from agents.routers.base import RuleState, argmin, rotation
from burstgym.cluster import tree_where
from burstgym.env import BurstBalance
from burstgym.observation import RouterView, action_mask
from burstgym.types import EnvConfig, EnvParams, State


def forked_costs(
    core: BurstBalance, state: State, params: EnvParams, horizon: int = 0, base: Any = None
) -> jax.Array:
    """[N] the objective that accrues from now until the cluster is drained when the arriving request
    (`state.step`) goes to each node, then (with `horizon` k > 0) the next k arrivals are routed by
    `base` (each fork with its own router state from `base.init`). `core` must drain at the end of an
    episode (`end="drain"`); `state` and `params` are one cluster's."""
    if core.cfg.end != "drain":
        raise ValueError("forked_costs needs a core whose episodes end with a drain (end='drain')")
    if horizon < 0:
        raise ValueError(f"horizon must be >= 0, got {horizon}")
    if horizon > 0 and base is None:
        raise ValueError("a horizon beyond the arriving request needs a base router for the next arrivals")
    n = core.cfg.n_nodes
    forks = jax.tree.map(lambda x: jnp.broadcast_to(x, (n,) + x.shape), state)
    last = jnp.minimum(state.step + 1 + horizon, state.horizon).astype(jnp.int32)
    forks = forks._replace(horizon=jnp.broadcast_to(last, (n,)))
    _, forks, reward, _, _ = core.batched_step_env(forks, jnp.arange(n, dtype=jnp.int32), params)
    total = reward.astype(jnp.float32)
    if horizon > 0:
        rstates = jax.vmap(lambda s: base.init(n, jnp.uint32(0), s))(jnp.arange(n, dtype=jnp.uint32))

        def follow(carry, _):
            forks, rstates, total = carry
            live = forks.step < forks.horizon
            views = jax.vmap(core.view, in_axes=(0, None))(forks, params)
            masks = jax.vmap(action_mask)(views)
            actions, rstates = jax.vmap(base.act)(rstates, views, masks)
            _, stepped, reward, _, _ = core.batched_step_env(forks, actions, params)
            forks = tree_where(live, stepped, forks)
            return (forks, rstates, total + jnp.where(live, reward, 0.0)), None

        (forks, _, total), _ = jax.lax.scan(follow, (forks, rstates, total), None, length=horizon)
    return -total * params.reward_scale


@dataclass(frozen=True)
class Lookahead:
    """The `lookahead` bound for clusters of configuration `cfg` (any workload: the step never reads it).

    `horizon`: arrivals after this one simulated in each fork, routed by `base` (a hashable router
    of the rollout engine with `init` and `act(state, view, mask)`)."""

    cfg: EnvConfig
    horizon: int = 0
    base: Any = None
    name: str = "lookahead"
    seed: int = 0
    family: ClassVar[str] = "bound"
    reads_state: ClassVar[bool] = True  # burstgym.rollout passes the cluster's State and parameters
    deployable: ClassVar[bool] = False  # it reads the requests' output lengths

    def __post_init__(self) -> None:
        if self.horizon < 0:
            raise ValueError(f"lookahead horizon must be >= 0, got {self.horizon}")
        if self.horizon > 0 and self.base is None:
            raise ValueError("a lookahead horizon > 0 needs a base router for the arrivals it simulates")
        object.__setattr__(self, "cfg", dataclasses.replace(self.cfg, workload=None, end="drain"))

    @property
    def core(self) -> BurstBalance:
        """The core that simulates the forks (the configuration's, draining at the episode's end)."""
        return BurstBalance(self.cfg)

    def init(self, n_nodes: int, seed: Any = None, stream: Any = 0) -> RuleState:
        """A fresh episode's state (`agents.routers.base.RuleState`; the counter rotates ties)."""
        seed = self.seed if seed is None else seed
        key = jax.random.key(jnp.asarray(seed, jnp.uint32))
        key = jax.random.fold_in(key, jnp.asarray(stream, jnp.uint32))
        return RuleState(jnp.int32(0), jax.random.key_data(key), ())

    def costs(self, cluster_state: State, params: EnvParams) -> jax.Array:
        """[N] each candidate node's forked cost (`forked_costs`)."""
        return forked_costs(self.core, cluster_state, params, self.horizon, self.base)

    def act(
        self, state: RuleState, view: RouterView, mask: jax.Array, cluster_state: State, params: EnvParams
    ) -> tuple[jax.Array, RuleState]:
        """The allowed node whose fork costs least ([] int32); exact ties rotate with the counter."""
        cost = self.costs(cluster_state, params)
        mask = jnp.asarray(mask, bool)
        action = argmin(cost, mask, order=rotation(state.counter, mask.shape[0]))
        return action.astype(jnp.int32), state._replace(counter=state.counter + 1)
