"""Train a router on a burstgym scenario, with Stable-Baselines3 or the JAX learner (--algo jax-ppo):
the same network (`agents.model`), warm start, held-out evaluation and run directory either way.

    python train.py                                   # PPO across 8 drawn clusters and workloads (mixture)
    python train.py --scenario prefix                 # PPO on "prefix" alone (shared prefixes)
    python train.py --scenario bursty-dynamic --algo ppo --timesteps 2000000 --n-envs 512 --seed 1
    python train.py --resume runs/mixture-ppo-seed0/checkpoints/rl_model_32768_steps.zip --timesteps 100000
    tensorboard --logdir runs

By default the SB3 learners train one router across `--mixture-groups` (8) groups of clusters and
workloads drawn from `burstgym.mixture` (`--scenario mixture`); the JAX learner, which steps one
configuration, trains on the hyperparameter file's scenario. Hyperparameters (and the defaults of
--timesteps, --n-envs, --episode-length, and jax-ppo's --scenario) come from the algorithm's
rl-zoo3-format file, `agents/hyperparams.yml` for PPO (--conf-file to use another). Writes
`runs/<scenario>-<algo>-seed<seed>/` (`mixture-ppo-seed0` by default): `config.json` (written
when the run starts with everything a resumed run needs, updated at every checkpoint and at the end, with its
status), `model.zip` (the final model), `best_model.zip` (the best on the held-out evaluation),
the observation-normalisation statistics of each as JSON (`vecnormalize.json`,
`best_model_vecnormalize.json`), `checkpoints/` (models and their statistics, at least every tenth
of the budget), and TensorBoard logs in `tb/` with SB3's curves, serving metrics of training
episodes (`serving/...`), a periodic evaluation against round-robin on held-out seeds
(`eval/..._deterministic`, `eval/..._stochastic`) and a custom-scalars layout that puts serving
metrics beside the learning curves.

A run directory that already holds anything is never written into: the run is refused (pick
another --run-name or --seed, or --resume it). SIGINT (Ctrl-C) or SIGTERM stops training at the
next step and saves the model, its statistics and config.json (status "interrupted"); a second
one stops at once without saving.

--resume continues a checkpoint in a new run directory (`<old run>-resumed`, or --run-name) with
the algorithm, scenario, settings, seed, clusters and hyperparameters of the `config.json` of
the run it belongs to (refused if there is none); the old run is not touched. Models load
without unpickling (see `agents.learners.load_model`); --allow-pickle loads a checkpoint or
statistics that only a pickle can hold.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import numpy as np  # noqa: E402
import torch  # noqa: E402
from stable_baselines3.common.callbacks import BaseCallback, CallbackList  # noqa: E402
from stable_baselines3.common.logger import TensorBoardOutputFormat  # noqa: E402

from agents.cli import parse_settings  # noqa: E402
from agents.hyperparams import conf_file, load, normalize_kwargs  # noqa: E402
from agents.learners import (  # noqa: E402
    ALGOS,
    DEVICES,
    JAX_ALGOS,
    PolicyRouter,
    behaviour_clone,
    check_algo,
    check_device,
    load_model,
    load_normalization,
    make_model,
    normalize_env,
    save_normalization,
    statistics_path,
    vecnormalize_path,
)
from agents.policies import NODE_SCORING  # noqa: E402
from agents.rollout import Rollout  # noqa: E402
from agents.routers import BatchedRouter, GroupedRouter, make_router  # noqa: E402
from agents.runs import (  # noqa: E402
    Checkpoints,
    Run,
    StopOnSignal,
    Stopped,
    atomic,
    check_run_dir,
    resume_config,
    resumed_dir,
)
from agents.sb3_vec_env import JaxVecEnv, MixtureVecEnv  # noqa: E402
from agents.warm_start import BC_BATCH, BC_EPOCHS, TEACHERS  # noqa: E402
from agents.warm_start import teacher as make_teacher  # noqa: E402
from burstgym import mixture, scenarios  # noqa: E402

SERVING_TAGS = (
    "ttft_mean",
    "cache_hit_rate",
    "e2e_mean",
    "e2e_p50",
    "e2e_p99",
    "ttft_p50",
    "ttft_p99",
    "tpot_p50",
    "slo_attainment",
    "drops",
    "drop_rate",
    "energy_per_request_j",
    "skew_index",
    "throughput_rps",
)
EVAL_SEED_BASE = 5_000  # held-out evaluation seeds; evaluate.py uses another range
MODES = ("deterministic", "stochastic")
HELD_OUT_GROUPS = 4  # default --mixture-held-out: groups drawn apart from the training groups
# TensorBoard custom-scalars layout (Custom Scalars tab): serving metrics beside learning curves.
LAYOUT = {
    "serving beside learning": {
        "training episode return": ["Multiline", [r"rollout/ep_rew_mean"]],
        "held-out objective (learned argmax, sampled; round-robin)": ["Multiline", [r"eval/objective_.*"]],
        "held-out change vs round-robin (%)": ["Multiline", [r"eval/change_vs_round_robin_pct_.*"]],
        "held-out e2e p99 (s)": ["Multiline", [r"eval/e2e_p99_.*"]],
        "training e2e and TTFT p50 / p99 (s)": ["Multiline", [r"serving/(e2e|ttft)_p(50|99)"]],
        "SLO attainment and drop rate": ["Multiline", [r"serving/slo_attainment", r"serving/drop_rate"]],
        "prefix-cache hit rate": ["Multiline", [r"serving/cache_hit_rate"]],
        "skew index (training, held-out)": ["Multiline", [r"serving/skew_index", r"eval/skew_index_.*"]],
        "load share per node": ["Multiline", [r"serving/load_share_node\d+"]],
        "critic explained variance": ["Multiline", [r"train/explained_variance", r"bc/value_.*"]],
    },
    "PPO diagnostics": {
        "approximate KL and clip fraction": ["Multiline", [r"train/approx_kl", r"train/clip_fraction"]],
        "losses": ["Multiline", [r"train/(loss|value_loss|policy_gradient_loss)"]],
        "entropy": ["Multiline", [r"train/entropy_loss"]],
        "learning rate": ["Multiline", [r"train/learning_rate"]],
    },
}


class TrainingStartCallback(BaseCallback):
    """At the start of SB3's training: the custom-scalars layout (once) and `records` (the warm
    start's results; SB3's logger exists only from here on)."""

    def __init__(self, records: dict[str, float]):
        super().__init__()
        self.records = records

    def _on_training_start(self) -> None:
        for fmt in self.logger.output_formats:
            if isinstance(fmt, TensorBoardOutputFormat):
                fmt.writer.add_custom_scalars(LAYOUT)
                fmt.writer.flush()
        for key, value in self.records.items():
            self.logger.record(key, value)

    def _on_step(self) -> bool:
        return True


class ServingMetricsCallback(BaseCallback):
    """Serving metrics of training episodes (`serving/...`): the mean over the episodes that
    finished since the last dump (one rollout for PPO), each episode weighing the same."""

    def _on_step(self) -> bool:
        for info in self.locals["infos"]:
            m = info.get("metrics")
            if m is None:
                continue
            for tag in SERVING_TAGS:
                self.logger.record_mean(f"serving/{tag}", float(m[tag]))
            for node, value in enumerate(m["load_share"]):
                self.logger.record_mean(f"serving/load_share_node{node}", float(value))
        return True


class AfterStepCallback(BaseCallback):
    """`after_step` (train's evaluations and checkpoints) after every step; ends `learn` at the
    next step once SIGINT or SIGTERM arrived (`StopOnSignal`)."""

    def __init__(self, after_step: Callable[[], None], stop: StopOnSignal):
        super().__init__()
        self.after_step, self.stop = after_step, stop

    def _on_step(self) -> bool:
        self.after_step()
        return self.stop.signal is None


class SB3Learner:
    """An SB3 model on its vector env, as `train` drives a learner: `warm_start`, `learn` (SB3's
    loop, with `after_step` called after every environment step), `router`, `log`, `save`."""

    suffix = "zip"

    def __init__(self, run: Run, args: argparse.Namespace, old: dict[str, Any]):
        cfg = run.config
        if cfg.get("mixture"):
            env = MixtureVecEnv(
                cfg["n_envs"],
                cfg["mixture"]["groups"],
                cfg["scenario"],
                seed=cfg["seed"],
                stagger=cfg["stagger"],
                **cfg["settings"],
            )
        else:
            env = JaxVecEnv(
                cfg["n_envs"], cfg["scenario"], seed=cfg["seed"], stagger=cfg["stagger"], **cfg["settings"]
            )
        if args.resume:
            stats = vecnormalize_path(args.resume)
            if stats is None and old.get("normalize"):
                raise FileNotFoundError(
                    f"checkpoint {args.resume!r} has no normalisation statistics beside it"
                )
            if stats is not None:
                env = load_normalization(stats, env, training=True, allow_pickle=args.allow_pickle)
            self.model = load_model(
                args.resume,
                run.algo,
                env=env,
                device=cfg["device"],
                config=old,
                allow_pickle=args.allow_pickle,
            )
            self.model.set_random_seed(cfg["seed"])
            self.model.tensorboard_log = str(run.dir / "tb")
        else:
            env = normalize_env(env, normalize_kwargs(cfg["hyperparams"]))
            self.model = make_model(
                run.algo,
                env,
                cfg["scenario"],
                cfg["seed"],
                str(run.dir / "tb"),
                device=cfg["device"],
                entry=cfg["hyperparams"],
            )
        self.env, self.resumed, self.learning = env, bool(args.resume), False
        self.algo, self.timesteps = run.algo, cfg["timesteps_planned"]

    @property
    def num_timesteps(self) -> int:
        """Environment steps trained so far (a resumed run's included)."""
        return int(self.model.num_timesteps)

    def warm_start(self, teacher: str, steps: int) -> dict[str, float]:
        """Behaviour cloning of the router `teacher` (`agents.learners.behaviour_clone`), built
        for each group's parameters in a mixture."""
        env = self.env.unwrapped
        subs = env.subs if isinstance(env, MixtureVecEnv) else [env]
        routers = [  # main() refuses the lookahead here
            BatchedRouter(make_teacher(teacher, e.venv.cfg, e.venv.params), e.n_nodes) for e in subs
        ]
        rule = routers[0] if len(routers) == 1 else GroupedRouter(routers, [e.num_envs for e in subs])
        return behaviour_clone(self.model, self.env, rule, steps)

    def learn(
        self, after_step: Callable[[], None], stop: StopOnSignal, records: dict[str, float], progress: bool
    ) -> dict[str, Any]:
        """SB3's `learn` for the planned steps, `records` logged at its start; returns nothing
        more for config.json."""
        callbacks = [
            TrainingStartCallback(records),
            ServingMetricsCallback(),
            AfterStepCallback(after_step, stop),
        ]
        self.learning = True
        self.model.learn(
            self.timesteps,
            callback=CallbackList(callbacks),
            progress_bar=progress,
            reset_num_timesteps=not self.resumed,
            tb_log_name=self.algo,
        )
        self.learning = False
        return {}

    def router(self, name: str, deterministic: bool) -> PolicyRouter:
        """The current policy as a router (with the live normalisation statistics)."""
        return PolicyRouter(self.model, name, deterministic, self.model.get_vec_normalize_env())

    def log(self, records: dict[str, float]) -> None:
        """Record `records` in SB3's log (written with the next rollout's, or now after `learn`)."""
        for key, value in records.items():
            self.model.logger.record(key, value)
        if not self.learning:
            self.model.logger.dump(self.num_timesteps)

    def save(self, path: Path) -> None:
        """The model (atomically) and its normalisation statistics as JSON beside it, named as
        `agents.learners.vecnormalize_path` finds them."""
        with atomic(path) as tmp:
            self.model.save(tmp)
        norm = self.model.get_vec_normalize_env()
        if norm is not None:
            save_normalization(norm, statistics_path(path))

    def close(self) -> None:
        """Close the vector env."""
        self.env.close()


class JaxLearner:
    """The JAX learner (`agents.jax_ppo.JaxPPO`) as `train` drives a learner (`SB3Learner`'s
    methods): its own loop of jitted updates, TensorBoard written by a SummaryWriter, checkpoints
    that hold their observation statistics and optimiser state (so --resume continues them)."""

    suffix = "msgpack"

    def __init__(self, run: Run, args: argparse.Namespace, old: dict[str, Any]):
        from agents.jax_ppo import JaxPPO, PPOConfig, load_checkpoint

        cfg = run.config
        env_cfg, params = scenarios.make(cfg["scenario"], **cfg["settings"])
        self.ppo = PPOConfig.from_entry(cfg["hyperparams"], cfg["conf_file"])
        self.learner = JaxPPO(
            env_cfg, params, self.ppo, cfg["n_envs"], cfg["timesteps_planned"], stagger=cfg["stagger"]
        )
        self.learner.setup(cfg["seed"], resume=load_checkpoint(args.resume) if args.resume else None)
        self.tb = run.dir / "tb" / f"{run.algo}_1"
        self.writer: Any = None

    @property
    def num_timesteps(self) -> int:
        """Environment steps trained so far (a resumed run's included)."""
        return int(self.learner.num_timesteps)

    def warm_start(self, teacher: str, steps: int) -> dict[str, float]:
        """Behaviour cloning of the router `teacher` inside the jitted clusters (`JaxPPO.warm_start`)."""
        rule = make_teacher(teacher, self.learner.cfg, self.learner.params)
        return self.learner.warm_start(rule, steps, BC_EPOCHS, BC_BATCH)

    def learn(
        self, after_step: Callable[[], None], stop: StopOnSignal, records: dict[str, float], progress: bool
    ) -> dict[str, Any]:
        """The planned updates, each logged, `after_step` after each; `records` logged first.
        Returns the rates for config.json: the backend, the compile time (the first update's) and
        the steps per second of the compiled updates (rollout and optimisation; evaluations and
        saving apart)."""
        import jax
        from torch.utils.tensorboard import SummaryWriter
        from tqdm import tqdm

        learner, batch = self.learner, self.learner.n_envs * self.ppo.n_steps
        self.writer = SummaryWriter(str(self.tb))
        self.writer.add_custom_scalars(LAYOUT)
        self.log(records)
        start, start_steps, compile_s, update_s, updates = time.time(), learner.num_timesteps, 0.0, 0.0, 0
        bar = tqdm(total=learner.n_updates * batch, disable=not progress, unit="step")
        for k in range(learner.n_updates):
            if stop.signal:
                break
            t0 = time.time()
            logs = learner.update()
            updates += 1
            if k == 0:
                compile_s = time.time() - t0  # the first call compiles the update
            else:
                update_s += time.time() - t0
            logs["time/fps"] = (learner.num_timesteps - start_steps) / (time.time() - start)
            self.log(logs)
            bar.update(batch)
            after_step()
        bar.close()
        steady = (updates - 1) * batch / max(update_s, 1e-9)
        return {
            "device": jax.default_backend(),
            "steps_per_second_compiled": round(steady, 1) if updates > 1 else None,
            "compile_seconds": round(compile_s, 1),
        }

    def router(self, name: str, deterministic: bool) -> Any:
        """The current policy as a router (a snapshot)."""
        return self.learner.router(name, deterministic)

    def log(self, records: dict[str, float]) -> None:
        """Write `records` to TensorBoard at the current step."""
        for key, value in records.items():
            self.writer.add_scalar(key, value, self.learner.num_timesteps)

    def save(self, path: Path) -> None:
        """A checkpoint with the statistics and optimiser state (`JaxPPO.save`)."""
        self.learner.save(path)

    def close(self) -> None:
        """Close the TensorBoard writer."""
        if self.writer is not None:
            self.writer.close()


class HeldOut:
    """A learned policy (argmax and sampled actions) against round-robin on the same held-out seeds
    (`eval/...`), due every `every` steps from `start`; the best argmax policy so far is saved to
    `best` (model selection on held-out seeds, as rl-zoo3's best_model)."""

    def __init__(
        self,
        scenario: str,
        settings: dict[str, Any],
        n_seeds: int,
        every: int,
        start: int,
        best: Path,
        groups: list[dict[str, Any]] | None = None,
    ):
        # A mixture run is evaluated on its held-out groups, the seeds dealt out among them.
        groups = groups or [{}]
        seeds = list(range(EVAL_SEED_BASE, EVAL_SEED_BASE + max(n_seeds, len(groups))))
        self.rollouts = [
            (Rollout(scenario, **{**settings, **g}), seeds[i :: len(groups)]) for i, g in enumerate(groups)
        ]
        self.baseline = make_router("round-robin", self.rollouts[0][0].cfg.n_nodes)
        self.every, self.next_at, self.best, self.best_cost = every, start + every, best, float("inf")
        self.last: tuple[int, dict[str, float]] | None = None  # (steps, records) of the latest

    def due(self, steps: int) -> bool:
        """Whether an evaluation is due at `steps` (then the next one is `every` steps later)."""
        if steps < self.next_at:
            return False
        self.next_at += self.every
        return True

    def evaluate(self, learner: SB3Learner | JaxLearner) -> dict[str, float]:
        """Evaluate `learner`'s current policy now (at most once per step count), log the records
        and save the policy if it is the best so far; returns the records."""
        steps = learner.num_timesteps
        if self.last is not None and self.last[0] == steps:
            return self.last[1]
        out = self.run({m: learner.router(f"learned-{m}", m == "deterministic") for m in MODES})
        learner.log(out)
        if out["eval/objective_learned_deterministic"] < self.best_cost:
            self.best_cost = out["eval/objective_learned_deterministic"]
            learner.save(self.best)
        self.last = (steps, out)
        return out

    def run(self, learned: dict[str, Any]) -> dict[str, float]:
        """`learned`: a router per mode of MODES; returns the `eval/...` records."""
        routers = [*learned.values(), self.baseline]
        runs = [rollout.run(routers, seeds) for rollout, seeds in self.rollouts]

        def episodes(name: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
            cost = np.concatenate([r[name].cost for r in runs])
            p99 = np.concatenate([r[name].metrics["e2e_p99"] for r in runs])
            return cost, p99, np.concatenate([r[name].metrics["skew_index"] for r in runs])

        rr_cost, rr_p99, _ = episodes("round-robin")
        out = {
            "eval/objective_round_robin": float(rr_cost.mean()),
            "eval/e2e_p99_round_robin": float(rr_p99.mean()),
        }
        for mode, router in learned.items():
            cost, p99, skew = episodes(router.name)
            out[f"eval/objective_learned_{mode}"] = float(cost.mean())
            out[f"eval/change_vs_round_robin_pct_{mode}"] = float(100 * (cost.mean() / rr_cost.mean() - 1))
            out[f"eval/e2e_p99_learned_{mode}"] = float(p99.mean())
            out[f"eval/skew_index_learned_{mode}"] = float(skew.mean())
        return out


def print_held_out(records: dict[str, float]) -> None:
    """Print the final held-out evaluation (`HeldOut.run` records), one line per mode."""
    for mode in MODES if records else ():
        print(
            f"held-out evaluation ({mode}): objective {records[f'eval/objective_learned_{mode}']:.1f} vs "
            f"round-robin {records['eval/objective_round_robin']:.1f} "
            f"({records[f'eval/change_vs_round_robin_pct_{mode}']:+.2f}%)"
        )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--scenario",
        default=None,
        help=f"default {mixture.NAME}: groups of clusters and workloads drawn from burstgym.mixture's "
        "distribution (jax-ppo: the hyperparameter file's scenario, prefix); or one of: "
        f"{', '.join(scenarios.SCENARIOS)}",
    )
    p.add_argument(
        "--mixture-groups",
        type=int,
        default=8,
        help=f"--scenario {mixture.NAME}: configurations drawn (each an equal share of the clusters)",
    )
    p.add_argument(
        "--mixture-held-out",
        type=int,
        default=HELD_OUT_GROUPS,
        help=f"--scenario {mixture.NAME}: groups drawn apart (seed {EVAL_SEED_BASE}) that the run is "
        "evaluated on, each compiled once",
    )
    p.add_argument("--algo", default=None, help=f"default ppo; one of: {', '.join((*ALGOS, *JAX_ALGOS))}")
    p.add_argument("--conf-file", default=None, help="hyperparameter file (default: agents/hyperparams*.yml)")
    p.add_argument("--timesteps", type=int, default=None, help="environment steps (default: n_timesteps)")
    p.add_argument("--n-envs", type=int, default=None, help="clusters stepped together (default: n_envs)")
    p.add_argument("--episode-length", type=int, default=None, help="requests per episode (default: file's)")
    p.add_argument("--load", type=float, default=None, help="override the scenario's load")
    p.add_argument("--trace", default=None, help="trace file to replay (scenario 'trace')")
    p.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="other scenario settings")
    p.add_argument("--seed", type=int, default=None, help="default 0; resumed: the old run's")
    p.add_argument("--out", default="runs", help="parent directory of the run directory")
    p.add_argument(
        "--run-name", default=None, help="default: <scenario>-<algo>-seed<seed>; resumed: <old run>-resumed"
    )
    p.add_argument("--eval-every", type=int, default=32_768, help="timesteps between evaluations (0: none)")
    p.add_argument("--eval-seeds", type=int, default=8)
    p.add_argument(
        "--checkpoint-every",
        type=int,
        default=32_768,
        help="timesteps between checkpoints; a checkpoint comes at least every tenth of --timesteps "
        "(0: every tenth)",
    )
    p.add_argument(
        "--bc-teacher",
        default="marginal-cost",
        help="router the actor imitates first ('none': off; default marginal-cost, the model-based "
        "router; lookahead, the bound, with --algo jax-ppo; or any rule of agents.routers)",
    )
    p.add_argument("--bc-steps", type=int, default=16_384, help="environment steps of imitation data")
    p.add_argument("--no-stagger", action="store_true", help="all clusters' first episodes of full length")
    p.add_argument(
        "--resume",
        default=None,
        help="checkpoint to continue training from (.zip, or .msgpack for jax-ppo), with the task "
        "of the config.json of the run it belongs to",
    )
    p.add_argument(
        "--allow-pickle",
        action="store_true",
        help="let --resume unpickle a checkpoint or statistics that only a pickle holds (files of "
        "rl-zoo3 or of older burstgym versions); unpickling runs any code a file carries, so only "
        "for files you trust",
    )
    p.add_argument("--device", default="cpu", help=f"torch device: {', '.join(DEVICES)} (default cpu)")
    p.add_argument("--torch-threads", type=int, default=1, help="1 leaves the other core to JAX")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    args = p.parse_args(argv)
    try:
        with StopOnSignal("train.py") as stop:
            return train(args, stop)
    except Stopped as e:
        print(f"train.py: {e}; the run holds what its last checkpoint saved", file=sys.stderr)
        return stop.exit_code
    except KeyboardInterrupt:
        print("train.py: interrupted before training started; nothing saved", file=sys.stderr)
        return 130
    except (ValueError, FileNotFoundError) as e:
        print(f"train.py: error: {e}", file=sys.stderr)
        return 2


def plan(args: argparse.Namespace) -> tuple[Run, dict[str, Any]]:
    """Resolve the run's task from the command line (and, resumed, the old run's config.json) and
    validate it, refusing an occupied run directory; nothing is written yet (`Run.begin`).
    Returns the run and the old run's configuration ({} for a fresh run)."""
    old: dict[str, Any] = {}
    old_run = None
    for flag, low in (
        ("eval_every", 0),
        ("eval_seeds", 1),
        ("checkpoint_every", 0),
        ("bc_steps", 1),
        ("torch_threads", 1),
    ):
        if getattr(args, flag) < low:
            raise ValueError(f"--{flag.replace('_', '-')} must be at least {low}, got {getattr(args, flag)}")
    if args.seed is not None and not 0 <= args.seed < 2**32:
        raise ValueError(f"--seed must be in [0, 2**32), got {args.seed}")
    if args.resume:
        old_run, old = resume_config(args.resume)
        if args.algo and args.algo != old["algo"]:
            raise ValueError(
                f"checkpoint {args.resume!r} was trained with {old['algo']!r}; "
                f"--algo {args.algo} cannot continue it"
            )
    algo = old.get("algo") or args.algo or "ppo"
    check_algo(algo)
    device = check_device(args.device)
    if args.bc_teacher not in ("none", *TEACHERS):
        valid = ", ".join(TEACHERS)
        raise ValueError(f"unknown router {args.bc_teacher!r} for --bc-teacher; valid: none, {valid}")
    if args.bc_teacher == "lookahead" and algo != "jax-ppo" and not args.resume:
        raise ValueError(
            "--bc-teacher lookahead reads the cluster's state: only --algo jax-ppo can imitate it"
        )
    if args.bc_teacher != "none" and algo == "dqn" and not args.resume:
        raise ValueError(
            "--bc-teacher needs an actor-critic algorithm (ppo, a2c, maskable-ppo); use --bc-teacher none"
        )
    # By default the SB3 learners train across the mixture; the JAX learner steps one configuration
    # and trains on the hyperparameter file's scenario.
    requested = args.scenario or (None if algo in JAX_ALGOS else mixture.NAME)
    mixed = (old.get("mixture") is not None) if args.resume else requested == mixture.NAME
    if mixed and algo in JAX_ALGOS:
        raise ValueError(
            f"--scenario {mixture.NAME} trains with {', '.join(ALGOS)}"
            "; the JAX learner steps one configuration"
        )
    if mixed and (args.load is not None or args.trace is not None):
        raise ValueError(
            f"--scenario {mixture.NAME} (the default) draws each group's load and workload: drop --load "
            "and --trace, or name another --scenario"
        )
    if args.resume and old.get("mixture") and args.scenario not in (None, mixture.NAME):
        raise ValueError(
            f"checkpoint {args.resume!r} was trained on a mixture; it continues on its own groups"
        )
    if args.mixture_groups < 1:
        raise ValueError(f"--mixture-groups must be at least 1, got {args.mixture_groups}")
    if args.mixture_held_out < 1:
        raise ValueError(f"--mixture-held-out must be at least 1, got {args.mixture_held_out}")
    if args.resume:
        conf = Path(old.get("conf_file") or conf_file(algo))
        entry = old["hyperparams"]
        scenario = old["scenario"] if mixed else args.scenario or old["scenario"]
        if scenario == old["scenario"]:
            settings = dict(old["settings"])
        else:
            settings = {k: v for k, v in (load(algo, scenario, conf).get("env_kwargs") or {}).items()}
            settings.pop("scenario", None)
    else:
        conf = Path(args.conf_file) if args.conf_file else conf_file(algo)
        env_defaults = dict(load(algo, None, conf).get("env_kwargs") or {})
        scenario = requested or env_defaults.pop("scenario", "prefix")
        entry = load(algo, scenario, conf)
        settings = {k: v for k, v in (entry.get("env_kwargs") or {}).items() if k != "scenario"}
        if mixed:
            scenario = mixture.BASE
    policy = entry.get("policy", "MlpPolicy")
    if args.bc_teacher != "none" and not args.resume and algo in ALGOS and policy not in NODE_SCORING:
        raise ValueError(
            f"--bc-teacher fits the node-scoring network ({', '.join(NODE_SCORING)}), not policy "
            f"{policy!r}; use --bc-teacher none"
        )
    if args.episode_length is not None:
        settings["episode_length"] = args.episode_length
    settings.update(parse_settings(args.set))
    if args.load is not None:
        settings["load"] = args.load
    if args.trace is not None:
        settings["trace"] = args.trace
    timesteps = args.timesteps if args.timesteps is not None else int(entry.get("n_timesteps", 65_536))
    n_envs = args.n_envs or int(old.get("n_envs") or entry.get("n_envs", 128))
    if timesteps < 1 or n_envs < 1:
        raise ValueError("--timesteps and --n-envs must be positive")
    seed = args.seed if args.seed is not None else int(old.get("seed", 0))
    n_nodes = scenarios.settings_for(scenario, **settings)[1].n_nodes  # refuses a bad setting by name
    if mixed:
        mixture.check_undrawn(settings, f"--scenario {mixture.NAME}")
    mix = old.get("mixture") if args.resume else None
    if mixed and not args.resume and seed == EVAL_SEED_BASE:
        raise ValueError(
            f"--seed {seed} would train on the mixture's held-out groups (drawn with it); pick another"
        )
    if mixed and not args.resume:
        mix = {
            "groups": mixture.draw(seed, args.mixture_groups, n_nodes),
            "held_out": mixture.draw(EVAL_SEED_BASE, args.mixture_held_out, n_nodes),
        }
    if mix is not None and n_envs < len(mix["groups"]):
        raise ValueError(f"n_envs ({n_envs}) must be at least the mixture's groups ({len(mix['groups'])})")
    out = Path(args.out)
    if old_run is not None:
        run_dir, hint = resumed_dir(out, old_run, args.run_name), "give another --run-name"
    else:
        run_dir = out / (args.run_name or f"{mixture.NAME if mixed else scenario}-{algo}-seed{seed}")
        model = run_dir / ("model.msgpack" if algo in JAX_ALGOS else "model.zip")
        resume = f"--resume {model}" if model.is_file() else "--resume one of its checkpoints"
        hint = f"give another --run-name or --seed, continue it with {resume}, or delete it"
    # refused before the scenarios are built (seconds per mixture group); made once the run's start
    # has loaded (Run.begin)
    check_run_dir(run_dir, hint)
    for group in [{}] if mix is None else mix["groups"] + mix["held_out"]:
        scenarios.make(scenario, **{**settings, **group})  # refuse bad settings before anything is written
    bc_teacher = None if args.resume or args.bc_teacher == "none" else args.bc_teacher
    normalize = old.get("normalize") if args.resume else None
    if not args.resume:
        norm = normalize_kwargs(entry)
        normalize = None if norm is None else {k: norm.get(k, True) for k in ("norm_obs", "norm_reward")}
        if algo in JAX_ALGOS:
            normalize = normalize and {"norm_obs": normalize["norm_obs"], "norm_reward": False}
    config = {
        "status": "running",
        "algo": algo,
        "scenario": scenario,
        "settings": settings,
        "mixture": mix,
        "seed": seed,
        "n_envs": n_envs,
        "stagger": (old.get("stagger", True) if args.resume else True) and not args.no_stagger,
        "device": device,
        "timesteps_planned": timesteps,
        "timesteps": 0,
        "resumed_from": args.resume,
        "bc_teacher": bc_teacher,
        "bc": None,
        "conf_file": str(conf),
        "hyperparams": entry,
        "normalize": normalize,
        "arguments": vars(args),
    }
    return Run(run_dir, config, hint), old


def finish(run: Run, stop: StopOnSignal, model_path: Path, steps: int, **extra: Any) -> int:
    """Record the end of the run in config.json and say how it ended; returns the exit status."""
    run.seconds = time.time() - run.start
    status = "interrupted" if stop.signal else "finished"
    run.update(status=status, timesteps=int(steps), train_seconds=round(run.seconds, 1), **extra)
    if stop.signal:
        planned = run.config["timesteps_planned"] + (run.config.get("resumed_at") or 0)
        print(
            f"train.py: {stop.signal}: stopped at {steps:,} of {planned:,} steps; saved {model_path}, its "
            f"statistics and config.json (status interrupted); continue with: python train.py --resume "
            f"{model_path}",
            file=sys.stderr,
        )
        return stop.exit_code
    return 0


def train(args: argparse.Namespace, stop: StopOnSignal) -> int:
    """Train as `args` say, with whichever learner the run's algorithm names; returns the exit
    status."""
    run, old = plan(args)
    torch.set_num_threads(args.torch_threads)
    cfg = run.config
    learner = (JaxLearner if run.algo in JAX_ALGOS else SB3Learner)(run, args, old)
    run.begin()
    if args.resume:
        run.update(resumed_at=learner.num_timesteps, timesteps=learner.num_timesteps)

    records: dict[str, float] = {}
    if cfg["bc_teacher"] and not stop.signal:
        bc = learner.warm_start(cfg["bc_teacher"], args.bc_steps)
        records = {f"bc/{k}": bc[k] for k in ("agreement", "value_explained_variance")}
        run.update(bc=bc)
        print(
            f"imitated {cfg['bc_teacher']} for {bc['samples']} steps: agreement {bc['agreement']:.3f}, "
            f"critic explained variance {bc['value_explained_variance']:.3f}"
        )

    start = learner.num_timesteps
    checkpoints = Checkpoints(run, args.checkpoint_every, cfg["timesteps_planned"], start, learner.suffix)
    held_out = None
    if args.eval_every > 0:
        best = run.dir / f"best_model.{learner.suffix}"
        groups = (cfg.get("mixture") or {}).get("held_out")
        held_out = HeldOut(
            cfg["scenario"], cfg["settings"], args.eval_seeds, args.eval_every, start, best, groups
        )

    def after_step() -> None:
        steps = learner.num_timesteps
        if held_out is not None and held_out.due(steps) and not stop.signal:
            held_out.evaluate(learner)
        if checkpoints.due(steps):
            checkpoints.save(steps, learner.save)

    t0 = time.time()
    rates = learner.learn(after_step, stop, records, progress=not args.no_progress)
    seconds = time.time() - t0
    final_eval = held_out.evaluate(learner) if held_out is not None and not stop.signal else {}
    model_path = run.dir / f"model.{learner.suffix}"
    learner.save(model_path)
    learner.close()
    steps = learner.num_timesteps
    code = finish(
        run,
        stop,
        model_path,
        steps,
        steps_per_second=round((steps - start) / max(seconds, 1e-9), 1),
        final_eval=final_eval,
        **rates,
    )
    if not stop.signal:
        rate = f"{run.config['steps_per_second']} steps/s"
        if rates.get("steps_per_second_compiled"):
            rate += f"; after compiling, {rates['steps_per_second_compiled']}"
        print(f"saved {model_path} after {steps} steps in {seconds:.0f} s ({rate})")
        print_held_out(final_eval)
    return code


if __name__ == "__main__":
    sys.exit(main())
