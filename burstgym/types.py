"""The simulator's data: static configuration, per-episode parameters and state, as pytrees.

Shapes use `N` for nodes, `S` for request slots per node and `E` for requests per episode.
Every array field says its shape and dtype; floats use JAX's default float dtype.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import jax

from burstgym.latency import LatencyModel
from burstgym.workload import Requests, Workload

# Node phases (NodeState.phase).
IDLE, BUSY, ASLEEP, WAKING = 0, 1, 2, 3
# Request-slot status (Slots.status).
EMPTY, WAITING, RUNNING = 0, 1, 2
# Request index of an empty slot: out of bounds, so scatters to the log drop it.
NO_REQUEST = 2**31 - 1

SCHEDULERS = ("continuous", "dynamic")
OBJECTIVES = ("latency", "slo")


@dataclass(frozen=True)
class EnvConfig:
    """Static configuration: fixes array shapes and which code is traced (hashable for jit)."""

    n_nodes: int  # N
    episode_length: int  # E, arrivals per episode
    scheduler: str  # "continuous" (vLLM/Orca) or "dynamic" (Triton dynamic batcher)
    workload: Workload  # draws the request stream at reset
    objective: str = "latency"  # "latency" (latency + drops + energy) or "slo" (goodput)
    slots: int = 128  # S >= running limit + queue capacity on every node


class NodeParams(NamedTuple):
    """Per-node parameters; every field has shape [N] so clusters may be heterogeneous."""

    latency: LatencyModel  # step-time coefficients, each [N] float
    speed: jax.Array  # [N] float, multiplies every iteration's duration
    max_num_seqs: jax.Array  # [N] int32, running-set limit (continuous)
    max_num_batched_tokens: jax.Array  # [N] int32, token budget per iteration (continuous)
    block_size: jax.Array  # [N] int32, tokens per KV block
    kv_blocks: jax.Array  # [N] int32, KV blocks on the node (capacity tokens // block_size)
    max_batch_size: jax.Array  # [N] int32 (dynamic)
    max_queue_delay: jax.Array  # [N] float, seconds (dynamic)
    queue_capacity: jax.Array  # [N] int32, waiting requests beyond which arrivals are dropped
    busy_power_w: jax.Array  # [N] float, watts while an iteration runs
    idle_power_w: jax.Array  # [N] float, watts while idle or waking
    sleep_power_w: jax.Array  # [N] float, watts while asleep
    sleep_timeout: jax.Array  # [N] float, seconds idle and empty before sleeping (inf: never)
    wake_delay: jax.Array  # [N] float, seconds from an arrival to being able to run


class EnvParams(NamedTuple):
    """Parameters of one cluster, a pytree: vmap over it to sweep scenarios."""

    nodes: NodeParams
    drop_penalty: jax.Array  # [] float, objective cost of one drop (seconds of latency)
    energy_weight: jax.Array  # [] float, objective cost per joule (seconds per J)
    reward_scale: jax.Array  # [] float, rewards are divided by it
    ttft_slo: jax.Array  # [] float, seconds
    tpot_slo: jax.Array  # [] float, seconds per output token
    capacity_rate: jax.Array  # [] float, requests/s the cluster sustains (observation scale)
    prompt_scale: jax.Array  # [] float, tokens (observation scale)
    age_scale: jax.Array  # [] float, seconds (observation scale for waiting age)
    rate_window: jax.Array  # [] float, seconds, time constant of the arrival-rate estimate


class Slots(NamedTuple):
    """Requests held by each node, in a fixed table of S slots per node; all fields [N, S].

    Each node's table is ordered: running requests by admission (oldest first), then waiting
    requests in FCFS queue order; empty slots are holes or trail (see `burstgym.scheduler`).
    """

    req: jax.Array  # int32, request index in the episode stream, NO_REQUEST when the slot is empty
    status: jax.Array  # int32, EMPTY / WAITING / RUNNING
    arrival: jax.Array  # float, arrival time
    prompt: jax.Array  # int32, prompt tokens
    output: jax.Array  # int32, output tokens to generate
    computed: jax.Array  # int32, tokens whose KV is in cache
    generated: jax.Array  # int32, output tokens produced so far
    sched: jax.Array  # int32, tokens scheduled in the iteration now running (0 if none)


class NodeState(NamedTuple):
    """Per-node scheduler and power state; all fields [N]."""

    phase: jax.Array  # int32, IDLE / BUSY / ASLEEP / WAKING
    iter_end: jax.Array  # float, end of the running iteration (BUSY)
    repeat: jax.Array  # int32, identical decode iterations the running event covers (1: one)
    wake_end: jax.Array  # float, end of waking (WAKING)
    idle_since: jax.Array  # float, when the node last became idle
    last_time: jax.Array  # float, time up to which latency and energy are accrued
    energy_j: jax.Array  # float, energy drawn this episode
    busy_s: jax.Array  # float, time spent running iterations this episode
    routed: jax.Array  # int32, requests routed to the node (accepted or dropped)


class RequestLog(NamedTuple):
    """What happened to each request of the episode; all fields [E]."""

    node: jax.Array  # int32, node it was routed to (-1 before routing)
    dropped: jax.Array  # bool
    first_token: jax.Array  # float, time of the first output token (nan until then)
    finish: jax.Array  # float, time the last output token was produced (nan until then)
    preemptions: jax.Array  # int32, times it was preempted


class State(NamedTuple):
    """Everything about one cluster's episode."""

    key: jax.Array  # PRNG key for the next reset
    requests: Requests  # the episode's stream, [E] each
    step: jax.Array  # [] int32, index of the request waiting to be routed
    time: jax.Array  # [] float, now (the arrival time of request `step`)
    t_end: jax.Array  # [] float, end of the episode (after the drain), nan before
    rate_estimate: jax.Array  # [] float, exponentially weighted arrival rate, req/s
    slots: Slots
    nodes: NodeState
    log: RequestLog
