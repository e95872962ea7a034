"""Episode metrics that people expect from an LLM-serving simulator, computed from the log.

Latencies: TTFT (arrival to first output token), TPOT (time per output token after the first,
over requests with more than one output token), end-to-end (arrival to last token); each as
mean, p50, p90, p99 over served requests. SLO attainment is over all requests (a drop misses
its SLO); goodput is requests meeting both targets per second; throughput is output tokens per
second. Load share is each node's fraction of routed requests and the skew index is their
coefficient of variation (0 = perfectly balanced, sqrt(N - 1) = everything on one node).

Written with jax.numpy so it runs inside the jitted vector step; it accepts NumPy logs too.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from burstgym.reward import slo_met
from burstgym.types import EnvParams, RequestLog
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
    log: RequestLog,
    energy_j: jax.Array,
    routed: jax.Array,
    t_end: jax.Array,
    params: EnvParams,
) -> dict[str, jax.Array]:
    """Summary metrics of one finished (drained) episode; scalars, and [N] for `load_share`."""
    served = ~log.dropped & jnp.isfinite(log.finish)
    arrival = requests.arrival
    e2e = jnp.where(served, log.finish - arrival, jnp.nan)
    ttft = jnp.where(served, log.first_token - arrival, jnp.nan)
    multi = served & (requests.output > 1)
    tpot = jnp.where(multi, (log.finish - log.first_token) / jnp.maximum(requests.output - 1, 1), jnp.nan)
    duration = jnp.maximum(t_end - arrival[0], 1e-9)
    n = arrival.shape[0]
    met = slo_met(requests, log, params)
    share = routed / jnp.maximum(routed.sum(), 1)
    out: dict[str, jax.Array] = {}
    for name, x in (("ttft", ttft), ("tpot", tpot), ("e2e", e2e)):
        out.update(_summary(name, x))
    n_served = served.sum()
    out.update(
        {
            "requests": jnp.asarray(n),
            "served": n_served,
            "drops": log.dropped.sum(),
            "drop_rate": log.dropped.sum() / n,
            "preemptions": log.preemptions.sum(),
            "slo_attainment": met.sum() / n,
            "goodput_rps": met.sum() / duration,
            "throughput_rps": n_served / duration,
            "throughput_tps": jnp.where(served, requests.output, 0).sum() / duration,
            "energy_j": energy_j.sum(),
            "energy_per_request_j": energy_j.sum() / jnp.maximum(n_served, 1),
            "duration_s": duration,
            "total_latency_s": jnp.nansum(e2e),
            "skew_index": jnp.std(share) / jnp.maximum(jnp.mean(share), 1e-12),
            "load_share": share,
        }
    )
    return out


def to_python(metrics: dict[str, jax.Array]) -> dict[str, float | list[float]]:
    """Metrics as plain Python numbers (lists for per-node arrays), e.g. for an info dict or JSON."""
    out: dict[str, float | list[float]] = {}
    for k, v in metrics.items():
        a = np.asarray(v)
        out[k] = a.tolist() if a.ndim else float(a)
    return out
