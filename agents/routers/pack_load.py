"""Bin packing (AIBrix slo-pack-load)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import jax.numpy as jnp

from agents.routers.base import Rule, argmin, outstanding, rotation


@dataclass(frozen=True)
class PackLoad(Rule):
    """The busiest node (most outstanding requests) still under the cap `kv_util < kv_cap` with at
    most `max_waiting` waiting requests; when no node is under the cap, the least loaded node. The
    cap is on KV usage and the queue, the two signals vLLM exports, rather than on a running limit
    a router cannot read."""

    name: ClassVar[str] = "pack-load"
    family: ClassVar[str] = "batching"
    kv_cap: float = 0.9
    max_waiting: int = 2

    def decide(self, state, view, mask):
        order = rotation(state.counter, mask.shape[0])
        load = outstanding(view)
        under = (view.kv_util < self.kv_cap) & (view.waiting <= self.max_waiting) & mask
        pack = argmin(-load, under, order=order)
        spread = argmin(load, mask, order=order)
        return jnp.where(under.any(), pack, spread), state
