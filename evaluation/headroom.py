"""The headroom table: how much better routing can get, per scenario and per trace.

For each named scenario and each trace, every router runs on the same seeded episodes (common
random numbers) as round-robin and the `lookahead` bound (`agents.lookahead`: it forks the cluster
per node and drains it with the true output lengths). Per router:

- its gain over round-robin: the paired difference of the objective over the seeds, in % of
  round-robin's mean, with its 95% Student-t interval (positive: better than round-robin);
- its share of the lookahead's gain, `mean(RR - X) / mean(RR - lookahead)` over the same seeds,
  with its 95% Fieller interval for a ratio of paired means (Fieller, J. R. Stat. Soc. B 16, 1954):
  bounded only where the lookahead's own gain is resolved (its interval excludes zero), else
  "unbounded". 100% means as good as the bound; above 100%, better than the greedy bound, which is
  not the optimum (docs/headroom.md).

Routers: every rule of `agents.routers`, `marginal-cost` (configured with the scenario's nodes and
lengths), `predicted-latency` (llm-d's predictor, warm-started on episodes of other seeds of the
same scenario, `--warm-seed-base`), an optional learned model (`--model`), and the bound. The rules
and marginal-cost run in one compiled episode on CPU, and on an accelerator, where a group of
clusters is vmapped, in episodes grouped so that the router states their clusters carry stay
bounded (`groups`); predicted-latency and the bound, which read the cluster's state, run in their
own (on an accelerator a shared call would run every router's branch for every cluster).

    python -m evaluation.headroom --seeds 10 --episode-length 256 \\
        --trace /path/to/mooncake_synthetic_trace.jsonl --trace /path/to/azure_llm_2023_code.csv

writes `headroom.md`, `headroom.csv` and `headroom.json` into `--out` (default results/headroom), and
each case as it finishes into `--out/cases/` (`--resume` keeps those that ran with the same settings).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import multiprocessing
import os
import shlex
import sys
import time
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass
from pathlib import Path
from typing import Any

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
from scipy import stats  # noqa: E402

from agents.lookahead import Lookahead  # noqa: E402
from agents.marginal_cost import MarginalCost  # noqa: E402
from agents.predicted_latency import PredictedLatency, warm_samples  # noqa: E402
from agents.routers import ROUTERS, make_rule  # noqa: E402
from burstgym import scenarios  # noqa: E402
from burstgym.rollout import one_at_a_time, rollout  # noqa: E402
from evaluation.statistics import BASELINE, paired  # noqa: E402

NAMED = ("steady", "bursty", "bursty-dynamic", "energy", "overload", "prefix", "conversation")
BOUND = "lookahead"
TRACE_LOAD = 0.7  # the trace scenario's load (burstgym.scenarios)
GROUP_BYTES = 2**29  # router states carried by one compiled episode's clusters (see `groups`)


@dataclass(frozen=True)
class Case:
    """One column of the table: a scenario with its settings (a trace is the trace scenario)."""

    label: str
    scenario: str
    settings: tuple[tuple[str, Any], ...] = ()


def cases(named: Sequence[str], traces: Sequence[str], load: float | None) -> list[Case]:
    """The named scenarios, then one case per trace file (each refused at once if it is missing)."""
    out = []
    for name in named:
        if name not in scenarios.SCENARIOS or name == "trace":
            raise ValueError(f"unknown named scenario {name!r}; valid: {', '.join(NAMED)}")
        out.append(Case(name, name, (("load", load),) if load is not None else ()))
    for path in traces:
        if not Path(path).is_file():
            raise FileNotFoundError(f"trace file {path!r} does not exist")
        out.append(
            Case(f"trace:{Path(path).name}", "trace", (("trace", str(path)), ("load", load or TRACE_LOAD)))
        )
    return out


def fieller(a: np.ndarray, b: np.ndarray, level: float = 0.95) -> tuple[float, float, float]:
    """The ratio mean(a) / mean(b) of paired samples and its Fieller interval (lo, hi); (nan, nan)
    for the interval where mean(b) is not resolved from zero at `level` (the set is unbounded)."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    n = a.size
    ma, mb = a.mean(), b.mean()
    ratio = ma / mb if mb != 0 else float("nan")
    if n < 2:
        return ratio, float("nan"), float("nan")
    t2 = stats.t.ppf(0.5 + level / 2, n - 1) ** 2
    cov = np.cov(a, b, ddof=1) / n
    vaa, vab, vbb = cov[0, 0], cov[0, 1], cov[1, 1]
    qa = mb * mb - t2 * vbb  # > 0: the denominator's interval excludes zero
    if qa <= 0:
        return ratio, float("nan"), float("nan")
    qb = ma * mb - t2 * vab
    qc = ma * ma - t2 * vaa
    disc = max(qb * qb - qa * qc, 0.0)
    root = np.sqrt(disc)
    return ratio, (qb - root) / qa, (qb + root) / qa


