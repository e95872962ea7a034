"""Join the shortest queue (Vidur's LOR, splitwise's JSQ)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from agents.routers.base import Rule, argmin, outstanding, rotation


@dataclass(frozen=True)
class LeastRequests(Rule):
    """Fewest running + waiting requests; ties to a rotating offset."""

    name: ClassVar[str] = "jsq"
    family: ClassVar[str] = "balancing"

    def decide(self, state, view, mask):
        return argmin(outstanding(view), mask, order=rotation(state.counter, mask.shape[0])), state
