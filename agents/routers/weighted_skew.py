"""The claim's own recipe: a fixed weighted skew."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import jax.numpy as jnp

from agents.routers.base import Rule


@dataclass(frozen=True)
class WeightedSkew(Rule):
    """Node 0 gets 10% more traffic than each other node (weights 11 : 10 : ... : 10, i.e. 11 of
    every 10N + 1 requests), dealt deterministically by smooth weighted round-robin (nginx) with
    an integer credit per node; ignores the mask."""

    name: ClassVar[str] = "weighted-skew"
    family: ClassVar[str] = "batching"

    def init_extra(self, n_nodes):
        return jnp.zeros(n_nodes, jnp.int32)  # the credit

    def decide(self, state, view, mask):
        n = mask.shape[0]
        weights = jnp.full(n, 10, jnp.int32).at[0].set(11)
        credit = state.extra + weights
        pick = jnp.argmax(credit)
        return pick, state._replace(extra=credit.at[pick].add(-weights.sum()))
