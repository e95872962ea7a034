"""vllm-router (vllm-project/router, forked from SGLang's gateway), `cache_aware` policy.

Restated from vllm-project/router `src/policies/cache_aware.rs` (stored commit 16917f49,
`select_worker_cache_aware_with_decision`: imbalance -> least load; balanced: longest match above
cache_threshold, else least load), with the defaults of the vllm-router 0.1.17 wheel's
`vllm_router/router_args.py` (cache_threshold 0.3, balance_abs_threshold 64,
balance_rel_threshold 1.5, eviction every 120 s, max_tree_size 2^25 characters per worker).
The decision rule is SGLang's current one; the two differ in their tree's eviction settings.
Checked decision by decision against the real 0.1.17 router (tests/test_real_routers.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from agents.routers.sglang_cache_aware import SGLangCacheAware


@dataclass(frozen=True)
class VllmRouter(SGLangCacheAware):
    """SGLang's current cache-aware rule with vllm-router 0.1.17's defaults."""

    name: ClassVar[str] = "vllm-router"  # its tree (2^25 characters per worker) is the same table
