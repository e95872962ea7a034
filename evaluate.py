"""Evaluate routers: trained checkpoints and every heuristic, on scenarios or trace files, over
seeded episodes shared by all routers (common random numbers).

    python evaluate.py              # the default train.py model vs every router on every named scenario
    python evaluate.py --scenarios prefix conversation --routers round-robin least-tokens sglang-cache-aware
    python evaluate.py --trace path/to/mooncake_trace.jsonl --load 0.7
    python evaluate.py --trace path/to/AzureLLMInferenceTrace_code.csv --load 0.7
    python evaluate.py --model runs/bursty-dynamic-ppo-seed1/model.zip --regime-grid large

The objective is minus the episode's summed rewards times `reward_scale` (for the default latency
objective: total end-to-end latency + drop penalty + energy term, in seconds; lower is better).
Every metric is reported as a mean over seeds with a 95% Student-t confidence interval; the
change against round-robin is also given as a paired difference over the same seeds, the fair
comparison. Writes into `--out` (default `results/`), only once everything has been computed:
`results.md`, `results.csv`, `results.json`, `latency_cdf_<scenario>.png`,
`load_share_<scenario>.png`, `regime_map.png` and `regime_map.csv`.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import shutil
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import matplotlib  # noqa: E402

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
import torch  # noqa: E402
from rich.console import Console  # noqa: E402
from scipy import stats  # noqa: E402
from tqdm import tqdm  # noqa: E402

from agents.cli import parse_settings  # noqa: E402
from agents.learners import DEVICES, PolicyRouter, check_algo, check_device, load_router  # noqa: E402
from agents.rollout import Episodes, Rollout, ci95  # noqa: E402
from agents.routers import ROUTERS, make_router  # noqa: E402
from agents.runs import find_config  # noqa: E402
from burstgym import scenarios  # noqa: E402
from burstgym.observation import obs_size  # noqa: E402

# The checkpoint train.py kept as best on its held-out seeds (5000+); evaluation seeds (10000+) differ,
# so this is model selection on validation data, as rl-zoo3's best_model, not on the test episodes.
DEFAULT_MODEL = Path("runs/prefix-ppo-seed0/best_model.zip")
FINAL_MODEL = DEFAULT_MODEL.with_name("model.zip")  # used when training kept no best model (--eval-every 0)
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
BALANCING = ("round-robin", "jsq", "least-tokens")
SKEWING = ("weighted-skew", "pack-load", "soonest-batch")  # skew for bigger batches (or sleep)
AFFINITY = ("sglang-cache-aware", "dynamo-kv", "llm-d", "aibrix-prefix", "prefix-hash")  # skew for cache hits
# Burstiness levels of the regime map: a scenario and its arrival settings (Poisson, then on/off
# bursts at 2x, 8x and 32x the base rate).
ARRIVALS = {
    "poisson": ("steady", {}),
    "bursts x2": ("bursty", {"burst_ratio": 2.0}),
    "bursts x8": ("bursty", {"burst_ratio": 8.0}),
    "bursts x32": ("bursty", {"burst_ratio": 32.0}),
}
# burstiness x prefix sharing (scenarios.PREFIX_LEVELS; continuous batching only, as the prefix
# cache is) x load x batching regime. "tiny" is for smoke tests; "prefix" is the load sweep of
# cache affinity: where it pays and the load at which it tips into overload.
GRIDS = {
    "tiny": {
        "arrivals": ("bursts x8",),
        "prefix": ("none", "heavy"),
        "loads": (0.3, 0.7),
        "schedulers": ("continuous",),
    },
    "small": {
        "arrivals": ("poisson", "bursts x8"),
        "prefix": ("none", "heavy"),
        "loads": (0.3, 0.7),
        "schedulers": ("continuous", "dynamic"),
    },
    "large": {
        "arrivals": tuple(ARRIVALS),
        "prefix": tuple(scenarios.PREFIX_LEVELS),
        "loads": (0.2, 0.4, 0.6, 0.8, 1.0),
        "schedulers": ("continuous", "dynamic"),
    },
    "prefix": {
        "arrivals": ("bursts x8",),
        "prefix": tuple(scenarios.PREFIX_LEVELS),
        "loads": (0.3, 0.5, 0.7, 0.9, 1.1),
        "schedulers": ("continuous",),
    },
}
console = Console()


def paired(x: np.ndarray, base: np.ndarray) -> tuple[float, float, float]:
    """Mean paired difference x - base, its 95% CI half-width, and the difference in % of base."""
    d, half = ci95(x - base)
    return d, half, 100.0 * d / float(np.mean(base))


def concat_episodes(a: Episodes, b: Episodes) -> Episodes:
    """One router's episodes of two seed batches, in order."""
    return Episodes(
        np.concatenate([a.cost, b.cost]),
        {k: np.concatenate([a.metrics[k], b.metrics[k]]) for k in a.metrics},
        np.concatenate([a.ttft, b.ttft]),
        np.concatenate([a.e2e, b.e2e]),
    )


