"""What the router sees before it routes a request: per-node signals, and the observation vector.

`RouterView` holds, in natural units, what a real router can know about each node and about the
arriving request. Routers (agents/routers, `burstgym.routing`) read it; the RL observation is the same
information normalised into a flat float32 vector in [0, OBS_HIGH].

Load signals (`running`, `waiting`, `kv_util`, `prefill_tokens`, `prompt_tokens`, `window_age`,
the power state) are what metric-scraping routers read from the engines (vLLM's /metrics: running
and waiting requests, KV-cache usage) or count themselves (llm-d's in-flight tokens). With
`signal_interval > 0` they are refreshed only at the first
arrival after each multiple of the interval, so the router sees them as they were then
(llm-d's endpoint picker scrapes every 50 ms; gateway-api-inference-extension
pkg/epp/backend/metrics). Cache signals (`hit_tokens`, `cached_tokens`) are the engines' own
caches, exact and current, as a router that follows the engines' KV events sees them (Dynamo's
KV router, llm-d's precise prefix scorer). Routers that keep their own approximate index of what
they routed (SGLang, vllm-router, llm-d's default, AIBrix) build it from the arriving request's
chunk ids (`chunk_ids`, `chunk_end`) and the clock, in their own state (agents/routers).
Static per-node facts a router is configured with: `capacity`, `prefill_rate` (llm-d's calibrated
peak prefill throughput) and `kv_tokens` (the KV size an LRU index is tuned to).

Observation (per node, `NODE_FEATURES` each, in node order):
- `running`: requests in the running set (continuous) or the batch in flight (dynamic), over
  `request_scale` (the requests a node holds at saturation);
- `waiting`: waiting requests over `request_scale`;
- `kv_util`: fraction of KV blocks held by running requests (vLLM's KV-cache usage);
- `outstanding_prompt`: prompt (and recompute) tokens still to prefill on the node, over
  `prompt_scale * request_scale`;
- `window_age`: how long the oldest waiting request has waited, over `age_scale` (for dynamic
  batching `max_queue_delay`, so 1 means the batching window has expired);
- `idle`, `busy`, `asleep`: the node's power state, one-hot (waking counts as asleep);
- `cache_hit`: fraction of the arriving request's prompt the node holds in its prefix cache;
- `cache_used`: fraction of the node's KV blocks the prefix cache holds (pinned or not);
- `capacity`: the node's capacity (requests/s) over the cluster's mean (1 on a homogeneous cluster);
- `predicted_ttft`: the arriving request's TTFT predicted on the node (`burstgym.prediction`, the
  model the `marginal-cost` router uses) over the least predicted cost of any node;
- `predicted_cost`: the objective's predicted increase if the request goes to the node, beyond the
  least of any node, over that least (0 on the node `marginal-cost` would choose).
Then global features:
- `prompt`: the arriving request's prompt tokens over `prompt_scale` (the output length is hidden);
- `since_last_arrival`: seconds since the previous arrival times the workload's mean rate;
- `arrival_rate`: an exponentially weighted estimate of the arrival rate (time constant
  `rate_window`, started at the workload's mean rate) over the cluster's capacity;
- `time_to_go`: requests left to route in the episode over `episode_length` (1 at the start).
Values are clipped to [0, OBS_HIGH] so that bursts cannot produce unbounded inputs.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from burstgym import prediction
from burstgym import prefix_cache as pc
from burstgym.cluster import Geometry, kv_utilisation, would_drop
from burstgym.latency import step_time
from burstgym.types import ASLEEP, BUSY, IDLE, RUNNING, WAITING, WAKING, EnvConfig, EnvParams, State

NODE_FEATURES = (
    "running",
    "waiting",
    "kv_util",
    "outstanding_prompt",
    "window_age",
    "idle",
    "busy",
    "asleep",
    "cache_hit",
    "cache_used",
    "capacity",
    "predicted_ttft",
    "predicted_cost",
)
GLOBAL_FEATURES = ("prompt", "since_last_arrival", "arrival_rate", "time_to_go")
# The load signals, in the order of `State.seen` (refreshed every `signal_interval`).
LOAD_SIGNALS = (
    "running",
    "waiting",
    "kv_util",
    "prefill_tokens",
    "window_age",
    "phase",
    "kv_used",
    "prompt_tokens",
)
OBS_HIGH = 10.0


class RouterView(NamedTuple):
    """What a router knows when request `step` arrives; per-node fields are [N]."""

    running: jax.Array  # float, running requests (or batch members)
    waiting: jax.Array  # float, waiting requests
    kv_util: jax.Array  # float, fraction of KV blocks held by running requests
    kv_used: jax.Array  # float, KV blocks held by running requests
    prefill_tokens: jax.Array  # float, prompt and recompute tokens still to prefill
    prompt_tokens: jax.Array  # float, prompt tokens of the requests running or waiting (in flight)
    window_age: jax.Array  # float, seconds the oldest waiting request has waited
    phase: jax.Array  # int32, IDLE / BUSY / ASLEEP / WAKING
    hit_tokens: jax.Array  # float, leading prompt tokens of the arriving request the node caches
    cached_tokens: jax.Array  # float, tokens the node's prefix cache holds (its "tree size")
    cache_used: jax.Array  # float, fraction of KV blocks the prefix cache holds
    capacity: jax.Array  # float, requests/s the node sustains
    prefill_rate: jax.Array  # float, prompt tokens/s the node prefills in full iterations (its budget)
    kv_tokens: jax.Array  # float, tokens the node's KV cache holds (blocks x block size)
    accepts: jax.Array  # bool, the node would accept the request (its queue is not full)
    block_size: jax.Array  # int32, tokens per KV block
    prompt: jax.Array  # [] float, the arriving request's prompt tokens
    prefix_key: jax.Array  # [] int32, id of its first prefix chunk (-1: none); session / prefix affinity
    chunk_ids: jax.Array  # [B] int32, its prefix chunk ids in order (-1 past the last; B = 0 without caching)
    chunk_end: jax.Array  # [B] int32, token end of each chunk within its prompt (prompt-capped)
    step: jax.Array  # [] int32, index of the arriving request in the episode
    since_last: jax.Array  # [] float, seconds since the previous arrival
    rate: jax.Array  # [] float, estimated arrival rate (req/s)
    time_to_go: jax.Array  # [] float, fraction of the episode's requests still to route
    clock: jax.Array  # [] float, seconds since the episode's first arrival (router-side eviction timers)


def obs_size(n_nodes: int) -> int:
    """Length of the observation vector for a cluster of `n_nodes`."""
    return n_nodes * len(NODE_FEATURES) + len(GLOBAL_FEATURES)


def node_features(obs: jax.Array, n_nodes: int) -> jax.Array:
    """View the per-node block of (a batch of) observations as [..., n_nodes, len(NODE_FEATURES)]."""
    block = obs[..., : n_nodes * len(NODE_FEATURES)]
    return block.reshape(block.shape[:-1] + (n_nodes, len(NODE_FEATURES)))


def load_signals(state: State, geo: Geometry | None, params: EnvParams, cfg: EnvConfig) -> jax.Array:
    """[N, len(LOAD_SIGNALS)] the nodes' load signals now (float)."""
    s = state.slots
    dtype = state.clock.dtype
    waiting = s.status == WAITING
    running = s.status == RUNNING
    seq_len = s.prompt + s.generated
    left = seq_len - s.computed
    to_prefill = jnp.where(waiting | (running & (left > 1)), left, 0).sum(axis=1)
    oldest = jnp.min(jnp.where(waiting, s.arrival, jnp.inf), axis=1)
    age = jnp.where(jnp.isfinite(oldest), -oldest, 0.0)
    kv_util, _ = kv_utilisation(s, state.cache, geo, params, cfg)
    kv_used = kv_util * params.nodes.kv_blocks
    in_flight = jnp.where(waiting | running, s.prompt, 0).sum(axis=1)
    return jnp.stack(
        [
            running.sum(axis=1).astype(dtype),
            waiting.sum(axis=1).astype(dtype),
            kv_util.astype(dtype),
            to_prefill.astype(dtype),
            age.astype(dtype),
            state.nodes.phase.astype(dtype),
            kv_used.astype(dtype),
            in_flight.astype(dtype),
        ],
        axis=1,
    )


