"""The routing rules of production LLM routers, reproduced on `RouterView` (natural units).

Each rule is restated from the router's source; the view gives every router the same exact,
current prefix index (`hit_tokens`, `cached_tokens`), where the real routers approximate it
(SGLang: a radix tree of the prompts it routed; Dynamo: KV events from the engines; llm-d and
AIBrix: their own prefix indexes), and load signals as fresh as `signal_interval` allows. The
thresholds are each project's defaults; like the heuristics, a router never picks a node the
action mask marks as full unless every node is.
"""

from __future__ import annotations

import bisect
import hashlib

import numpy as np

from agents.heuristics import Router
from burstgym.observation import RouterView


def _match_rate(view: RouterView) -> np.ndarray:
    """[B, N] fraction of the arriving prompt each node holds in its prefix cache."""
    return view.hit_tokens / np.maximum(view.prompt[:, None], 1.0)


class SGLangCacheAware(Router):
    """SGLang router `cache_aware` policy (sgl-project/sglang, sgl-router/src/policies/
    cache_aware.rs at commit 026f853; router defaults cache_threshold 0.3, balance_abs_threshold
    64, balance_rel_threshold 1.5; older releases used 0.5 / 32 / 1.0001). Load is the
    requests the router has in flight on a worker.
    When the load is imbalanced (max - min > abs and max > rel * min) the request goes to the
    least loaded worker; otherwise to the worker with the longest prefix match if its match rate
    exceeds cache_threshold, else to the worker with the smallest tree (least cached)."""

    name = "sglang-cache-aware"
    balancing = False
    cache_threshold = 0.3
    balance_abs = 64.0
    balance_rel = 1.5

    def act(self, view, mask):
        load = self.outstanding(view)
        lo, hi = load.min(axis=1), load.max(axis=1)  # over every worker, healthy or not
        imbalanced = (hi - lo > self.balance_abs) & (hi > self.balance_rel * lo)
        rate = _match_rate(view)
        best = self.argmin(-rate, mask)
        hit = rate[np.arange(best.size), best] > self.cache_threshold
        smallest = self.argmin(view.cached_tokens, mask)
        least = self.argmin(load, mask)
        return np.where(imbalanced, least, np.where(hit, best, smallest))


class DynamoKV(Router):
    """NVIDIA Dynamo KV router, default worker selector (ai-dynamo/dynamo, lib/llm/src/kv_router/
    scheduler.rs at commit db19bd2a): cost = overlap_weight x prefill blocks + decode blocks,
    where prefill
    blocks are the worker's queued prefill tokens plus this request's uncached tokens, over the
    block size, and decode blocks are the worker's active KV blocks plus this request's blocks;
    the least cost wins (temperature 0), ties to the worker with the smallest tree."""

    name = "dynamo-kv"
    balancing = False
    overlap_weight = 1.0

    def act(self, view, mask):
        block = np.maximum(view.block_size, 1).astype(np.float64)
        uncached = np.maximum(view.prompt[:, None] - view.hit_tokens, 0.0)
        prefill = (view.prefill_tokens + uncached) / block
        decode = view.kv_used + np.ceil(view.prompt[:, None] / block)
        cost = self.overlap_weight * prefill + decode
        return self.argmin(cost, mask, view.cached_tokens)


class LLMD(Router):
    """llm-d inference scheduler's default profile (kubernetes-sigs/gateway-api-inference-
    extension at commit 02308be, pkg/epp/scheduling/framework/plugins/scorer; weights from
    config/charts/inferencepool/templates/epp-config.yaml at commit 0ae94df): score =
    3 x prefix + 2 x kv-cache + 2 x queue, where prefix is the fraction of the prompt's blocks the
    pod holds, kv-cache is 1 - KV usage, queue is (max - q) / (max - min) over the waiting queues
    (1 for every pod when they are equal); the highest score wins, ties at random."""

    name = "llm-d"
    balancing = False
    weights = (3.0, 2.0, 2.0)  # prefix, kv-cache, queue

    def act(self, view, mask):
        block = np.maximum(view.block_size, 1).astype(np.float64)
        total = np.maximum(np.ceil(view.prompt[:, None] / block), 1.0)
        prefix = np.floor(view.hit_tokens / block) / total
        kv = 1.0 - view.kv_util
        q = np.where(mask, view.waiting, np.nan)
        qmax, qmin = np.nanmax(q, axis=1, keepdims=True), np.nanmin(q, axis=1, keepdims=True)
        spread = qmax - qmin
        queue = np.where(spread > 0, (qmax - view.waiting) / np.where(spread > 0, spread, 1.0), 1.0)
        wp, wk, wq = self.weights
        score = wp * prefix + wk * kv + wq * queue
        return self.argmin(-score, mask, self.rng.random(score.shape))  # random tie-break