def run_resolved(
    rollout: Rollout,
    routers: list,
    seeds: list[int],
    max_seeds: int,
    width_pct: float,
    pairs: Callable[[dict[str, Episodes]], list[tuple[str, str]]],
) -> tuple[dict[str, Episodes], list[str]]:
    """Runs `routers` on `seeds` (a contiguous range), then on further batches of as many new seeds
    continuing the range, until every paired comparison (x, baseline) in `pairs(results)` has a 95%
    CI half-width of at most `width_pct`% of the baseline's objective, or `max_seeds` seeds have
    run. Returns the results and the x of each comparison that did not resolve (in order)."""
    res = rollout.run(routers, seeds)
    step, n = len(seeds), len(seeds)

    def unresolved(res: dict[str, Episodes]) -> list[str]:
        out = []
        for x, base in pairs(res):
            _, half, _ = paired(res[x].cost, res[base].cost)
            if not half <= width_pct / 100 * abs(float(res[base].cost.mean())):
                out.append(x)
        return out

    while unresolved(res) and n < max_seeds:
        more = list(range(seeds[0] + n, seeds[0] + min(n + step, max_seeds)))
        extra = rollout.run(routers, more)
        res = {k: concat_episodes(res[k], extra[k]) for k in res}
        n += len(more)
    return res, unresolved(res)


def pooled_percentile(latency: np.ndarray, q: float, n_resamples: int = 999) -> tuple[float, float]:
    """The q-th percentile of the served requests of all seeds pooled ([S, E], NaN = not served),
    and the half-width of its 95% bootstrap CI resampling whole seeds (requests of one episode
    are correlated, seeds are independent). A per-episode p99 of a 256-request episode is about its
    third-largest sample; pooling uses every request."""
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


def plot_cdf(path: Path, scenario: str, results: dict[str, Episodes]) -> None:
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, ep in results.items():
        x = np.sort(ep.e2e[np.isfinite(ep.e2e)])
        ax.plot(x, np.arange(1, x.size + 1) / max(x.size, 1), label=name, lw=1.4)
    ax.set_xscale("log")
    ax.set_xlabel("end-to-end latency (s), served requests of all seeds")
    ax.set_ylabel("fraction of requests")
    ax.set_title(f"Latency CDF per router: {scenario}")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_share(path: Path, scenario: str, results: dict[str, Episodes]) -> None:
    names = list(results)
    share = np.array([np.mean(results[n].metrics["load_share"], axis=0) for n in names])
    fig, ax = plt.subplots(figsize=(max(7, len(names) * 0.9), 4.5))
    width = 0.8 / share.shape[1]
    for node in range(share.shape[1]):
        ax.bar(np.arange(len(names)) + node * width, share[:, node], width, label=f"node {node}")
    ax.axhline(1 / share.shape[1], color="k", lw=0.8, ls="--")
    ax.set_xticks(np.arange(len(names)) + 0.4 - width / 2, names, rotation=30, ha="right")
    ax.set_ylabel("share of routed requests")
    ax.set_title(f"Load share per node: {scenario}")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def scenario_task(
    name: str,
    settings: dict[str, Any],
    routers: list[str],
    learned: PolicyRouter | None,
    seeds: list[int],
    max_seeds: int,
    width_pct: float,
) -> tuple[dict[str, Episodes], list[str]]:
    """Every router (and the learned one) on scenario `name`, seeds added until every paired CI
    against round-robin resolves (`run_resolved`); returns the results and the unresolved routers."""
    rollout = Rollout(name, **settings)
    batch = [make_router(r, rollout.cfg.n_nodes) for r in routers] + ([learned] if learned else [])
    return run_resolved(
        rollout, batch, seeds, max_seeds, width_pct, lambda r: [(n, BASELINE) for n in r if n != BASELINE]
    )


