"""Statistics of router evaluations over seeded episodes (common random numbers across routers).

Every metric is a mean over seeds with a 95% Student-t confidence interval; the change against
the baseline (round-robin) is a paired difference over the same seeds, the fair comparison;
percentiles pool the served requests of all seeds, with bootstrap intervals resampling whole
seeds (requests of one episode are correlated, seeds are independent).
"""

from __future__ import annotations

from typing import Any

import numpy as np
from scipy import stats

from agents.rollout import Episodes

BASELINE = "round-robin"
METRICS = (
    "ttft_mean",
    "e2e_mean",
    "e2e_p50",
    "e2e_p99",
    "ttft_p50",
    "ttft_p99",
    "tpot_p50",
    "slo_attainment",
    "drop_rate",
    "energy_per_request_j",
    "skew_index",
    "cache_hit_rate",
    "saved_tokens",
)
# Paired over seeds against round-robin (besides the objective): where affinity pays, and at what hit rate.
PAIRED_METRICS = ("ttft_mean", "e2e_mean", "cache_hit_rate")
# Percentiles over the pooled requests of all seeds (replacing the per-episode means of METRICS).
POOLED_PERCENTILES = {"e2e_p50": 50.0, "e2e_p99": 99.0, "ttft_p50": 50.0, "ttft_p99": 99.0}


def ci95(x: np.ndarray) -> tuple[float, float]:
    """Mean and half-width of the 95% confidence interval (Student t over the finite samples)."""
    x = np.asarray(x, dtype=np.float64)
    x = x[np.isfinite(x)]
    if x.size == 0:
        return float("nan"), float("nan")
    if x.size < 2:
        return float(x.mean()), float("nan")
    half = stats.t.ppf(0.975, x.size - 1) * x.std(ddof=1) / np.sqrt(x.size)
    return float(x.mean()), float(half)


def paired(x: np.ndarray, base: np.ndarray) -> tuple[float, float, float]:
    """Mean paired difference x - base, its 95% CI half-width, and the difference in % of base."""
    d, half = ci95(x - base)
    return d, half, 100.0 * d / float(np.mean(base))


def pooled_percentile(latency: np.ndarray, q: float, n_resamples: int = 999) -> tuple[float, float]:
    """The q-th percentile of the served requests of all seeds pooled ([S, E], NaN = not served),
    and the half-width of its 95% bootstrap CI resampling whole seeds. A per-episode p99 of a
    256-request episode is about its third-largest sample; pooling uses every request."""
    per_seed = [row[np.isfinite(row)] for row in np.asarray(latency, dtype=np.float64)]
    if not any(x.size for x in per_seed):
        return float("nan"), float("nan")

    def statistic(idx: np.ndarray) -> float:
        pooled = np.concatenate([per_seed[i] for i in idx.astype(int)])
        return float(np.percentile(pooled, q)) if pooled.size else np.nan

    value = statistic(np.arange(len(per_seed)))
    if len(per_seed) < 2:
        return value, float("nan")
    res = stats.bootstrap(
        (np.arange(len(per_seed)),),
        statistic,
        vectorized=False,
        n_resamples=n_resamples,
        method="percentile",
        random_state=0,
    )
    lo, hi = res.confidence_interval
    return value, float((hi - lo) / 2)


def scenario_rows(scenario: str, results: dict[str, Episodes]) -> list[dict[str, Any]]:
    """One table row per router: metrics with CIs and the paired change against round-robin."""
    base = results[BASELINE].cost
    rows = []
    for name, ep in results.items():
        mean, half = ci95(ep.cost)
        d, dhalf, pct = paired(ep.cost, base)
        row: dict[str, Any] = {
            "scenario": scenario,
            "router": name,
            "objective": mean,
            "objective_ci": half,
            "vs_rr": d,
            "vs_rr_ci": dhalf,
            "vs_rr_pct": pct,
            "seeds": int(ep.cost.size),
        }
        for m in METRICS:
            row[m], row[f"{m}_ci"] = ci95(ep.metrics[m])
        for m in PAIRED_METRICS:
            row[f"{m}_vs_rr"], row[f"{m}_vs_rr_ci"] = ci95(ep.metrics[m] - results[BASELINE].metrics[m])
        for m, q in POOLED_PERCENTILES.items():
            latency = ep.ttft if m.startswith("ttft") else ep.e2e
            row[m], row[f"{m}_ci"] = pooled_percentile(latency, q)
        row["load_share"] = np.mean(ep.metrics["load_share"], axis=0).round(4).tolist()
        rows.append(row)
    return rows


def summary(scenario: str, results: dict[str, Episodes], learned: str | None) -> str:
    """Which router wins the scenario and by how much; how the learned router fares."""
    means = {n: float(ep.cost.mean()) for n, ep in results.items()}
    best = min(means, key=means.get)
    base = results[BASELINE].cost
    d, half, pct = paired(results[best].cost, base)
    ci = 100 * half / base.mean()
    text = f"{scenario}: best is {best} ({pct:+.2f}% objective vs round-robin, paired 95% CI ±{ci:.2f}%)"
    if learned is not None:
        lc = results[learned].cost
        d, half, pct = paired(lc, base)
        verdict = (
            "better than" if d + half < 0 else "worse than" if d - half > 0 else "not distinguishable from"
        )
        text += f"; {learned} is {verdict} round-robin ({pct:+.2f}% ± {100 * half / base.mean():.2f}%)"
        heur = {n: m for n, m in means.items() if n != learned}
        top = min(heur, key=heur.get)
        d, half, pct = paired(lc, results[top].cost)
        lm, lh = ci95(lc)
        tm, th = ci95(results[top].cost)
        overlap = "overlap" if abs(lm - tm) <= lh + th else "do not overlap"
        verdict = "beats" if d + half < 0 else "loses to" if d - half > 0 else "ties with"
        text += (
            f"; it {verdict} the best heuristic {top} ({pct:+.2f}%, paired CI ±"
            f"{100 * half / results[top].cost.mean():.2f}%; unpaired 95% CIs {overlap})"
        )
    return text
