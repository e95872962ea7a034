"""LMetric: a product of a cache indicator and a load indicator, with no weights to tune.

Restated from Zhang et al., "LMetric: Simple is Better - Multiplication May Be All You Need for
LLM Request Scheduling" (arXiv:2603.15202v1, March 2026, OSDI '26): an instance's score is the
request's new prefill tokens if routed there (the prompt minus the prefix that instance has
cached) times the instance's current batch size; the lowest score wins. The batch size here is
the node's requests in flight (running and waiting); the cache is the engines' (the paper reads
the instances' KV-cache state).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import jax.numpy as jnp

from agents.routers.base import Affinity, argmin, outstanding, rotation


@dataclass(frozen=True)
class LMetric(Affinity):
    """score = (prompt - cached prefix) x requests in flight, the least wins; ties (an empty node
    scores 0 whatever it caches) to fewer new prefill tokens, then fewer requests, then a rotating
    offset."""

    name: ClassVar[str] = "lmetric"

    def decide(self, state, view, mask):
        new_tokens = jnp.maximum(view.prompt - self.matched(state, view), 0.0)
        load = outstanding(view)
        order = rotation(state.counter, mask.shape[0])
        node = argmin(new_tokens * load, mask, new_tokens, load, order=order)
        return node, self.routed(state, view, node)