def regime_cells(grid: dict) -> list[tuple[str, str, float, str]]:
    """The (arrivals, prefix level, load, scheduler) cells of `grid`; prefix sharing other than
    "none" only under continuous batching, the one regime with a prefix cache."""
    levels = grid.get("prefix", ("none",))
    return [
        (a, level, load, s)
        for s in grid["schedulers"]
        for a in grid["arrivals"]
        for level in levels
        if s == "continuous" or level == "none"
        for load in grid["loads"]
    ]


def cheapest(res: dict[str, Episodes], names: tuple[str, ...]) -> str:
    """The router among `names` of least mean objective."""
    return min(names, key=lambda n: res[n].cost.mean())


def skew_pairs(res: dict[str, Episodes], families: dict[str, tuple[str, ...]]) -> list[tuple[str, str]]:
    """(best router of each skew-taking family, best balancing router): the comparisons of a cell."""
    return [(cheapest(res, names), cheapest(res, BALANCING)) for names in families.values() if names]


def regime_cell(
    arrivals: str,
    level: str,
    load: float,
    scheduler: str,
    settings: dict[str, Any],
    seeds: list[int],
    learned: PolicyRouter | None,
    max_seeds: int | None = None,
    width_pct: float = 1.0,
) -> dict[str, Any]:
    """One cell of the regime map: best skew-taking router against best balancing router.

    Two mechanisms take skew: bigger batches (weighted-skew, pack-load, soonest-batch) and, where
    prompts share prefixes, cache affinity (the production routers). Each family's best is compared
    with the best balancing router by a paired difference over the same seeds; `best_skew` is the
    better of the two. The learned router, when given, is measured against the same best balancing
    router in its own columns: whether it skews is what it learned, not something to assume.
    """
    scenario, arrival_settings = ARRIVALS[arrivals]
    cell = {
        **settings,
        **arrival_settings,
        **scenarios.PREFIX_LEVELS[level],
        "load": load,
        "scheduler": scheduler,
    }
    n_nodes = scenarios.settings_for(scenario, **cell)[1].n_nodes
    # soonest-batch is join-the-shortest-queue without a batching window: only a skew router on "dynamic"
    batching = SKEWING if scheduler == "dynamic" else tuple(n for n in SKEWING if n != "soonest-batch")
    affinity = AFFINITY if level != "none" else ()
    routers = [make_router(n, n_nodes) for n in BALANCING + batching + affinity]
    if learned is not None:
        routers.append(learned)
    families = {"batching": batching, "affinity": affinity}
    res, left = run_resolved(
        Rollout(scenario, **cell),
        routers,
        seeds,
        max_seeds or len(seeds),
        width_pct,
        functools.partial(skew_pairs, families=families),
    )
    bal = cheapest(res, BALANCING)
    row: dict[str, Any] = {
        "arrivals": arrivals,
        "prefix": level,
        "load": load,
        "scheduler": scheduler,
        "best_balancing": bal,
        "seeds": int(res[bal].cost.size),
        "resolved": not left,
    }
    for family, names in families.items():
        if not names:
            row.update({f"best_{family}": None, f"{family}_vs_balancing_pct": np.nan})
            row.update({f"{family}_ci_pct": np.nan, f"{family}_significant": False})
            continue
        best = cheapest(res, names)
        d, half, pct = paired(res[best].cost, res[bal].cost)
        row[f"best_{family}"] = best
        row[f"{family}_vs_balancing_pct"] = pct
        row[f"{family}_ci_pct"] = 100 * half / res[bal].cost.mean()
        row[f"{family}_significant"] = bool(abs(d) > half)
    cost = {f: res[row[f"best_{f}"]].cost.mean() for f in families if row[f"best_{f}"]}
    mechanism = min(cost, key=cost.get)
    row["mechanism"] = mechanism
    row["best_skew"] = row[f"best_{mechanism}"]
    row["skew_vs_balancing_pct"] = row[f"{mechanism}_vs_balancing_pct"]
    row["ci_pct"] = row[f"{mechanism}_ci_pct"]
    row["significant"] = row[f"{mechanism}_significant"]
    if learned is not None:
        d, half, pct = paired(res[learned.name].cost, res[bal].cost)
        row["learned_vs_balancing_pct"] = pct
        row["learned_significant"] = bool(abs(d) > half)
        row["learned_skew_index"] = float(res[learned.name].metrics["skew_index"].mean())
    for n, ep in res.items():
        row[f"objective[{n}]"] = float(ep.cost.mean())
    return row


