"""Least outstanding tokens (llm-d / AIBrix token-load scorers)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from agents.routers.base import Rule, argmin, outstanding, rotation


@dataclass(frozen=True)
class LeastTokens(Rule):
    """Fewest prompt tokens still to prefill (the only outstanding tokens a router can see: output
    lengths are hidden), then fewest requests; ties to a rotating offset."""

    name: ClassVar[str] = "least-tokens"
    family: ClassVar[str] = "balancing"

    def decide(self, state, view, mask):
        order = rotation(state.counter, mask.shape[0])
        return argmin(view.prefill_tokens, mask, outstanding(view), order=order), state