def state_bytes(router: Any, n_nodes: int) -> int:
    """Bytes of one cluster's state of `router` (its `init`, shapes only)."""
    shapes = jax.eval_shape(lambda: router.init(n_nodes))
    return int(sum(np.prod(x.shape) * x.dtype.itemsize for x in jax.tree.leaves(shapes)))


def groups(
    routers: Sequence[Any], n_nodes: int, n_seeds: int, budget: float = GROUP_BYTES
) -> list[list[Any]]:
    """`routers` in consecutive groups, one compiled episode each: every cluster of a call carries
    the state of every router in it (burstgym.rollout), and a vmapped group of clusters holds all
    of theirs at once, so a group holds routers while `routers x seeds x their summed state bytes`
    stays within `budget` (a router past it alone). Only where clusters are vmapped: where the
    engine steps them one at a time (`burstgym.rollout.one_at_a_time`), one group serves."""
    sized = sorted(routers, key=lambda r: state_bytes(r, n_nodes))
    out: list[list[Any]] = []
    for r in sized:
        candidate = (out[-1] if out else []) + [r]
        total = len(candidate) * n_seeds * sum(state_bytes(x, n_nodes) for x in candidate)
        if out and total <= budget:
            out[-1] = candidate
        else:
            out.append([r])
    return out


def gain(cost: np.ndarray, base: np.ndarray) -> tuple[float, float]:
    """How much cheaper `cost` is than `base` over the same seeds, in % of `base`'s mean, and the
    half-width of its paired 95% CI in the same unit (positive: `cost` is better)."""
    _, half, pct = paired(cost, base)
    return 0.0 - pct, 100.0 * half / float(np.mean(base))


def table_rows(label: str, objective: dict[str, np.ndarray], family: dict[str, str]) -> list[dict[str, Any]]:
    """Per router of one case: objective, gain over round-robin (paired, % with its 95% CI) and share
    of the lookahead's gain (Fieller 95% interval)."""
    base = objective[BASELINE]
    bound_gain = base - objective[BOUND]
    rows = []
    for name, cost in objective.items():
        gain_pct, gain_ci_pct = gain(cost, base)
        share, lo, hi = fieller(base - cost, bound_gain)
        rows.append(
            {
                "case": label,
                "router": name,
                "family": family[name],
                "objective": float(np.mean(cost)),
                "gain_pct": gain_pct,
                "gain_ci_pct": gain_ci_pct,
                "share_pct": 100.0 * share,
                "share_lo_pct": 100.0 * lo,
                "share_hi_pct": 100.0 * hi,
                "seeds": int(cost.size),
            }
        )
    return rows