def router_view(state: State, params: EnvParams, cfg: EnvConfig) -> RouterView:
    """The view of the request `state.step` (clamped to the last at the episode's end)."""
    seen = state.seen
    col = {name: seen[:, i] for i, name in enumerate(LOAD_SIGNALS)}
    req = state.requests
    n = req.prompt.shape[0]
    k = jnp.minimum(state.step, n - 1)
    dtype = state.clock.dtype
    p = params.nodes
    if cfg.prefix_caching:
        ids = req.chunk_ids[k]
        start = jnp.arange(ids.shape[0], dtype=jnp.int32) * cfg.chunk_tokens
        end = jnp.minimum(start + cfg.chunk_tokens, req.id_tokens[k])
        ids = jnp.where(end > start, ids, -1)
        hits = pc.leading_run(jax.vmap(pc.present_at, in_axes=(0, None))(state.cache, ids))
        hit_tokens = jnp.minimum(
            pc.chunk_end(jnp.broadcast_to(end, hits.shape + end.shape), hits), req.prompt[k]
        )
        cached_blocks = state.cache.cached
        cached_tokens = state.cache.cached_tokens
        prefix_key = ids[0] if ids.shape[0] else jnp.int32(-1)
        # the router sees the prompt's chunks (a chunk of output tokens is cached only after it ran)
        prompt_ids = jnp.where(start < req.prompt[k], ids, -1)
        chunk_end = jnp.where(prompt_ids >= 0, jnp.minimum(end, req.prompt[k]), 0).astype(jnp.int32)
    else:
        hit_tokens = jnp.zeros(cfg.n_nodes, dtype)
        cached_blocks = jnp.zeros(cfg.n_nodes, dtype)
        cached_tokens = jnp.zeros(cfg.n_nodes, dtype)
        prefix_key = jnp.int32(-1)
        prompt_ids = jnp.zeros(0, jnp.int32)
        chunk_end = jnp.zeros(0, jnp.int32)
    prev = req.arrival[jnp.maximum(k - 1, 0)]
    return RouterView(
        running=col["running"],
        waiting=col["waiting"],
        kv_util=col["kv_util"],
        kv_used=col["kv_used"],
        prefill_tokens=col["prefill_tokens"],
        prompt_tokens=col["prompt_tokens"],
        window_age=col["window_age"],
        phase=col["phase"].astype(jnp.int32),
        hit_tokens=hit_tokens.astype(dtype),
        cached_tokens=cached_tokens.astype(dtype),
        cache_used=(cached_blocks / jnp.maximum(p.kv_blocks, 1)).astype(dtype),
        capacity=p.capacity_rps,
        prefill_rate=prefill_rate(params),
        kv_tokens=(p.kv_blocks * p.block_size).astype(dtype),
        accepts=~would_drop(state.slots, params),
        block_size=p.block_size,
        prompt=req.prompt[k].astype(dtype),
        prefix_key=jnp.asarray(prefix_key, jnp.int32),
        chunk_ids=prompt_ids.astype(jnp.int32),
        chunk_end=chunk_end,
        step=state.step,
        since_last=(req.arrival[k] - prev).astype(dtype),
        rate=state.rate_estimate,
        time_to_go=((state.horizon - state.step) / cfg.episode_length).astype(dtype),
        clock=state.clock,
    )


