"""Evaluate routers: trained checkpoints and every router, on scenarios or trace files, over
seeded episodes shared by all routers (common random numbers).

    python evaluate.py              # the default model vs the leading routers on every named scenario
    python evaluate.py --routers all --max-seeds 20   # every router, more seeds where CIs stay wide
    python evaluate.py --scenarios prefix conversation --routers round-robin least-tokens sglang-cache-aware
    python evaluate.py --trace path/to/mooncake_trace.jsonl --load 0.7
    python evaluate.py --trace path/to/AzureLLMInferenceTrace_code.csv --load 0.7
    python evaluate.py --model runs/bursty-dynamic-ppo-seed1/model.zip --regime-grid large
    python evaluate.py --mixture-draws 8     # 8 clusters and workloads drawn from burstgym.mixture
    python evaluate.py --no-model --scenarios prefix --cache-view both   # own index and engine cache

The objective is minus the episode's summed rewards times `reward_scale` (for the default latency
objective: total end-to-end latency + drop penalty + energy term, in seconds; lower is better).
Every metric is reported as a mean over seeds with a 95% Student-t confidence interval; the
change against round-robin is also given as a paired difference over the same seeds, the fair
comparison. `--out` (default `results/`) is checked before any work and written whole once
everything has been computed, replacing an earlier evaluation's folder: `results.md`,
`results.csv`, `results.json` (with the run that wrote them), `latency_cdf_<scenario>.png`,
`load_share_<scenario>.png`, `regime_map.png` and `regime_map.csv`.

The parts are modules of `evaluation/`: statistics, experiments (scenarios until the paired
intervals resolve, the regime map, Ray dispatch), plots and the report.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import pandas as pd  # noqa: E402
import torch  # noqa: E402
from rich.console import Console  # noqa: E402

from agents.cli import parse_settings  # noqa: E402
from agents.learners import DEVICES, check_algo, check_device, load_router  # noqa: E402
from agents.routers import ROUTERS, SCENARIO_ROUTERS  # noqa: E402
from agents.runs import find_config  # noqa: E402
from burstgym import mixture, scenarios  # noqa: E402
from burstgym.observation import obs_size  # noqa: E402
from evaluation.experiments import GRIDS, regime_map, run_tasks, scenario_task  # noqa: E402
from evaluation.plots import plot_cdf, plot_regime, plot_share  # noqa: E402
from evaluation.report import ResultsFolder, markdown  # noqa: E402
from evaluation.statistics import BASELINE, scenario_rows, summary  # noqa: E402

# The checkpoint train.py kept as best on its held-out seeds (5000+); evaluation seeds (10000+) differ,
# so this is model selection on validation data, as rl-zoo3's best_model, not on the test episodes.
DEFAULT_MODEL = Path("runs/mixture-ppo-seed0/best_model.zip")
FINAL_MODEL = DEFAULT_MODEL.with_name("model.zip")  # used when training kept no best model (--eval-every 0)
CACHE_VIEWS = ("router", "engine", "both")
EVAL_MIXTURE_SEED = 10_000  # --mixture-draws: train.py draws with its run seed, held-out with 5000
ALL_ROUTERS = (*ROUTERS, *SCENARIO_ROUTERS)  # the rules, then marginal-cost
# The default comparison (every router takes about an hour on 2 cores): the baseline, the best
# balancing rule, the claim's batching skew, the production affinity rules that lead on the
# headroom table (docs/headroom.md) and the model-based router.
DEFAULT_ROUTERS = (
    "round-robin",
    "least-tokens",
    "weighted-skew",
    "sglang-cache-aware",
    "llm-d",
    "dynamo-kv",
    "lmetric",
    "marginal-cost",
)
console = Console()


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
    p.add_argument(
        "--mixture-draws",
        type=int,
        default=0,
        help="also evaluate on this many groups drawn from burstgym.mixture's distribution, with "
        "--mixture-seed (refused where it draws a group the model trained on)",
    )
    p.add_argument("--mixture-seed", type=int, default=EVAL_MIXTURE_SEED, help="seed of the draws")
    p.add_argument("--load", type=float, default=None, help="override every scenario's load")
    p.add_argument(
        "--routers",
        nargs="+",
        default=list(DEFAULT_ROUTERS),
        help=f"routers, or 'all' for every one (default: {' '.join(DEFAULT_ROUTERS)}); "
        f"any of {', '.join(ALL_ROUTERS)}",
    )
    p.add_argument(
        "--cache-view",
        choices=CACHE_VIEWS,
        default="router",
        help="which cache a prefix-aware router reads: the index its real counterpart keeps (router), "
        "the engines' exact cache (engine: named <router>@engine), or both side by side",
    )
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
        default=10,
        help="more seeds (batches of --seeds) until every paired CI against round-robin is at most "
        "--ci-width, up to this many; the table says 'unresolved' where it is not (default 10: "
        "--seeds only)",
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
    p.add_argument("--out", default="results", help="results folder, replaced whole by this run's")
    args = p.parse_args(argv)
    try:
        return evaluate(args)
    except (ValueError, FileNotFoundError) as e:
        print(f"evaluate.py: error: {e}", file=sys.stderr)
        return 2


def router_names(requested: list[str]) -> list[str]:
    """The routers to run: round-robin first, then `requested` (`all`: every router) once each;
    an unknown name is refused."""
    names = list(ALL_ROUTERS) if requested == ["all"] else requested
    for name in names:
        if name not in ALL_ROUTERS:
            raise ValueError(f"unknown router {name!r}; valid routers: all, {', '.join(ALL_ROUTERS)}")
    return list(dict.fromkeys([BASELINE, *names]))


def evaluate(args: argparse.Namespace) -> int:
    """Evaluate as `args` say; returns the exit status."""
    torch.set_num_threads(1)
    if args.seeds < 2 or args.regime_seeds < 2:
        raise ValueError("--seeds and --regime-seeds must be at least 2 for confidence intervals")
    if args.max_seeds < args.seeds or args.regime_max_seeds < args.regime_seeds:
        raise ValueError("--max-seeds must be at least --seeds, --regime-max-seeds at least --regime-seeds")
    if not args.ci_width > 0:
        raise ValueError(f"--ci-width must be positive, got {args.ci_width}")
    names = router_names(args.routers)
    routers = router_specs(names, args.cache_view)
    results = ResultsFolder(args.out)  # refused now, not after the work
    try:
        return _evaluate(args, names, routers, results)
    except BaseException:
        results.discard()
        raise


def router_specs(names: list[str], cache_view: str) -> list[Any]:
    """The routers to run: each name, or its variant reading the engines' cache (`--cache-view`)."""
    specs: list[Any] = []
    for name in names:
        own_index = name in ROUTERS and getattr(ROUTERS[name], "index", None) is not None
        if cache_view != "engine" or not own_index:
            specs.append(name)
        if cache_view in ("engine", "both") and own_index:
            specs.append((name, {"cache_view": "engine"}))
    return specs


