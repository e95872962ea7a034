"""Episode metrics that people expect from an LLM-serving simulator, computed from the log.

Latencies: TTFT (arrival to first output token), TPOT (time per output token after the first,
over requests with more than one output token), end-to-end (arrival to last token); each as
mean, p50, p90, p99 over served requests of the episode (evaluate.py pools requests over seeds for
tail percentiles). `excess_mean`: end-to-end latency beyond an idle node's. SLO attainment is over
all routed requests (a drop misses its SLO); goodput is requests meeting both targets per second;
throughput is output tokens per second. Prefix cache: `cache_hit_rate` is the fraction of
first-admission prompt tokens served from the cache (cluster and per node), `prefill_tokens` the
prompt and recompute tokens computed, `saved_tokens` those served from the cache (re-admissions
after preemption included). Load share is each node's fraction of routed requests; the skew index
is the coefficient of variation of the shares relative to each node's share of the capacity (0 =
routing in proportion to capacity, sqrt(N - 1) = everything on one of N equal nodes).

Written with jax.numpy so it runs inside the jitted vector step; it accepts NumPy logs too.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from burstgym.reward import slo_met
from burstgym.types import EnvParams, NodeState, RequestLog, Service
from burstgym.workload import Requests

PERCENTILES = (50, 90, 99)


def _summary(name: str, x: jax.Array) -> dict[str, jax.Array]:
    out = {f"{name}_mean": jnp.nanmean(x)}
    q = jnp.nanpercentile(x, jnp.array(PERCENTILES, dtype=x.dtype))
    for p, v in zip(PERCENTILES, q, strict=True):
        out[f"{name}_p{p}"] = v
    return out


def episode_metrics(
    requests: Requests,
    service: Service,
    log: RequestLog,
    nodes: NodeState,
    routed: jax.Array,
    duration: jax.Array,
    params: EnvParams,
) -> dict[str, jax.Array]:
    """Summary metrics of one episode of `routed` requests lasting `duration` seconds."""
    n = log.e2e.shape[0]
    mine = jnp.arange(n) < routed
    dropped = mine & log.dropped
    served = mine & ~log.dropped & jnp.isfinite(log.e2e)
    output = requests.output[:n]
    e2e = jnp.where(served, log.e2e, jnp.nan)
    ttft = jnp.where(served, log.ttft, jnp.nan)
    multi = served & (output > 1)
    tpot = jnp.where(multi, (log.e2e - log.ttft) / jnp.maximum(output - 1, 1), jnp.nan)
    excess = jnp.where(served, log.e2e - service.e2e[:n], jnp.nan)
    duration = jnp.maximum(duration, 1e-9)
    met = served & slo_met(log.ttft, log.e2e, output, params)
    routed_f = jnp.maximum(routed, 1)
    share = nodes.routed / jnp.maximum(nodes.routed.sum(), 1)
    cap = params.nodes.capacity_rps
    relative = share / (cap / cap.sum())
    out: dict[str, jax.Array] = {}
    for name, x in (("ttft", ttft), ("tpot", tpot), ("e2e", e2e)):
        out.update(_summary(name, x))
    n_served = served.sum()
    energy = nodes.energy_j.sum()
    out.update(
        {
            "excess_mean": jnp.nanmean(excess),
            "requests": jnp.asarray(routed),
            "served": n_served,
            "drops": dropped.sum(),
            "drop_rate": dropped.sum() / routed_f,
            "preemptions": jnp.where(mine, log.preemptions, 0).sum(),
            "slo_attainment": met.sum() / routed_f,
            "goodput_rps": met.sum() / duration,
            "throughput_rps": n_served / duration,
            "throughput_tps": jnp.where(served, output, 0).sum() / duration,
            "energy_j": energy,
            "energy_per_request_j": energy / jnp.maximum(n_served, 1),
            "duration_s": duration,
            "total_latency_s": jnp.nansum(e2e),
            "cache_hit_rate": nodes.hit_tokens.sum() / jnp.maximum(nodes.admitted_prompt.sum(), 1),
            "prefill_tokens": nodes.prefill_tokens.sum(),
            "saved_tokens": nodes.saved_tokens.sum(),
            "skew_index": jnp.std(relative) / jnp.maximum(jnp.mean(relative), 1e-12),
            "load_share": share,
            "node_hit_rate": nodes.hit_tokens / jnp.maximum(nodes.admitted_prompt, 1),
        }
    )
    return out


PER_NODE = ("load_share", "node_hit_rate")


def to_python(metrics: dict[str, jax.Array]) -> dict[str, float | list[float]]:
    """Metrics as plain Python numbers (lists for per-node arrays), e.g. for an info dict or JSON."""
    out: dict[str, float | list[float]] = {}
    for k, v in metrics.items():
        a = np.asarray(v)
        out[k] = a.tolist() if a.ndim else float(a)
    return out