def run_case(
    case: Case,
    routers: Sequence[str],
    seeds: Sequence[int],
    warm_seeds: Sequence[int],
    episode_length: int,
    learned: Any = None,
    log=print,
) -> tuple[dict[str, np.ndarray], dict[str, str], dict[str, float]]:
    """Objectives [S] of every router on one case, their families, and the seconds each call took."""
    cfg, params = scenarios.make(case.scenario, episode_length=episode_length, **dict(case.settings))
    rules = [make_rule(name) for name in routers]
    rules.append(MarginalCost.for_scenario(cfg, params))
    if learned is not None:
        rules.append(learned)
    objective: dict[str, np.ndarray] = {}
    family: dict[str, str] = {}
    timing: dict[str, float] = {}
    n = len(seeds)

    def collect(batch, group):
        batch.check()
        for i, r in enumerate(group):
            objective[r.name] = batch.objective[i * n : (i + 1) * n]
            family[r.name] = r.family

    start = time.perf_counter()
    # Where the engine steps clusters one at a time (CPU), the states held do not grow with the
    # routers, so one compiled episode serves every rule (`prefix`, 23 rules x 10 seeds: 40 s in one
    # call against 84 s in three groups, the same objectives).
    for group in [rules] if one_at_a_time() else groups(rules, cfg.n_nodes, n):
        collect(rollout(cfg, params, group, seeds), group)
    timing["rules"] = time.perf_counter() - start
    log(f"  {case.label}: {len(rules)} routers in {timing['rules']:.0f} s")

    start = time.perf_counter()
    cold = PredictedLatency.for_scenario(cfg, params)
    warmup = rollout(cfg, params, [cold], warm_seeds, keep_router_state=True)
    warmup.check()
    predicted = cold.replace(warm=warm_samples(cfg, params, warmup, warm_seeds))
    collect(rollout(cfg, params, [predicted], seeds), [predicted])
    timing["predicted-latency"] = time.perf_counter() - start
    log(f"  {case.label}: predicted-latency (warm-up included) in {timing['predicted-latency']:.0f} s")

    start = time.perf_counter()
    bound = Lookahead(cfg)
    batch = rollout(cfg, params, [bound], seeds)
    collect(batch, [bound])
    timing[BOUND] = time.perf_counter() - start
    timing["lookahead_per_decision_s"] = batch.run_s / (n * episode_length)
    log(
        f"  {case.label}: lookahead in {timing[BOUND]:.0f} s "
        f"({1e3 * timing['lookahead_per_decision_s']:.2f} ms per decision, compile {batch.compile_s:.0f} s)"
    )
    return objective, family, timing


def against_best(label: str, objective: dict[str, np.ndarray], model: str) -> dict[str, Any]:
    """The model against the best other deployable router of one case (every router but the bound
    and the model, by mean objective) and against the best rule of `agents.routers`: paired
    differences over the seeds in % of that router's mean, with 95% CIs (positive: the model is
    better)."""
    row: dict[str, Any] = {"case": label}
    deployable = {k: v for k, v in objective.items() if k not in (model, BOUND)}
    rules = {k: v for k, v in deployable.items() if k in ROUTERS}
    for key, pool in (("best", deployable), ("best_rule", rules)):
        best = min(pool, key=lambda k: float(np.mean(pool[k])))
        row[key] = best
        row[f"{key}_gain_pct"], row[f"{key}_gain_ci_pct"] = gain(objective[model], pool[best])
    return row


def versus_markdown(model: str, rows: Sequence[dict[str, Any]]) -> str:
    """One table: per case, the model against the best other deployable router and the best rule."""
    out = [
        f"### {model} against the best other router\n",
        "Paired over the same seeds, in % of the other router's objective (positive: "
        f"{model} is better), 95% CI.\n",
        f"| case | best other deployable router | {model} vs it | best rule | {model} vs it |",
        "|---|---|---:|---|---:|",
    ]
    for r in rows:
        out.append(
            f"| {r['case']} | {r['best']} | {r['best_gain_pct']:+.2f}% ± {r['best_gain_ci_pct']:.2f} "
            f"| {r['best_rule']} | {r['best_rule_gain_pct']:+.2f}% ± {r['best_rule_gain_ci_pct']:.2f} |"
        )
    out.append("")
    return "\n".join(out)


def _share(row: dict[str, Any]) -> str:
    if row["router"] in (BASELINE, BOUND):
        return "0%" if row["router"] == BASELINE else "100%"
    if not np.isfinite(row["share_lo_pct"]):
        return f"{row['share_pct']:.0f}% (unbounded)"
    return f"{row['share_pct']:.0f}% [{row['share_lo_pct']:.0f}, {row['share_hi_pct']:.0f}]"


