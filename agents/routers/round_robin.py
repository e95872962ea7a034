"""Round-robin: everyone's default."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from agents.routers.base import Rule


@dataclass(frozen=True)
class RoundRobin(Rule):
    """Node `t mod N` for the t-th request of each episode; ignores the mask."""

    name: ClassVar[str] = "round-robin"
    family: ClassVar[str] = "balancing"

    def decide(self, state, view, mask):
        return state.counter % mask.shape[0], state
