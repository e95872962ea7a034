"""The endpoint picker's built-in scheduling profile (Gateway API Inference Extension, used by
llm-d's router when no plugin configuration is given).

Restated from llm-d/llm-d-inference-scheduler `pkg/epp/config/loader/defaults.go`
(`loadDefaultConfig`, commit 520af478, 2026-05-17; the same weights as
kubernetes-sigs/gateway-api-inference-extension's inferencepool chart): queue-scorer 2,
kv-cache-utilization-scorer 2, prefix-cache-scorer 3, max-score picker. Scorers:
`scorer/queuedepth/queue.go` (max - q) / (max - min) over the waiting queues, 1 when they are
equal; `scorer/kvcacheutilization` 1 - KV usage; `scorer/prefix` matched blocks / prompt blocks;
`picker/maxscore/picker.go` the highest score, ties at random.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import jax.numpy as jnp

from agents.routers.base import Affinity, argmin
from agents.routers.index import IndexSpec


@dataclass(frozen=True)
class EPPDefault(Affinity):
    """score = 3 x prefix + 2 x (1 - KV usage) + 2 x queue; the highest wins, ties at random."""

    name: ClassVar[str] = "epp-default"
    # prefix-cache-scorer: its own LRU index of the routed prompts' blocks per endpoint, sized to
    # the endpoint's KV cache
    index: ClassVar[IndexSpec] = IndexSpec(capacity=8192, kv_limited=True)
    weights: tuple[float, float, float] = (3.0, 2.0, 2.0)  # prefix, kv-cache, queue

    def decide(self, state, view, mask):
        dtype = view.hit_tokens.dtype
        block = jnp.maximum(view.block_size, 1).astype(dtype)
        total = jnp.maximum(jnp.ceil(view.prompt / block), 1.0)
        prefix = jnp.floor(self.matched(state, view) / block) / total
        kv = 1.0 - view.kv_util
        q = jnp.where(mask, view.waiting, jnp.nan)
        qmax, qmin = jnp.nanmax(q), jnp.nanmin(q)
        spread = qmax - qmin
        queue = jnp.where(spread > 0, (qmax - view.waiting) / jnp.where(spread > 0, spread, 1.0), 1.0)
        wp, wk, wq = self.weights
        score = wp * prefix + wk * kv + wq * queue
        order, state = self.random_order(state, mask.shape[0])
        node = argmin(-score, mask, order=order)
        return node, self.routed(state, view, node)