def markdown(df: pd.DataFrame) -> str:
    """One table per case: routers by gain, with their share of the lookahead's gain."""
    out = []
    for label, sub in df.groupby("case", sort=False):
        out.append(f"### {label}\n")
        out.append(
            "| router | family | gain over round-robin (95% CI) | share of lookahead's gain [95% CI] |"
        )
        out.append("|---|---|---:|---:|")
        for row in sub.sort_values("gain_pct", ascending=False).to_dict("records"):
            gain = f"{row['gain_pct']:+.2f}% ± {row['gain_ci_pct']:.2f}"
            out.append(f"| {row['router']} | {row['family']} | {gain} | {_share(row)} |")
        out.append("")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--scenarios", nargs="*", default=list(NAMED), help=f"named scenarios: {', '.join(NAMED)}")
    p.add_argument("--trace", action="append", default=[], help="trace file to replay (repeatable)")
    p.add_argument("--load", type=float, default=None, help="override every case's load")
    p.add_argument("--routers", nargs="+", default=list(ROUTERS), help="rules of agents.routers")
    p.add_argument("--seeds", type=int, default=10, help="episodes per router and case")
    p.add_argument("--seed-base", type=int, default=10_000, help="first evaluation seed")
    p.add_argument(
        "--warm-seed-base", type=int, default=20_000, help="first seed of predicted-latency's warm-up"
    )
    p.add_argument("--episode-length", type=int, default=256)
    p.add_argument("--model", default=None, help="a trained model to include (a JAX-runnable policy)")
    p.add_argument("--algo", default=None, help="algorithm of --model (default: from its config.json)")
    p.add_argument("--out", default="results/headroom", help="folder for headroom.{md,csv,json}")
    p.add_argument("--jobs", type=int, default=1, help="cases run at once, each in its own process")
    p.add_argument(
        "--resume",
        action="store_true",
        help="keep the cases already in --out/cases/ that ran with the same seeds, lengths and routers",
    )
    argv = sys.argv[1:] if argv is None else list(argv)
    args = p.parse_args(argv)
    args.command = shlex.join(["python", "-m", "evaluation.headroom", *argv])
    try:
        return headroom(args)
    except (ValueError, FileNotFoundError) as e:
        print(f"evaluation.headroom: error: {e}", file=sys.stderr)
        return 2


def _learned(path: str, algo: str | None) -> Any:
    from agents.learners import load_router
    from agents.rollout import jax_rule

    if algo is None:
        config = Path(path).parent / "config.json"
        if not config.is_file():
            raise FileNotFoundError(f"no --algo and no config.json beside {path!r}")
        algo = json.loads(config.read_text())["algo"]
    rule = jax_rule(load_router(path, algo))
    if rule is None:
        raise ValueError(f"model {path!r} cannot run in the JAX engine (the headroom table runs only there)")
    return rule


def _case_worker(
    case: Case,
    routers: list[str],
    seeds: list[int],
    warm_seeds: list[int],
    episode_length: int,
    model: tuple[str, str | None] | None,
) -> dict[str, Any]:
    """One case in its own process (`headroom`): objectives per router, families, seconds."""
    learned = _learned(*model) if model else None
    objective, family, timing = run_case(case, routers, seeds, warm_seeds, episode_length, learned)
    return {
        "case": case.label,
        "objective": {k: v.tolist() for k, v in objective.items()},
        "family": family,
        "seconds": timing,
    }


def case_file(folder: Path, case: Case) -> Path:
    """Where one case's result is written as it finishes (`--out/cases/`)."""
    return folder / (case.label.replace(":", "_").replace("/", "_") + ".json")


def kept(todo: Sequence[Case], settings: dict[str, Any], folder: Path) -> dict[str, dict[str, Any]]:
    """The results already in `folder` of the cases of `todo` that ran with exactly `settings`
    (seeds, warm-up seeds, episode length, routers, model) and the same case settings (`--resume`);
    a case run otherwise is run again, except one run without a model where `settings` has one:
    it is kept with `"model": None` in its settings, and `headroom` runs only the model on it."""
    out = {}
    for case in todo:
        path = case_file(folder, case)
        if not path.is_file():
            continue
        try:
            result = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: not a case's JSON ({e}); delete it to run the case again") from e
        wanted = json.loads(json.dumps({**settings, "case": dataclasses.asdict(case)}))
        if result.get("settings") == wanted or result.get("settings") == {**wanted, "model": None}:
            out[case.label] = result
            print(f"{case.label}: kept from {path}")
    return out


