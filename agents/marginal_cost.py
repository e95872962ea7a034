"""`marginal-cost`: send each request where it adds the least predicted latency (a model-based router).

A deployable router: it reads only the `RouterView` and what it is configured with about the nodes
(`burstgym.prediction.NodeModel`: latency profile, speed, batch limits), the workload's lengths
(`LengthStats`) and the objective's weights. `burstgym.prediction.estimate` predicts, for every
node, the arriving request's TTFT and end-to-end latency there and the latency it adds to the
requests already there (the model and its physics are documented there); the node whose predicted
increase of the objective is least wins, exact ties rotating.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from agents.routers.base import RuleState, argmin, rotation
from burstgym.observation import RouterView
from burstgym.prediction import Estimate, NodeModel, Weights, estimate, node_model, weights_of
from burstgym.types import EnvConfig, EnvParams, LengthStats
from burstgym.workload.base import digest


@dataclass(frozen=True, eq=False)
class MarginalCost:
    """The `marginal-cost` router for one scenario's nodes and workload (`for_scenario`).

    A router of the rollout engine (`burstgym.routing`: `init`, `act` over one cluster's view; its
    batched NumPy face is `agents.routers.BatchedRouter(router, n_nodes)`). Hashes by its
    configuration's content."""

    nodes: NodeModel
    lengths: LengthStats
    weights: Weights
    scheduler: str = "continuous"
    padding: bool = True
    name: str = "marginal-cost"
    seed: int = 0
    family: ClassVar[str] = "model-based"

    @classmethod
    def for_scenario(cls, cfg: EnvConfig, params: EnvParams, **kwargs: Any) -> MarginalCost:
        """The router configured with the scenario's nodes, workload lengths and objective weights."""
        return cls(
            nodes=jax.tree.map(np.asarray, node_model(params)),
            lengths=jax.tree.map(np.asarray, params.lengths),
            weights=jax.tree.map(np.asarray, weights_of(params)),
            scheduler=cfg.scheduler,
            padding=cfg.padding,
            **kwargs,
        )

    def _key(self) -> tuple:
        arrays = jax.tree.leaves((self.nodes, self.lengths, self.weights))
        return (
            type(self),
            digest(*(np.asarray(a) for a in arrays)),
            self.scheduler,
            self.padding,
            self.name,
            self.seed,
        )

    def __hash__(self) -> int:
        return hash(self._key())

    def __eq__(self, other: object) -> bool:
        return isinstance(other, MarginalCost) and self._key() == other._key()

    def replace(self, **changes: Any) -> MarginalCost:
        """A copy with `changes` (dataclasses.replace)."""
        return dataclasses.replace(self, **changes)

    def init(self, n_nodes: int, seed: Any = None, stream: Any = 0) -> RuleState:
        """A fresh episode's state (`agents.routers.base.RuleState`; the counter rotates ties)."""
        seed = self.seed if seed is None else seed
        key = jax.random.fold_in(
            jax.random.key(jnp.asarray(seed, jnp.uint32)), jnp.asarray(stream, jnp.uint32)
        )
        return RuleState(jnp.int32(0), jax.random.key_data(key), ())

    def estimate(self, view: RouterView) -> Estimate:
        """`estimate` with this router's configuration."""
        arrays = jax.tree.map(jnp.asarray, (self.nodes, self.lengths, self.weights))
        return estimate(view, *arrays, scheduler=self.scheduler, padding=self.padding)

    def act(self, state: RuleState, view: RouterView, mask: jax.Array) -> tuple[jax.Array, RuleState]:
        """The allowed node of least predicted cost ([] int32); exact ties rotate with the counter."""
        cost = self.estimate(view).cost
        mask = jnp.asarray(mask, bool)
        action = argmin(cost, mask, order=rotation(state.counter, mask.shape[0]))
        return action.astype(jnp.int32), state._replace(counter=state.counter + 1)