def regime_map(
    grid: dict,
    settings: dict[str, Any],
    seeds: list[int],
    learned: PolicyRouter | None,
    max_seeds: int | None = None,
    width_pct: float = 1.0,
    ray_address: str | None = None,
) -> pd.DataFrame:
    """Every cell of `grid` (`regime_cells`, `regime_cell`), run locally or as Ray tasks."""
    tasks = [
        dict(
            arrivals=a,
            level=lv,
            load=ld,
            scheduler=sc,
            settings=settings,
            seeds=seeds,
            learned=learned,
            max_seeds=max_seeds,
            width_pct=width_pct,
        )
        for a, lv, ld, sc in regime_cells(grid)
    ]
    return pd.DataFrame(run_tasks(regime_cell, tasks, "regime map", ray_address))


def run_tasks(
    fn: Callable[..., Any], tasks: list[dict[str, Any]], desc: str, ray_address: str | None
) -> list:
    """`[fn(**t) for t in tasks]`, in order; with `ray_address` ("local" for a Ray instance on this
    machine, else a cluster address) each call is a Ray task. Every task is seeded by its arguments,
    so both ways give the same results."""
    if ray_address is None:
        return [fn(**t) for t in tqdm(tasks, desc=desc, unit="task")]
    import ray

    if not ray.is_initialized():
        env = {"env_vars": {"XLA_PYTHON_CLIENT_PREALLOCATE": "false"}}
        address = None if ray_address == "local" else ray_address
        ray.init(address=address, runtime_env=env, include_dashboard=False, log_to_driver=False)
    remote = ray.remote(fn)
    refs = [remote.remote(**t) for t in tasks]
    pending = list(refs)
    with tqdm(total=len(refs), desc=f"{desc} (ray)", unit="task") as bar:
        while pending:
            done, pending = ray.wait(pending, num_returns=1)
            bar.update(len(done))
    return ray.get(refs)


def regime_matrix(sub: pd.DataFrame) -> tuple[list[str], list[float], np.ndarray]:
    """Rows (burstiness / prefix sharing), columns (loads) and colour values of one batching regime's
    cells: the best skew-taking router's % change against the best balancing one, NaN (no colour)
    where the paired 95% CI includes zero, so that no such cell can be read as a result."""
    labels = list(
        dict.fromkeys(f"{a} / prefix {p}" for a, p in zip(sub["arrivals"], sub["prefix"], strict=True))
    )
    loads = sorted(set(sub["load"]))
    z = np.full((len(labels), len(loads)), np.nan)
    for _, r in sub.iterrows():
        if r["significant"]:
            z[labels.index(f"{r['arrivals']} / prefix {r['prefix']}"), loads.index(r["load"])] = r[
                "skew_vs_balancing_pct"
            ]
    return labels, loads, z


