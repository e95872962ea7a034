"""The vLLM production stack's prefix-aware routing (`--routing-logic prefixaware`).

Restated from vllm-project/production-stack `src/vllm_router/routers/routing_logic.py`
`PrefixAwareRouter` and `src/vllm_router/prefix/hashtrie.py` (commit a6c01db0, 2026-08-05;
chart vllm-stack-0.1.12): the router keeps a trie of hashed 128-character chunks of the prompts
it routed, inserted at routing time and never evicted; a request goes to an endpoint chosen at
random among those holding its longest matched prefix (every endpoint when nothing matches;
`prefix_min_match_length` 0 by default). The rule never looks at load.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from agents.routers.base import Affinity, argmin
from agents.routers.index import IndexSpec


@dataclass(frozen=True)
class PrefixAware(Affinity):
    """A node at random among the allowed nodes with the longest prefix match (every allowed
    node when no node matches)."""

    name: ClassVar[str] = "prefix-aware"
    index: ClassVar[IndexSpec] = IndexSpec(capacity=8192)  # a trie of routed prompts, never evicted

    def decide(self, state, view, mask):
        order, state = self.random_order(state, mask.shape[0])
        node = argmin(-self.matched(state, view), mask, order=order)
        return node, self.routed(state, view, node)
