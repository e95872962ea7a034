"""Least KV-cache utilisation (llm-d / AIBrix KV-cache scorers)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from agents.routers.base import Rule, argmin, outstanding, rotation


@dataclass(frozen=True)
class LeastKV(Rule):
    """Lowest KV-cache utilisation, then fewest requests; ties to a rotating offset."""

    name: ClassVar[str] = "least-kv"
    family: ClassVar[str] = "balancing"

    def decide(self, state, view, mask):
        order = rotation(state.counter, mask.shape[0])
        return argmin(view.kv_util, mask, outstanding(view), order=order), state
