"""Power of two choices (Ray Serve; Mitzenmacher 2001)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import jax
import jax.numpy as jnp

from agents.routers.base import Rule, argmin, outstanding, rotation


@dataclass(frozen=True)
class PowerOfTwo(Rule):
    """Two distinct nodes uniformly at random (the first uniform, the second uniform among the
    others), the one with fewer requests; both full: any allowed node."""

    name: ClassVar[str] = "power-of-two"
    family: ClassVar[str] = "balancing"

    def decide(self, state, view, mask):
        n = mask.shape[0]
        sub, state = self.draw(state)
        k1, k2 = jax.random.split(sub)
        first = jax.random.randint(k1, (), 0, n)
        second = (first + jax.random.randint(k2, (), 1, n)) % n if n > 1 else first
        nodes = jnp.arange(n)
        allowed = ((nodes == first) | (nodes == second)) & mask
        allowed = jnp.where(allowed.any(), allowed, mask)
        return argmin(outstanding(view), allowed, order=rotation(state.counter, n)), state