def _evaluate(args: argparse.Namespace, names: list[str], routers: list[Any], results: ResultsFolder) -> int:

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
        scenario_names = list(args.scenarios)
    elif args.trace or args.mixture_draws:
        scenario_names = []
    else:
        first = config.get("scenario", "prefix")
        scenario_names = list(dict.fromkeys([first, *(n for n in scenarios.SCENARIOS if n != "trace")]))
    trained_name = config.get("scenario") if model_path is not None else None
    jobs = [(n, n, dict(trained_settings if n == trained_name else settings)) for n in scenario_names]
    jobs += [(f"trace:{Path(t).name}", "trace", {**settings, "trace": t}) for t in args.trace]
    if args.mixture_draws < 0:
        raise ValueError(f"--mixture-draws must be >= 0, got {args.mixture_draws}")
    if args.mixture_draws:
        mixture.check_undrawn(overrides, "--mixture-draws")
        n = scenarios.settings_for(mixture.BASE, **settings)[1].n_nodes
        draws = mixture.draw(args.mixture_seed, args.mixture_draws, n)
        seen = (config.get("mixture") or {}).get("groups", []) if model_path is not None else []
        if any(g in seen for g in draws):
            raise ValueError(
                f"--mixture-seed {args.mixture_seed} draws groups the model trained on; pick another"
            )
        jobs += [(f"mixture:{i}", mixture.BASE, {**settings, **g}) for i, g in enumerate(draws)]
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
            routers=names,
        )

    df = pd.DataFrame(rows)
    for label, res in all_results.items():
        safe = label.replace(":", "_").replace("/", "_")
        plot_cdf(results.path(f"latency_cdf_{safe}.png"), label, res)
        plot_share(results.path(f"load_share_{safe}.png"), label, res)
    if regime is not None:
        regime.to_csv(results.path("regime_map.csv"), index=False)
        plot_regime(results.path("regime_map.png"), regime)
    df.drop(columns=["load_share"]).to_csv(results.path("results.csv"), index=False)
    results.path("results.md").write_text(markdown(df, lines, results.finish()))
    record = {
        "complete": True,
        "seeds": seeds,
        "max_seeds": args.max_seeds,
        "ci_width_pct": args.ci_width,
        "cache_view": args.cache_view,
        "settings": settings,
        "model": str(model_path) if model_path else None,
        "algo": algo if model_path else None,
        "summary": lines,
        "rows": rows,
        "regime_map": regime.to_dict(orient="records") if regime is not None else None,
    }
    run = results.publish(record)
    console.print(markdown(df, lines, run))
    console.print(f"wrote {results.out}/results.md, results.csv, results.json and plots (run {run['id']})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
