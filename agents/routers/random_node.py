"""Random: the other universal baseline."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import jax

from agents.routers.base import Rule


@dataclass(frozen=True)
class Random(Rule):
    """A uniformly random node (JAX's PRNG, a key per episode); ignores the mask."""

    name: ClassVar[str] = "random"
    family: ClassVar[str] = "balancing"

    def decide(self, state, view, mask):
        sub, state = self.draw(state)
        return jax.random.randint(sub, (), 0, mask.shape[0]), state