def _model_worker(
    case: Case, seeds: list[int], episode_length: int, model: tuple[str, str | None]
) -> dict[str, Any]:
    """The trained model alone on one case in its own process (a case kept from a run without it)."""
    learned = _learned(*model)
    cfg, params = scenarios.make(case.scenario, episode_length=episode_length, **dict(case.settings))
    start = time.perf_counter()
    batch = rollout(cfg, params, [learned], seeds)
    batch.check()
    return {
        "objective": {learned.name: batch.objective.tolist()},
        "family": {learned.name: learned.family},
        "seconds": {"model": time.perf_counter() - start},
    }


def headroom(args: argparse.Namespace) -> int:
    if args.seeds < 2:
        raise ValueError(f"--seeds must be >= 2 for an interval, got {args.seeds}")
    if args.episode_length < 1:
        raise ValueError(f"--episode-length must be >= 1, got {args.episode_length}")
    if args.jobs < 1:
        raise ValueError(f"--jobs must be >= 1, got {args.jobs}")
    unknown = [r for r in args.routers if r not in ROUTERS]
    if unknown:
        raise ValueError(f"unknown router {unknown[0]!r}; valid routers: {', '.join(ROUTERS)}")
    routers = [BASELINE] + [r for r in args.routers if r != BASELINE]
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {args.out!r} is a file")
    todo = cases(args.scenarios, args.trace, args.load)
    model = (args.model, args.algo) if args.model else None
    model_name = _learned(*model).name if model else None  # refused now, not in a worker
    seeds = list(range(args.seed_base, args.seed_base + args.seeds))
    warm_seeds = list(range(args.warm_seed_base, args.warm_seed_base + args.seeds))
    settings = {
        "seeds": seeds,
        "warm_seeds": warm_seeds,
        "episode_length": args.episode_length,
        "routers": routers,
        "model": args.model,
    }
    done_dir = out / "cases"
    done_dir.mkdir(parents=True, exist_ok=True)

    results = kept(todo, settings, done_dir) if args.resume else {}
    # Each case runs in a fresh process (spawned, one case each), so compiled programs and caches
    # never pile up across cases; --jobs runs several at once.
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=args.jobs, mp_context=context, max_tasks_per_child=1) as pool:
        futures = {
            pool.submit(_case_worker, case, routers, seeds, warm_seeds, args.episode_length, model): case
            for case in todo
            if case.label not in results
        }
        futures |= {
            pool.submit(_model_worker, case, seeds, args.episode_length, model): case
            for case in todo
            if model and case.label in results and results[case.label]["settings"]["model"] is None
        }
        for future in as_completed(futures):
            case, new = futures[future], future.result()
            if case.label in results:  # the model added to a kept case
                old = results[case.label]
                new = {
                    "case": case.label,
                    **{k: {**old[k], **new[k]} for k in ("objective", "family", "seconds")},
                }
            result = {**new, "settings": {**settings, "case": dataclasses.asdict(case)}}
            # Written whole or not at all, so an interrupted run leaves no half-written case.
            partial = case_file(done_dir, case).with_suffix(".partial")
            partial.write_text(json.dumps(result, indent=1))
            partial.replace(case_file(done_dir, case))
            results[case.label] = result
            print(f"{case.label}: done, written to {case_file(done_dir, case)}", flush=True)
    rows, versus = [], []
    for case in todo:
        r = results[case.label]
        objective = {k: np.asarray(v) for k, v in r["objective"].items()}
        rows += table_rows(case.label, objective, r["family"])
        if model_name:
            versus.append(against_best(case.label, objective, model_name))
    df = pd.DataFrame(rows)
    df.to_csv(out / "headroom.csv", index=False)
    text = markdown(df) + (versus_markdown(model_name, versus) if model_name else "")
    (out / "headroom.md").write_text(text)
    record = {
        "command": args.command,
        **settings,
        "seconds": {label: r["seconds"] for label, r in results.items()},
        "rows": json.loads(df.to_json(orient="records")),
        "model_versus_best": versus,
    }
    (out / "headroom.json").write_text(json.dumps(record, indent=1))
    print(text)
    print(f"written to {out}/headroom.{{md,csv,json}}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
