"""The reward: minus the objective accrued in a step, so an episode's rewards sum to -objective.

`latency` objective (the default): total end-to-end latency of the requests (seconds) + a
penalty per drop + `energy_weight` x energy (joules). The latency part is credited as it accrues
(Little's law: the integral of the number of requests in the cluster), so the router learns
from every step rather than only when requests finish.

`slo` objective: +1 per request that finishes within its TTFT and TPOT targets (goodput), minus
the drop penalty per drop, credited when it happens.

Both are divided by `reward_scale`. `objective_from_log` recomputes the same sum from what the
episode logged, which the tests use to hold the reward to its definition.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from burstgym.cluster import Accrual
from burstgym.types import EnvParams, RequestLog
from burstgym.workload import Requests


def step_reward(
    acc: Accrual, dropped: jax.Array, slo_met_now: jax.Array, objective: str, params: EnvParams
) -> jax.Array:
    """Reward for one step from what accrued during it (`slo_met_now`: requests meeting their SLO)."""
    if objective == "slo":
        value = slo_met_now - params.drop_penalty * dropped
    else:
        value = -(
            acc.latency_s.sum() + params.drop_penalty * dropped + params.energy_weight * acc.energy_j.sum()
        )
    return value / params.reward_scale


def objective_from_log(
    requests: Requests, log: RequestLog, energy_j: jax.Array, objective: str, params: EnvParams
) -> jax.Array:
    """The episode's objective recomputed from the per-request log (to maximise for `slo`)."""
    drops = log.dropped.sum()
    if objective == "slo":
        return slo_met(requests, log, params).sum() - params.drop_penalty * drops
    latency = jnp.where(log.dropped, 0.0, log.finish - requests.arrival).sum()
    return latency + params.drop_penalty * drops + params.energy_weight * energy_j.sum()


def slo_met(requests: Requests, log: RequestLog, params: EnvParams) -> jax.Array:
    """[E] bool: finished within the TTFT target and the TPOT target."""
    ttft = log.first_token - requests.arrival
    tpot = jnp.where(
        requests.output > 1, (log.finish - log.first_token) / jnp.maximum(requests.output - 1, 1), 0.0
    )
    return ~log.dropped & (ttft <= params.ttft_slo) & (tpot <= params.tpot_slo)
