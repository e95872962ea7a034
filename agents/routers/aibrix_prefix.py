"""AIBrix gateway, `prefix-cache` routing strategy.

Restated from vllm-project/aibrix v0.7.0 (commit c5465890, 2026-06-17),
`pkg/plugins/gateway/algorithms/prefix_cache.go` (`routeOriginal`,
`getTargetPodListOnLoadImbalance`, `getTargetPodFromMatchedPods`; defaults
`podRunningRequestImbalanceAbsCount` 8, `standardDeviationFactor` 1) and `util.go`
(`standardDeviation`: the sample standard deviation). A pod's request count is the gateway's
real-time count of its requests in flight (`least_request.go` `getRequestCounts`). The prefix
index (`pkg/utils/prefixcacheindexer/hash.go`) holds hashes of blocks of the prompts the gateway
routed, evicted 20 minutes after their last use.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import jax.numpy as jnp

from agents.routers.base import Affinity, argmin, outstanding
from agents.routers.index import IndexSpec


@dataclass(frozen=True)
class AIBrixPrefix(Affinity):
    """Imbalanced (max - min requests in flight > 8): the candidates are the pods with the fewest;
    otherwise every pod. Among candidates with a prefix match, by decreasing match percentage
    then increasing count (ties at random), the first whose count is at most mean + 1 sample
    standard deviation of all pods' counts; no such pod: the pod with the fewest requests (ties
    at random)."""

    name: ClassVar[str] = "aibrix-prefix"
    # prefixcacheindexer: one table of block hashes -> pods for every pod, 200000 blocks of 4
    # characters (about 200000 tokens at 4 characters per token), LRU, 20 minutes unused
    index: ClassVar[IndexSpec] = IndexSpec(capacity=8192, shared=True, token_limit=200_000.0, ttl_s=1200.0)
    imbalance_abs_count: float = 8.0
    std_factor: float = 1.0

    def decide(self, state, view, mask):
        n = mask.shape[0]
        count = outstanding(view)
        c = jnp.where(mask, count, jnp.nan)
        lo, hi = jnp.nanmin(c), jnp.nanmax(c)
        candidates = jnp.where(hi - lo > self.imbalance_abs_count, mask & (count == lo), mask)
        k = jnp.maximum(mask.sum(), 1).astype(count.dtype)
        mean = jnp.where(mask, count, 0.0).sum() / k
        var = jnp.where(mask, (count - mean) ** 2, 0.0).sum() / jnp.maximum(k - 1, 1)
        percent = jnp.floor(100.0 * self.matched(state, view) / jnp.maximum(view.prompt, 1.0))
        calm = candidates & (percent > 0) & (count <= mean + self.std_factor * jnp.sqrt(var))
        order, state = self.random_order(state, n)
        best = argmin(-percent, calm, count, order=order)
        fewest = argmin(count, mask, order=order)
        node = jnp.where(calm.any(), best, fewest)
        return node, self.routed(state, view, node)