class AIBrixPrefix(Router):
    """AIBrix prefix-cache routing (vllm-project/aibrix, pkg/plugins/gateway/algorithms/
    prefix_cache.go at commit 429c45e; later commits changed the imbalance gate): when the
    running requests are imbalanced (max - min > 8) the pod
    with the fewest running requests; otherwise, among pods whose running requests are at most
    mean + 1 standard deviation, the one with the longest prefix match; with no match anywhere,
    the pod with the fewest requests."""

    name = "aibrix-prefix"
    balancing = False
    imbalance = 8.0
    std_factor = 1.0

    def act(self, view, mask):
        running = view.running
        r = np.where(mask, running, np.nan)
        imbalanced = np.nanmax(r, axis=1) - np.nanmin(r, axis=1) > self.imbalance
        least_running = self.argmin(running, mask)
        n = np.maximum(mask.sum(axis=1, keepdims=True), 1)
        mean = np.where(mask, running, 0.0).sum(axis=1, keepdims=True) / n
        var = np.where(mask, (running - mean) ** 2, 0.0).sum(axis=1, keepdims=True) / np.maximum(n - 1, 1)
        calm = mask & (running <= mean + self.std_factor * np.sqrt(var))  # sample std, as AIBrix
        calm = np.where(calm.any(axis=1, keepdims=True), calm, mask)
        rate = np.where(calm, _match_rate(view), -1.0)
        best = self.argmin(-rate, calm)
        matched = rate.max(axis=1) > 0
        least_requests = self.argmin(self.outstanding(view), mask)
        return np.where(imbalanced, least_running, np.where(matched, best, least_requests))


class PrefixHash(Router):
    """Session / prefix affinity of the vLLM production stack (vllm-project/production-stack,
    src/vllm_router/routers/routing_logic.py `SessionRouter`, which hashes a session id onto a
    consistent-hash ring of the endpoints with uhashring): the request's first prefix chunk id
    is the key; the ring has `replicas` virtual points per node (MD5); a node marked full is
    skipped by walking the ring. Requests without a prefix go to the node with fewest requests.
    Pure affinity: the rule never looks at load."""

    name = "prefix-hash"
    balancing = False
    replicas = 64

    def reset(self, n_envs):
        super().reset(n_envs)
        points = sorted(
            (int.from_bytes(hashlib.md5(f"node-{n}-{r}".encode()).digest()[:8], "big"), n)
            for n in range(self.n_nodes)
            for r in range(self.replicas)
        )
        self.ring_keys = [p for p, _ in points]
        self.ring_nodes = [n for _, n in points]

    def node_for(self, key: int, allowed: np.ndarray) -> int:
        """The first allowed node clockwise from the hash of `key`."""
        h = int.from_bytes(hashlib.md5(str(key).encode()).digest()[:8], "big")
        start = bisect.bisect(self.ring_keys, h)
        size = len(self.ring_nodes)
        for i in range(size):
            node = self.ring_nodes[(start + i) % size]
            if allowed[node]:
                return node
        return self.ring_nodes[start % size]

    def act(self, view, mask):
        least = self.argmin(self.outstanding(view), mask)
        keys = np.asarray(view.prefix_key).astype(np.int64)
        out = least.copy()
        for i in np.flatnonzero(keys >= 0):
            out[i] = self.node_for(int(keys[i]), mask[i])
        return out


PRODUCTION: tuple[type[Router], ...] = (SGLangCacheAware, DynamoKV, LLMD, AIBrixPrefix, PrefixHash)
