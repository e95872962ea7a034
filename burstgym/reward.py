"""The reward: minus the objective accrued in a step, so an episode's rewards sum to -objective.

Objectives (docs/semantics.md, "Objective and reward"):
- `latency` (default): total end-to-end latency of the served requests (seconds)
  + `ttft_weight` x their total TTFT + `drop_penalty` per drop + `energy_weight` x energy (J);
- `excess`: the same with each request's latency (and TTFT) counted beyond what it would take
  alone on an idle node with an empty cache (`State.service`): only what routing can change
  (queueing, batching slowdown, cache hits) is left, not a request's own prefill and decode;
- `slo`: minus goodput (requests that finish within their TTFT and TPOT targets) plus the drop
  penalty per drop.

When the latency terms are credited (`EnvConfig.reward`):
- `accrual`: as they accrue, by Little's law (the integral of the number of requests in the
  cluster, and of those still waiting for a first token); for `excess` each accepted request's
  idle-node time is credited back when it is routed;
- `finish`: each request's whole latency in the step in which it finishes.
Drops are charged when they happen, energy as it is drawn; `slo` credits each request when it
finishes. All are divided by `reward_scale`. `objective_from_log` recomputes the episode's sum
from what it logged, which the tests use to hold the reward to its definition.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from burstgym.cluster import Accrual
from burstgym.types import DONE, EnvConfig, EnvParams, RequestLog, Service, Slots
from burstgym.workload import Requests


def slo_met(ttft: jax.Array, e2e: jax.Array, output: jax.Array, params: EnvParams) -> jax.Array:
    """[...] bool: finished within the TTFT target and the TPOT target (NaN latencies: not met)."""
    tpot = jnp.where(output > 1, (e2e - ttft) / jnp.maximum(output - 1, 1), 0.0)
    return jnp.isfinite(e2e) & (ttft <= params.ttft_slo) & (tpot <= params.tpot_slo)


def finished_cost(slots: Slots, service: Service, cfg: EnvConfig, params: EnvParams) -> jax.Array:
    """[] the objective's latency terms of the requests that finished in this step (DONE slots)."""
    done = slots.status == DONE
    if cfg.objective == "slo":
        return -(done & slo_met(slots.ttft, slots.e2e, slots.output, params)).sum().astype(slots.e2e.dtype)
    cost = slots.e2e + params.ttft_weight * slots.ttft
    if cfg.objective == "excess":
        row = jnp.clip(slots.req, 0, service.e2e.shape[0] - 1)
        cost = cost - service.e2e[row] - params.ttft_weight * service.ttft[row]
    return jnp.where(done, cost, 0.0).sum()


def step_cost(
    acc: Accrual,
    done_cost: jax.Array,
    accepted_service: jax.Array,
    dropped: jax.Array,
    cfg: EnvConfig,
    params: EnvParams,
) -> jax.Array:
    """[] the objective accrued in one step (to minimise).

    `done_cost` is `finished_cost` of the step, `accepted_service` the idle-node e2e + weighted
    TTFT of the routed request if it was accepted (0 otherwise).
    """
    energy = params.energy_weight * acc.energy_j.sum()
    drop = params.drop_penalty * dropped
    if cfg.objective == "slo" or cfg.reward == "finish":
        return done_cost + drop + energy
    latency = acc.latency_s.sum() + params.ttft_weight * acc.ttft_s.sum()
    if cfg.objective == "excess":
        latency = latency - accepted_service
    return latency + drop + energy


def objective_from_log(
    requests: Requests,
    service: Service,
    log: RequestLog,
    energy_j: jax.Array,
    routed: jax.Array,
    cfg: EnvConfig,
    params: EnvParams,
) -> jax.Array:
    """The objective of a drained episode recomputed from its log (the first `routed` requests)."""
    n = log.e2e.shape[0]
    mine = jnp.arange(n) < routed
    served = mine & ~log.dropped
    drops = (mine & log.dropped).sum()
    energy = params.energy_weight * energy_j.sum()
    if cfg.objective == "slo":
        met = served & slo_met(log.ttft, log.e2e, requests.output[:n], params)
        return -met.sum() + params.drop_penalty * drops + energy
    cost = log.e2e + params.ttft_weight * log.ttft
    if cfg.objective == "excess":
        cost = cost - service.e2e[:n] - params.ttft_weight * service.ttft[:n]
    return jnp.where(served, cost, 0.0).sum() + params.drop_penalty * drops + energy
