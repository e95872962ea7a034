"""Experiments: routers on scenarios over seeded episodes until the paired comparisons resolve, the
regime map, and the dispatch of tasks (locally, or as Ray tasks on a machine or a cluster).

The regime map asks where taking skew pays: in each cell (burstiness x prefix sharing x load x
batching regime) the best router of each skew-taking family (batching: bigger batches or sleep;
affinity: prefix-cache hits, only where prompts share prefixes) is compared with the best balancing
router by a paired difference over the same seeds. Families are read from the routers
(`burstgym.routing`), never from a list of names.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
from tqdm import tqdm

from agents.rollout import Episodes, Rollout
from agents.routers import ROUTERS, BatchedRouter, make_router, scenario_rule
from burstgym import scenarios
from burstgym.routing import takes_part
from burstgym.types import EnvConfig, EnvParams
from evaluation.statistics import BASELINE, paired

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
SKEW_FAMILIES = ("batching", "affinity")


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


RouterSpec = str | tuple[str, dict[str, Any]]  # a router's name, or its name and parameters


def build(spec: RouterSpec, cfg: EnvConfig, params: EnvParams) -> Any:
    """The batched router a spec names (`agents.routers.scenario_rule`) for the scenario `cfg`, `params`."""
    name, options = (spec, {}) if isinstance(spec, str) else spec
    return BatchedRouter(scenario_rule(name, cfg, params, **options), cfg.n_nodes)


def scenario_task(
    name: str,
    settings: dict[str, Any],
    routers: list[RouterSpec],
    learned: Any,
    seeds: list[int],
    max_seeds: int,
    width_pct: float,
) -> tuple[dict[str, Episodes], list[str]]:
    """Every router (and the learned one) on scenario `name`, seeds added until every paired CI
    against round-robin resolves (`run_resolved`); returns the results and the unresolved routers.
    Routers are specs (`build`), so that a task can travel to a Ray worker."""
    rollout = Rollout(name, **settings)
    batch = [build(r, rollout.cfg, rollout.params) for r in routers] + ([learned] if learned else [])
    return run_resolved(
        rollout, batch, seeds, max_seeds, width_pct, lambda r: [(x, BASELINE) for x in r if x != BASELINE]
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


def cheapest(res: dict[str, Episodes], names: Sequence[str]) -> str:
    """The router among `names` of least mean objective."""
    return min(names, key=lambda n: res[n].cost.mean())


def families(routers: Sequence[str], scheduler: str, level: str) -> dict[str, tuple[str, ...]]:
    """The routers of each family that take part in a cell: balancing, batching (under the
    regimes each declares) and affinity (only where prompts share prefixes), by their `family`."""
    out = {}
    for family in ("balancing", *SKEW_FAMILIES):
        names = [
            n
            for n in routers
            if n in ROUTERS and ROUTERS[n].family == family and takes_part(ROUTERS[n], scheduler)
        ]
        out[family] = tuple(names) if family != "affinity" or level != "none" else ()
    return out


def skew_pairs(res: dict[str, Episodes], groups: dict[str, tuple[str, ...]]) -> list[tuple[str, str]]:
    """(best router of each skew-taking family, best balancing router): the comparisons of a cell."""
    bal = cheapest(res, groups["balancing"])
    return [(cheapest(res, groups[f]), bal) for f in SKEW_FAMILIES if groups[f]]


def regime_cell(
    arrivals: str,
    level: str,
    load: float,
    scheduler: str,
    settings: dict[str, Any],
    seeds: list[int],
    learned: Any,
    max_seeds: int | None = None,
    width_pct: float = 1.0,
    routers: Sequence[str] = tuple(ROUTERS),
) -> dict[str, Any]:
    """One cell of the regime map: the best router of each skew-taking family against the best
    balancing router (`families`), paired over the same seeds; `best_skew` is the better of the
    two. The learned router, when given, is measured against the same best balancing router in its
    own columns: whether it skews is what it learned, not something to assume."""
    scenario, arrival_settings = ARRIVALS[arrivals]
    cell = {
        **settings,
        **arrival_settings,
        **scenarios.PREFIX_LEVELS[level],
        "load": load,
        "scheduler": scheduler,
    }
    n_nodes = scenarios.settings_for(scenario, **cell)[1].n_nodes
    groups = families(list(dict.fromkeys([BASELINE, *routers])), scheduler, level)
    batch = [make_router(n, n_nodes) for names in groups.values() for n in names]
    if learned is not None:
        batch.append(learned)
    res, left = run_resolved(
        Rollout(scenario, **cell),
        batch,
        seeds,
        max_seeds or len(seeds),
        width_pct,
        functools.partial(skew_pairs, groups=groups),
    )
    bal = cheapest(res, groups["balancing"])
    row: dict[str, Any] = {
        "arrivals": arrivals,
        "prefix": level,
        "load": load,
        "scheduler": scheduler,
        "best_balancing": bal,
        "seeds": int(res[bal].cost.size),
        "resolved": not left,
    }
    for family in SKEW_FAMILIES:
        names = groups[family]
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
    cost = {f: res[row[f"best_{f}"]].cost.mean() for f in SKEW_FAMILIES if row[f"best_{f}"]}
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
    learned: Any,
    max_seeds: int | None = None,
    width_pct: float = 1.0,
    ray_address: str | None = None,
    routers: Sequence[str] = tuple(ROUTERS),
):
    """Every cell of `grid` (`regime_cells`, `regime_cell`), run locally or as Ray tasks; a
    DataFrame with one row per cell."""
    import pandas as pd

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
            routers=tuple(routers),
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