def plot_regime(path: Path, df: pd.DataFrame) -> None:
    """One panel per batching regime (`regime_matrix`); cells whose CI includes zero are hatched grey."""
    schedulers = list(dict.fromkeys(df["scheduler"]))
    panels = {s: regime_matrix(df[df["scheduler"] == s]) for s in schedulers}
    height = max(3.8, 0.6 * max(len(p[0]) for p in panels.values()) + 1.5)
    fig, axes = plt.subplots(1, len(schedulers), figsize=(5.8 * len(schedulers), height), squeeze=False)
    values = np.concatenate([p[2].ravel() for p in panels.values()])
    lim = max(1.0, float(np.nanmax(np.abs(values)))) if np.isfinite(values).any() else 1.0
    im = None
    for ax, sched in zip(axes[0], schedulers, strict=True):
        labels, loads, z = panels[sched]
        for _, r in df[df["scheduler"] == sched].iterrows():
            i, j = labels.index(f"{r['arrivals']} / prefix {r['prefix']}"), loads.index(r["load"])
            pct, ci = r["skew_vs_balancing_pct"], r["ci_pct"]
            if not r["significant"]:
                hatch = plt.Rectangle((j - 0.5, i - 0.5), 1, 1, facecolor="0.85", hatch="//", edgecolor="0.6")
                ax.add_patch(hatch)
            text = f"{r['best_skew']}\n{pct:+.1f}% ±{ci:.1f}" + ("" if r["significant"] else "\nn.s.")
            dark = r["significant"] and abs(pct) > lim / 2
            ax.text(j, i, text, ha="center", va="center", fontsize=6.5, color="w" if dark else "k")
        im = ax.imshow(z, cmap="RdBu_r", vmin=-lim, vmax=lim, aspect="auto")
        ax.set_xlim(-0.5, len(loads) - 0.5)
        ax.set_ylim(len(labels) - 0.5, -0.5)
        ax.set_xticks(range(len(loads)), [f"{v:g}" for v in loads])
        ax.set_yticks(range(len(labels)), labels, fontsize=8)
        ax.set_xlabel("load (fraction of capacity)")
        ax.set_title(f"{sched} batching")
    fig.colorbar(
        im, ax=axes[0].tolist(), label="best skew-taking vs best balancing router: objective change (%)"
    )
    fig.suptitle(
        "Blue: skew pays; red: skew hurts; hatched grey: paired 95% CI includes 0 (no result)", fontsize=9
    )
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)


def markdown(df: pd.DataFrame, lines: list[str]) -> str:
    def fmt(m: float, h: float, digits: int = 3) -> str:
        return f"{m:.{digits}f} ± {h:.{digits}f}" if np.isfinite(h) else f"{m:.{digits}f}"

    out = [
        "# Router evaluation",
        "",
        "Mean ± 95% CI over seeds (common random numbers across routers). "
        "Objective: total latency + drop penalty + energy term (s), lower is better; "
        "Δ vs RR: paired difference against round-robin over the same seeds (objective; TTFT mean). "
        "Percentiles (p50, p99) pool the served requests of all seeds; their CIs are bootstrap CIs "
        'resampling seeds. "unresolved": the paired CI stayed wider than --ci-width after --max-seeds seeds.',
        "",
    ]
    for scenario, sub in df.groupby("scenario", sort=False):
        out += [
            f"## {scenario}",
            "",
            "| router | objective | Δ vs RR (paired) | TTFT mean (s) | Δ TTFT vs RR (s) | TTFT p99 (s) "
            "| e2e p50 (s) | e2e p99 (s) | SLO att. | drop rate | cache hit | J/request | skew |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for _, r in sub.iterrows():
            cells = [
                r["router"],
                fmt(r["objective"], r["objective_ci"], 1),
                f"{r['vs_rr_pct']:+.2f}% ({fmt(r['vs_rr'], r['vs_rr_ci'], 1)})"
                + ("" if r.get("resolved", True) else " unresolved"),
                fmt(r["ttft_mean"], r["ttft_mean_ci"]),
                fmt(r["ttft_mean_vs_rr"], r["ttft_mean_vs_rr_ci"]),
                *(
                    fmt(r[m], r[f"{m}_ci"])
                    for m in (
                        "ttft_p99",
                        "e2e_p50",
                        "e2e_p99",
                        "slo_attainment",
                        "drop_rate",
                        "cache_hit_rate",
                    )
                ),
                fmt(r["energy_per_request_j"], r["energy_per_request_j_ci"], 1),
                fmt(r["skew_index"], r["skew_index_ci"]),
            ]
            out.append("| " + " | ".join(cells) + " |")
        out.append("")
    out += ["## Summary", ""] + [f"- {line}" for line in lines] + [""]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--scenarios",
        nargs="+",
        default=None,
        help="default: the model's training scenario first, then every named scenario but 'trace'; "
        f"any of {', '.join(scenarios.SCENARIOS)}",
    )
    p.add_argument("--trace", action="append", default=[], help="trace file to replay (repeatable)")
    p.add_argument("--load", type=float, default=None, help="override every scenario's load")
    p.add_argument("--routers", nargs="+", default=list(ROUTERS), help=f"heuristics: {', '.join(ROUTERS)}")
    p.add_argument(
        "--model", default=None, help=f"trained model .zip (default: {DEFAULT_MODEL} if it exists)"
    )
    p.add_argument("--algo", default=None, help="algorithm of --model (default: from its config.json)")
    p.add_argument("--no-model", action="store_true", help="heuristics only")
    p.add_argument(
        "--seeds", type=int, default=10, help="episodes per router and scenario (>= 5 for the table)"
    )
    p.add_argument("--seed-base", type=int, default=10_000, help="first seed (training uses other seeds)")
    p.add_argument("--episode-length", type=int, default=None, help="default: the model's, else 256")
    p.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="other scenario settings")
    p.add_argument("--regime-grid", choices=("none", *GRIDS), default="small")
    p.add_argument(
        "--max-seeds",
        type=int,
        default=20,
        help="more seeds (batches of --seeds) until every paired CI against round-robin is at most "
        "--ci-width, up to this many; the table says 'unresolved' where it is not",
    )
    p.add_argument(
        "--ci-width", type=float, default=1.0, help="target paired 95%% CI half-width, %% of the objective"
    )
    p.add_argument("--regime-seeds", type=int, default=5)
    p.add_argument("--regime-max-seeds", type=int, default=10, help="as --max-seeds, per regime-map cell")
    p.add_argument("--regime-episode-length", type=int, default=128)
    p.add_argument(
        "--ray",
        nargs="?",
        const="local",
        default=None,
        metavar="ADDRESS",
        help="run scenarios and regime-map cells as Ray tasks: a local Ray instance, or the cluster "
        "at ADDRESS (e.g. ray://head:10001); the results equal a local run's",
    )
    p.add_argument("--device", default="cpu", help=f"torch device of --model: {', '.join(DEVICES)}")
    p.add_argument(
        "--allow-pickle",
        action="store_true",
        help="let --model unpickle what only a pickle holds (an rl-zoo3 model, statistics in a .pkl); "
        "unpickling runs any code a file carries, so only for files you trust (default: weights and "
        "statistics are read as data, the network rebuilt from the run's config.json)",
    )
    p.add_argument("--out", default="results")
    args = p.parse_args(argv)
    try:
        return evaluate(args)
    except (ValueError, FileNotFoundError) as e:
        print(f"evaluate.py: error: {e}", file=sys.stderr)
        return 2


