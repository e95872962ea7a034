"""AIBrix gateway, `least-request` routing strategy.

Restated from vllm-project/aibrix v0.7.0 (commit c5465890),
`pkg/plugins/gateway/algorithms/least_request.go` (`Route`: the pod with the fewest requests the
gateway has in flight, ties at random).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from agents.routers.base import Rule, argmin, outstanding


@dataclass(frozen=True)
class AIBrixLeastRequest(Rule):
    """The node with the fewest requests in flight, ties at random."""

    name: ClassVar[str] = "aibrix-least-request"
    family: ClassVar[str] = "balancing"

    def decide(self, state, view, mask):
        order, state = self.random_order(state, mask.shape[0])
        return argmin(outstanding(view), mask, order=order), state
