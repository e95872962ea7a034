"""NVIDIA Dynamo's KV router, default worker selector.

Restated from ai-dynamo/dynamo: the cost and selection of `DefaultWorkerSelector` (lib/kv-router
`scheduler` module: `logit = overlap_score_weight x potential_prefill_blocks + decode_blocks`,
`softmax_sample` over the logits normalised by their range, the lowest logit at temperature 0
with ties to the smallest tree) and the flags of docs/router/router_guide.md (stored commit
8f6af06, the router of releases 0.7 to 1.0): `--kv-overlap-score-weight` 1, `--router-temperature`
0, `--active-decode-blocks-threshold` and `--active-prefill-tokens-threshold` unset (a worker above
either is busy and excluded; when every worker is busy Dynamo rejects the request, HTTP 503/529,
docs.nvidia.com/dynamo v1.0 "Request Rejection"). Its cache index follows the engines' KV events
by default, which is the engines' exact cache (`RouterView.hit_tokens`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import jax
import jax.numpy as jnp

from agents.routers.base import Affinity, argmin, rotation


@dataclass(frozen=True)
class DynamoKV(Affinity):
    """cost = overlap_score_weight x (prefill tokens queued on the worker + the request's uncached
    tokens) / block + (the worker's active blocks + the request's blocks). Temperature 0: the
    least cost, ties to the smallest tree, then an arbitrary worker (a rotating offset here);
    temperature > 0: a worker drawn with probability softmax(-cost / (range x temperature)) over
    the allowed workers (uniform when every cost is equal). A worker whose KV usage exceeds
    `busy_kv_fraction` or whose queued prefill exceeds `busy_prefill_tokens` is excluded (None:
    off, the default); when every worker is busy the request is routed by cost among all (Dynamo
    rejects it). Every block of the request counts as a new decode block (the view does not tell
    a node's active blocks from its idle cached ones)."""

    name: ClassVar[str] = "dynamo-kv"
    overlap_score_weight: float = 1.0
    temperature: float = 0.0
    busy_kv_fraction: float | None = None
    busy_prefill_tokens: float | None = None

    def decide(self, state, view, mask):
        dtype = view.prefill_tokens.dtype
        block = jnp.maximum(view.block_size, 1).astype(dtype)
        uncached = jnp.maximum(view.prompt - self.matched(state, view), 0.0)
        prefill_blocks = (view.prefill_tokens + uncached) / block
        decode_blocks = view.kv_used + jnp.ceil(view.prompt / block)
        cost = self.overlap_score_weight * prefill_blocks + decode_blocks
        free = mask
        if self.busy_kv_fraction is not None:
            free = free & (view.kv_util <= self.busy_kv_fraction)
        if self.busy_prefill_tokens is not None:
            free = free & (view.prefill_tokens <= self.busy_prefill_tokens)
        allowed = jnp.where(free.any(), free, mask)
        if self.temperature > 0:
            c = jnp.where(allowed, cost, jnp.nan)
            lo, hi = jnp.nanmin(c), jnp.nanmax(c)
            span = jnp.where(hi > lo, hi - lo, 1.0)
            logits = jnp.where(allowed, -(cost - lo) / (span * self.temperature), -jnp.inf)
            sub, state = self.draw(state)
            node = jax.random.categorical(sub, logits)
        else:
            order = rotation(state.counter, mask.shape[0])
            node = argmin(cost, allowed, self.tree_size(state, view), order=order)
        return node, self.routed(state, view, node)
