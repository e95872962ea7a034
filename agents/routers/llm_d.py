"""llm-d's router (llm-d/llm-d-inference-scheduler, renamed llm-d-router): the 2026 default
profile ("optimized baseline") and its precise-prefix profile.

Restated from the llm-d guides (llm-d/llm-d `guides/optimized-baseline`, 2026): plugins
`approx-prefix-cache-producer`, `inflight-load-producer`, `prefix-cache-affinity-filter`,
`token-load-scorer`, profile `prefix-cache-affinity-filter` then `token-load-scorer` with the
max-score picker; the precise-prefix guide swaps the approximate producer for
`precise-prefix-cache-producer` (the engines' KV events). Plugin code at
llm-d/llm-d-inference-scheduler commit 520af478 (2026-05-17):
- `pkg/epp/framework/plugins/scheduling/filter/prefixcacheaffinity/plugin.go`: endpoints whose
  prefix score (matched blocks / prompt blocks) is at least `affinityThreshold` (0.80) are sticky;
  the filter keeps only them unless none is sticky, or the best sticky endpoint's predicted TTFT
  exceeds the best non-sticky one's by more than `maxTTFTPenaltyMs` (5000), or with probability
  `explorationProbability` (0.01). The guides run it in throughput mode, predicting an endpoint's
  TTFT as its in-flight tokens over `peakPrefillThroughput` (15928 tokens/s in the guide, measured
  for Qwen3-32B on H100 TP2; "calibrate on your fleet": here the node's own prefill rate,
  `RouterView.prefill_rate`);
- `.../requestcontrol/dataproducer/inflightload/token_estimator.go`: a request's in-flight tokens
  are its input tokens plus an output estimate of 1.5 x input, from dispatch to completion;
- `.../scheduling/scorer/tokenload/token_load.go`: score = 1 - min(in-flight tokens,
  queueThresholdTokens) / queueThresholdTokens (4194304);
- `.../scheduling/picker/maxscore/picker.go`: the highest score, ties at random (shuffle, stable
  sort).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import jax
import jax.numpy as jnp

from agents.routers.base import Affinity, argmin
from agents.routers.index import IndexSpec


@dataclass(frozen=True)
class LLMD(Affinity):
    """Prefix-affinity filter (prefix score >= 0.8, overridden when the best sticky node's
    predicted TTFT exceeds the best other node's by more than 5 s, or in 1% of requests), then
    the node of least in-flight tokens (2.5 x the prompt tokens of its requests in flight), ties
    at random."""

    name: ClassVar[str] = "llm-d"
    # approx-prefix-cache-producer: an LRU index of the routed prompts' blocks per endpoint, its
    # capacity autotuned to the endpoint's KV cache (`autoTune`, `lruCapacityPerServer`)
    index: ClassVar[IndexSpec] = IndexSpec(capacity=8192, kv_limited=True)
    affinity_threshold: float = 0.8
    exploration_probability: float = 0.01
    max_ttft_penalty_s: float = 5.0
    output_ratio: float = 1.5
    queue_threshold_tokens: float = 4194304.0

    def decide(self, state, view, mask):
        n = mask.shape[0]
        dtype = view.prompt_tokens.dtype
        block = jnp.maximum(view.block_size, 1).astype(dtype)
        total = jnp.maximum(jnp.ceil(view.prompt / block), 1.0)
        score = jnp.floor(self.matched(state, view) / block) / total
        sticky = mask & (score >= self.affinity_threshold)
        others = mask & ~sticky
        in_flight = (1.0 + self.output_ratio) * view.prompt_tokens
        ttft = in_flight / jnp.mean(view.prefill_rate)
        gap = jnp.min(jnp.where(sticky, ttft, jnp.inf)) - jnp.min(jnp.where(others, ttft, jnp.inf))
        broken = others.any() & (gap > self.max_ttft_penalty_s)
        sub, state = self.draw(state)
        explore = jax.random.uniform(sub) < self.exploration_probability
        keep = jnp.where(sticky.any() & ~broken & ~explore, sticky, mask)
        load = jnp.minimum(in_flight, self.queue_threshold_tokens) / self.queue_threshold_tokens
        order, state = self.random_order(state, n)
        node = argmin(load, keep, order=order)  # max score 1 - load
        return node, self.routed(state, view, node)


@dataclass(frozen=True)
class LLMDPrecise(LLMD):
    """The same profile reading the engines' KV events (llm-d's precise-prefix-cache profile):
    the prefix score of every node is the engines' exact cache."""

    name: ClassVar[str] = "llm-d-precise"
    index: ClassVar[None] = None  # precise-prefix-cache-producer: the engines' KV events