def evaluate(args: argparse.Namespace) -> int:
    """Evaluate as `args` say; returns the exit status."""
    torch.set_num_threads(1)
    if args.seeds < 2 or args.regime_seeds < 2:
        raise ValueError("--seeds and --regime-seeds must be at least 2 for confidence intervals")
    if args.max_seeds < args.seeds or args.regime_max_seeds < args.regime_seeds:
        raise ValueError("--max-seeds must be at least --seeds, --regime-max-seeds at least --regime-seeds")
    if not args.ci_width > 0:
        raise ValueError(f"--ci-width must be positive, got {args.ci_width}")
    for name in args.routers:
        if name not in ROUTERS:
            raise ValueError(f"unknown router {name!r}; valid routers: {', '.join(ROUTERS)}")
    routers = list(dict.fromkeys([BASELINE, *args.routers]))

    default_model = DEFAULT_MODEL if DEFAULT_MODEL.is_file() else FINAL_MODEL
    model_path = None if args.no_model else Path(args.model) if args.model else default_model
    config: dict[str, Any] = {}
    if model_path is not None and not model_path.is_file():
        if args.model:
            raise FileNotFoundError(f"checkpoint {args.model!r} does not exist")
        console.print(
            f"[yellow]no trained model at {DEFAULT_MODEL} (run `python train.py`); heuristics only[/]"
        )
        model_path = None
    if model_path is not None and (found := find_config(model_path)) is not None:
        config = found[1]
    algo = args.algo or config.get("algo", "ppo")
    check_algo(algo)
    device = check_device(args.device)

    # The model's training scenario runs with every setting of its run's config.json; the other
    # scenarios keep their own, with the model's cluster size and episode length. Command-line
    # --episode-length, --set and --load override both.
    trained_settings = dict(config.get("settings", {}))
    settings = {k: v for k, v in trained_settings.items() if k in ("episode_length", "n_nodes")}
    settings.setdefault("episode_length", 256)
    overrides: dict[str, Any] = {}
    if args.episode_length is not None:
        overrides["episode_length"] = args.episode_length
    overrides.update(parse_settings(args.set))
    if args.load is not None:
        overrides["load"] = args.load
    settings.update(overrides)
    trained_settings.update(overrides)
    if args.scenarios:
        names = list(args.scenarios)
    elif args.trace:
        names = []
    else:
        first = config.get("scenario", "prefix")
        names = list(dict.fromkeys([first, *(n for n in scenarios.SCENARIOS if n != "trace")]))
    trained_name = config.get("scenario") if model_path is not None else None
    jobs = [(name, name, dict(trained_settings if name == trained_name else settings)) for name in names]
    jobs += [(f"trace:{Path(t).name}", "trace", {**settings, "trace": t}) for t in args.trace]
    n_nodes = set()
    for _, name, s in jobs:  # refuse bad scenarios, settings and traces before running anything
        cfg, _ = scenarios.make(name, **s)
        n_nodes.add(cfg.n_nodes)
    learned = None
    if model_path is not None:
        # with the observation-normalisation statistics saved beside it (vecnormalize.json)
        need = bool(config.get("normalize"))
        learned = load_router(
            model_path,
            algo,
            f"learned-{algo}",
            device,
            require_normalization=need,
            allow_pickle=args.allow_pickle,
        )
        expected = learned.observation_shape
        for n in n_nodes:
            if (obs_size(n),) != expected:
                raise ValueError(
                    f"model {model_path} expects observations of shape {expected}; a scenario has {n} nodes"
                )

    seeds = list(range(args.seed_base, args.seed_base + args.seeds))
    rows, lines, all_results = [], [], {}
    tasks = [
        dict(
            name=name,
            settings=s,
            routers=routers,
            learned=learned,
            seeds=seeds,
            max_seeds=args.max_seeds,
            width_pct=args.ci_width,
        )
        for _, name, s in jobs
    ]
    outcomes = run_tasks(scenario_task, tasks, "scenarios", args.ray)
    for (label, _, _), (res, left) in zip(jobs, outcomes, strict=True):
        all_results[label] = res
        rows += [{**row, "resolved": row["router"] not in left} for row in scenario_rows(label, res)]
        unresolved = (
            f" (unresolved after {args.max_seeds} seeds: the paired 95% CI against round-robin of "
            f"{', '.join(left)} stays wider than ±{args.ci_width:g}% of its objective)"
            if left
            else ""
        )
        lines.append(summary(label, res, learned.name if learned else None) + unresolved)
        console.print(lines[-1])

    regime = None
    if args.regime_grid != "none":
        grid_settings = {
            **{k: v for k, v in settings.items() if k not in ("load", "scheduler")},
            "episode_length": args.regime_episode_length,
        }
        rseeds = list(range(args.seed_base, args.seed_base + args.regime_seeds))
        regime = regime_map(
            GRIDS[args.regime_grid],
            grid_settings,
            rseeds,
            learned,
            args.regime_max_seeds,
            args.ci_width,
            args.ray,
        )

    df = pd.DataFrame(rows)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".partial-", dir=out))
    try:
        for label, res in all_results.items():
            safe = label.replace(":", "_").replace("/", "_")
            plot_cdf(tmp / f"latency_cdf_{safe}.png", label, res)
            plot_share(tmp / f"load_share_{safe}.png", label, res)
        if regime is not None:
            regime.to_csv(tmp / "regime_map.csv", index=False)
            plot_regime(tmp / "regime_map.png", regime)
        df.drop(columns=["load_share"]).to_csv(tmp / "results.csv", index=False)
        (tmp / "results.md").write_text(markdown(df, lines))
        meta = {
            "complete": True,
            "seeds": seeds,
            "max_seeds": args.max_seeds,
            "ci_width_pct": args.ci_width,
            "settings": settings,
            "model": str(model_path) if model_path else None,
            "algo": algo if model_path else None,
            "summary": lines,
            "rows": rows,
            "regime_map": regime.to_dict(orient="records") if regime is not None else None,
        }
        (tmp / "results.json").write_text(json.dumps(meta, indent=2, default=float))
        for f in tmp.iterdir():
            os.replace(f, out / f.name)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    console.print(markdown(df, lines))
    console.print(f"wrote {out}/results.md, results.csv, results.json and plots")
    return 0


if __name__ == "__main__":
    sys.exit(main())
