"""What the router sees before it routes a request: a flat float32 vector in [0, OBS_HIGH].

Per node (in node order, `NODE_FEATURES` each):
- `running`: requests in the running set (continuous) or the batch in flight (dynamic), over
  `max_num_seqs` (continuous) or `max_batch_size` (dynamic);
- `waiting`: requests in the waiting queue over `queue_capacity` (1 = full: the next is dropped);
- `kv_util`: KV-cache blocks in use over the node's blocks (dynamic: the batch's context tokens
  over the KV capacity);
- `outstanding_prompt`: prompt (and recompute) tokens still to prefill on the node, over
  `prompt_scale * queue_capacity`;
- `window_age`: how long the oldest waiting request has waited, over `age_scale` (for dynamic
  batching `age_scale` is `max_queue_delay`, so 1 means the batching window has expired);
- `idle`, `busy`, `asleep`: the node's power state, one-hot (waking counts as asleep).
Then three global features:
- `prompt`: the arriving request's prompt tokens over `prompt_scale` (the output length is hidden);
- `since_last_arrival`: seconds since the previous arrival times `capacity_rate` (1 = the mean
  gap at full load);
- `arrival_rate`: an exponentially weighted estimate of the arrival rate (time constant
  `rate_window`) over `capacity_rate` (1 = full load).
Values are clipped to [0, OBS_HIGH] so that bursts cannot produce unbounded inputs.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from burstgym.cluster import kv_utilisation
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
)
GLOBAL_FEATURES = ("prompt", "since_last_arrival", "arrival_rate")
OBS_HIGH = 10.0


def obs_size(n_nodes: int) -> int:
    """Length of the observation vector for a cluster of `n_nodes`."""
    return n_nodes * len(NODE_FEATURES) + len(GLOBAL_FEATURES)


def node_features(obs: jax.Array, n_nodes: int) -> jax.Array:
    """View the per-node block of (a batch of) observations as [..., n_nodes, len(NODE_FEATURES)]."""
    block = obs[..., : n_nodes * len(NODE_FEATURES)]
    return block.reshape(block.shape[:-1] + (n_nodes, len(NODE_FEATURES)))


def observe(state: State, params: EnvParams, cfg: EnvConfig) -> jax.Array:
    """The observation for the request `state.step` (clamped to the last at episode end)."""
    p = params.nodes
    s = state.slots
    dtype = state.time.dtype
    running = (s.status == RUNNING).sum(axis=1)
    waiting = s.status == WAITING
    limit = p.max_num_seqs if cfg.scheduler == "continuous" else p.max_batch_size
    seq_len = s.prompt + s.generated
    left = seq_len - s.computed
    to_prefill = jnp.where(waiting | ((s.status == RUNNING) & (left > 1)), left, 0).sum(axis=1)
    oldest = jnp.min(jnp.where(waiting, s.arrival, jnp.inf), axis=1)
    age = jnp.where(jnp.isfinite(oldest), state.time - oldest, 0.0)
    phase = state.nodes.phase
    per_node = jnp.stack(
        [
            running / limit,
            waiting.sum(axis=1) / p.queue_capacity,
            kv_utilisation(s, params, cfg),
            to_prefill / (params.prompt_scale * p.queue_capacity),
            age / params.age_scale,
            (phase == IDLE).astype(dtype),
            (phase == BUSY).astype(dtype),
            ((phase == ASLEEP) | (phase == WAKING)).astype(dtype),
        ],
        axis=1,
    )
    k = jnp.minimum(state.step, cfg.episode_length - 1)
    prev = state.requests.arrival[jnp.maximum(k - 1, 0)]
    glob = jnp.stack(
        [
            state.requests.prompt[k] / params.prompt_scale,
            (state.requests.arrival[k] - prev) * params.capacity_rate,
            state.rate_estimate / params.capacity_rate,
        ]
    )
    obs = jnp.concatenate([per_node.reshape(-1), glob])
    return jnp.clip(obs, 0.0, OBS_HIGH).astype(jnp.float32)