def prefill_rate(params: EnvParams) -> jax.Array:
    """[N] prompt tokens/s each node prefills in iterations that fill its token budget: what
    llm-d's calibration measures as `peakPrefillThroughput` (the budget over the TTFT of a prompt
    of that size on an idle node; llm-d guides/recipes/router/calibration)."""
    p = params.nodes
    budget = p.max_num_batched_tokens.astype(jnp.result_type(float))
    return budget / (p.speed * step_time(p.latency, budget, 0.0, 0.0))


def observe(view: RouterView, params: EnvParams, cfg: EnvConfig) -> jax.Array:
    """The flat observation vector of a router view (every feature documented above)."""
    p = params.nodes
    dtype = view.running.dtype
    scale = p.request_scale
    phase = view.phase
    predicted = prediction.estimate(
        view,
        prediction.node_model(params),
        params.lengths,
        prediction.weights_of(params),
        cfg.scheduler,
        cfg.padding,
    )
    least = jnp.min(predicted.cost)
    per_node = jnp.stack(
        [
            view.running / scale,
            view.waiting / scale,
            view.kv_util,
            view.prefill_tokens / (params.prompt_scale * scale),
            view.window_age / params.age_scale,
            (phase == IDLE).astype(dtype),
            (phase == BUSY).astype(dtype),
            ((phase == ASLEEP) | (phase == WAKING)).astype(dtype),
            view.hit_tokens / jnp.maximum(view.prompt, 1.0),
            view.cache_used,
            p.capacity_rps / jnp.mean(p.capacity_rps),
            predicted.ttft / least,
            (predicted.cost - least) / least,
        ],
        axis=1,
    )
    glob = jnp.stack(
        [
            view.prompt / params.prompt_scale,
            view.since_last * params.arrival_rate,
            view.rate / params.capacity_rate,
            view.time_to_go,
        ]
    )
    obs = jnp.concatenate([per_node.reshape(-1), glob])
    return jnp.clip(obs, 0.0, OBS_HIGH).astype(jnp.float32)


def action_mask(view: RouterView) -> jax.Array:
    """[N] bool: nodes that would accept the request; all True when every node would drop it."""
    return jnp.where(view.accepts.any(), view.accepts, True)
