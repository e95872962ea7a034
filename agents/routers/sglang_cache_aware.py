"""SGLang's router (now lightseekorg/smg, the SGLang model gateway), `cache_aware` policy.

Restated from smg `src/policies/cache_aware.rs` at commit c7f9bf9f5 ("[smg] release 0.3.2",
2026-01-15, the sglang-router 0.3.2 wheel), `CacheAwarePolicy::select_worker`, with the launcher
defaults of `bindings/python/src/sglang_router/router_args.py` at that commit (cache_threshold 0.3,
balance_abs_threshold 64, balance_rel_threshold 1.5). Load is the requests the router has in
flight on a worker (`Worker::load`). Checked decision by decision against the real router
(tests/test_real_routers.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import jax.numpy as jnp

from agents.routers.base import Affinity, argmin, first, outstanding
from agents.routers.index import IndexSpec


@dataclass(frozen=True)
class SGLangCacheAware(Affinity):
    """When the load is imbalanced (max - min > balance_abs and max > balance_rel x min, over
    every worker) the least loaded worker; otherwise the worker with the longest prefix match if
    its match rate (matched / prompt) exceeds cache_threshold, else the least loaded worker (since
    release 0.2.4: smg PR #14650). Ties go to the first worker in the router's order (Rust's
    `min_by_key`); among equally long matches the real router takes the tree node's first tenant,
    the first worker here."""

    name: ClassVar[str] = "sglang-cache-aware"
    # the router's approximate tree of the prompts it routed, inserted when it routes; its size
    # limit (max_tree_size 2^26 characters per worker, about 2^24 tokens) is not reached in
    # burstgym's episodes, which the table's 8192 chunks per node hold whole
    index: ClassVar[IndexSpec] = IndexSpec(capacity=8192)
    cache_threshold: float = 0.3
    balance_abs_threshold: float = 64.0
    balance_rel_threshold: float = 1.5

    def decide(self, state, view, mask):
        order = first(mask.shape[0])
        load = outstanding(view)
        lo, hi = load.min(), load.max()  # over every worker, healthy or not
        imbalanced = (hi - lo > self.balance_abs_threshold) & (hi > self.balance_rel_threshold * lo)
        hits = self.matched(state, view)
        best = argmin(-hits, mask, order=order)
        hit = hits[best] / jnp.maximum(view.prompt, 1.0) > self.cache_threshold
        least = argmin(load, mask, order=order)
        node = jnp.where(imbalanced, least, jnp.where(hit, best, self.on_miss(state, view, mask, least)))
        return node, self.routed(state, view, node)

    def on_miss(self, state, view, mask, least):
        """Where a request without a good match goes: the least loaded worker."""
        return least


@dataclass(frozen=True)
class SGLangCacheAwareV023(SGLangCacheAware):
    """The rule of sglang-router releases up to 0.2.3 (smg commit d47b1bf6f, "smg release 0.2.3",
    2025-11-14): as `sglang-cache-aware`, but a request whose best match is at or below
    cache_threshold goes to the worker with the smallest tree (`Tree::get_smallest_tenant`),
    whatever its load, which piles misses on one worker. Kept to measure what the fix changed."""

    name: ClassVar[str] = "sglang-cache-aware-v0.2.3"

    def on_miss(self, state, view, mask, least):
        return argmin(self.tree_size(state, view), mask, order=first(mask.shape[0]))
