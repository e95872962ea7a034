"""Join the forming batch that launches soonest (batching windows: Triton's dynamic batcher)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import jax.numpy as jnp

from agents.routers.base import Rule, argmin, outstanding, rotation
from burstgym.types import IDLE


@dataclass(frozen=True)
class SoonestBatch(Rule):
    """Among idle nodes with waiting requests (a forming batch), the one whose oldest waiting
    request has waited longest, then the most waiting; when no idle node has a forming batch, the
    node with fewest requests. Without a batching window it is join-the-shortest-queue, so it
    takes part in its family under dynamic batching only."""

    name: ClassVar[str] = "soonest-batch"
    family: ClassVar[str] = "batching"
    schedulers: ClassVar[tuple[str, ...]] = ("dynamic",)

    def decide(self, state, view, mask):
        order = rotation(state.counter, mask.shape[0])
        forming = (view.phase == IDLE) & (view.waiting > 0) & mask
        join = argmin(-view.window_age, forming, -view.waiting, order=order)
        spread = argmin(outstanding(view), mask, order=order)
        return jnp.where(forming.any(), join, spread), state
