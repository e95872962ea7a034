"""Train a Stable-Baselines3 router on a burstgym scenario.

    python train.py                                   # PPO on "prefix" (shared prefixes, prefix caching)
    python train.py --scenario bursty-dynamic --algo ppo --timesteps 2000000 --n-envs 512 --seed 1
    python train.py --resume runs/prefix-ppo-seed0/checkpoints/rl_model_32768_steps.zip --timesteps 100000
    tensorboard --logdir runs

Hyperparameters (and the defaults of --timesteps, --n-envs, --scenario, --episode-length) come
from the algorithm's rl-zoo3-format file, `agents/hyperparams.yml` for PPO (--conf-file to use
another). Writes `runs/<scenario>-<algo>-seed<seed>/`: `config.json` (written when the run starts
with everything a resumed run needs, updated at every checkpoint and at the end, with its
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
from pathlib import Path
from typing import Any

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import torch  # noqa: E402
from stable_baselines3.common.callbacks import BaseCallback, CallbackList  # noqa: E402
from stable_baselines3.common.logger import TensorBoardOutputFormat  # noqa: E402

from agents.cli import parse_settings  # noqa: E402
from agents.hyperparams import conf_file, load, normalize_kwargs  # noqa: E402
from agents.learners import (  # noqa: E402
    ALGOS,
    BC_BATCH,
    BC_EPOCHS,
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
    vecnormalize_path,
)
from agents.rollout import Rollout  # noqa: E402
from agents.routers import ROUTERS, make_router  # noqa: E402
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
from agents.sb3_vec_env import JaxVecEnv  # noqa: E402
from burstgym import scenarios  # noqa: E402
from burstgym.types import EnvConfig  # noqa: E402

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
    """At the start of training: the custom-scalars layout (once) and the warm start's results."""

    def __init__(self, records: dict[str, float] | None = None):
        super().__init__()
        self.records = records or {}

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


class HeldOut:
    """A learned policy (argmax and sampled actions) against round-robin on the same held-out seeds
    (`eval/...`)."""

    def __init__(self, scenario: str, settings: dict[str, Any], n_seeds: int):
        self.rollout = Rollout(scenario, **settings)
        self.baseline = make_router("round-robin", self.rollout.cfg.n_nodes)
        self.seeds = list(range(EVAL_SEED_BASE, EVAL_SEED_BASE + n_seeds))

    def run(self, learned: dict[str, Any]) -> dict[str, float]:
        """`learned`: a router per mode of MODES; returns the `eval/...` records."""
        res = self.rollout.run([*learned.values(), self.baseline], self.seeds)
        rr = res["round-robin"]
        out = {
            "eval/objective_round_robin": float(rr.cost.mean()),
            "eval/e2e_p99_round_robin": float(rr.metrics["e2e_p99"].mean()),
        }
        for mode, router in learned.items():
            ep = res[router.name]
            out[f"eval/objective_learned_{mode}"] = float(ep.cost.mean())
            out[f"eval/change_vs_round_robin_pct_{mode}"] = float(100 * (ep.cost.mean() / rr.cost.mean() - 1))
            out[f"eval/e2e_p99_learned_{mode}"] = float(ep.metrics["e2e_p99"].mean())
            out[f"eval/skew_index_learned_{mode}"] = float(ep.metrics["skew_index"].mean())
        return out


class EvalVsRoundRobin(BaseCallback):
    """Every `every` timesteps, the held-out evaluation (`HeldOut`); the best argmax policy is saved
    with its normalisation statistics. Skipped once a stop is asked for (`stop`)."""

    def __init__(
        self,
        scenario: str,
        settings: dict[str, Any],
        every: int,
        n_seeds: int,
        best_path: Path,
        stop: StopOnSignal | None = None,
    ):
        super().__init__()
        self.best_path = best_path
        self.best = float("inf")
        self.held_out = HeldOut(scenario, settings, n_seeds)
        self.every = every
        self.next_at = every
        self.stop = stop
        self.last: tuple[int, dict[str, float]] | None = None  # (timesteps, records) of the latest

    def _on_step(self) -> bool:
        if self.every > 0 and self.num_timesteps >= self.next_at and not (self.stop and self.stop.signal):
            self.next_at += self.every
            self.evaluate()
        return True

    def evaluate(self) -> dict[str, float]:
        """Run the evaluation now and record it (at most once per timestep count)."""
        if self.last is not None and self.last[0] == self.num_timesteps:
            return self.last[1]
        norm = self.model.get_vec_normalize_env()
        learned = {m: PolicyRouter(self.model, f"learned-{m}", m == "deterministic", norm) for m in MODES}
        out = self.held_out.run(learned)
        for k, v in out.items():
            self.logger.record(k, v)
        cost = out["eval/objective_learned_deterministic"]
        if cost < self.best:  # model selection on held-out seeds, as rl-zoo3's best_model
            self.best = cost
            save_sb3(self.model, self.best_path)
        self.last = (self.num_timesteps, out)
        return out


def save_sb3(model, path: Path) -> None:
    """Save an SB3 model (atomically) and its normalisation statistics as JSON beside it
    (`<stem>_vecnormalize.json`, or `vecnormalize.json` for `model.zip`)."""
    with atomic(path) as tmp:
        model.save(tmp)
    norm = model.get_vec_normalize_env()
    if norm is not None:
        name = "vecnormalize.json" if path.name == "model.zip" else f"{path.stem}_vecnormalize.json"
        save_normalization(norm, path.with_name(name))


class CheckpointCallback(BaseCallback):
    """SB3's side of `Checkpoints`: the model and its statistics (`rl_model_<N>_steps.zip`,
    `rl_model_vecnormalize_<N>_steps.json`, the names SB3's CheckpointCallback uses)."""

    def __init__(self, checkpoints: Checkpoints):
        super().__init__()
        self.checkpoints = checkpoints

    def _write(self, path: Path) -> None:
        with atomic(path) as tmp:
            self.model.save(tmp)
        norm = self.model.get_vec_normalize_env()
        if norm is not None:
            steps = self.num_timesteps
            save_normalization(norm, path.with_name(f"rl_model_vecnormalize_{steps}_steps.json"))

    def _on_step(self) -> bool:
        if self.checkpoints.due(self.num_timesteps):
            self.checkpoints.save(self.num_timesteps, self._write)
        return True


class StopCallback(BaseCallback):
    """Ends `learn` at the next step once SIGINT or SIGTERM arrived (`StopOnSignal`)."""

    def __init__(self, stop: StopOnSignal):
        super().__init__()
        self.stop = stop

    def _on_step(self) -> bool:
        return self.stop.signal is None


def print_held_out(records: dict[str, float]) -> None:
    """Print the final held-out evaluation (`HeldOut.run` records), one line per mode."""
    for mode in MODES if records else ():
        print(
            f"held-out evaluation ({mode}): objective {records[f'eval/objective_learned_{mode}']:.1f} vs "
            f"round-robin {records['eval/objective_round_robin']:.1f} "
            f"({records[f'eval/change_vs_round_robin_pct_{mode}']:+.2f}%)"
        )


def default_teacher(cfg: EnvConfig) -> str:
    """The warm start's teacher for `--bc-teacher auto`: SGLang's cache-aware rule where the nodes
    cache shared prefixes (it trades cache affinity against load), JSQ elsewhere. docs/agents.md
    has the measurement behind it."""
    return "sglang-cache-aware" if cfg.prefix_caching else "jsq"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--scenario",
        default=None,
        help=f"default: the hyperparameter file's (prefix); one of: {', '.join(scenarios.SCENARIOS)}",
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
        default="auto",
        help="router the actor imitates first ('none': off; 'auto': sglang-cache-aware where the "
        "scenario caches shared prefixes, else jsq)",
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
    if args.bc_teacher not in ("none", "auto", *ROUTERS):
        valid = ", ".join(ROUTERS)
        raise ValueError(f"unknown router {args.bc_teacher!r} for --bc-teacher; valid: none, auto, {valid}")
    if args.bc_teacher != "none" and algo == "dqn" and not args.resume:
        raise ValueError(
            "--bc-teacher needs an actor-critic algorithm (ppo, a2c, maskable-ppo); use --bc-teacher none"
        )
    if args.resume:
        conf = Path(old.get("conf_file") or conf_file(algo))
        entry = old["hyperparams"]
        scenario = args.scenario or old["scenario"]
        if scenario == old["scenario"]:
            settings = dict(old["settings"])
        else:
            settings = {k: v for k, v in (load(algo, scenario, conf).get("env_kwargs") or {}).items()}
            settings.pop("scenario", None)
    else:
        conf = Path(args.conf_file) if args.conf_file else conf_file(algo)
        env_defaults = dict(load(algo, None, conf).get("env_kwargs") or {})
        scenario = args.scenario or env_defaults.pop("scenario", "prefix")
        entry = load(algo, scenario, conf)
        settings = {k: v for k, v in (entry.get("env_kwargs") or {}).items() if k != "scenario"}
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
    cfg, _ = scenarios.make(scenario, **settings)  # refuse bad settings before anything is written
    bc_teacher = None
    if not args.resume and args.bc_teacher != "none":
        bc_teacher = default_teacher(cfg) if args.bc_teacher == "auto" else args.bc_teacher
    out = Path(args.out)
    if old_run is not None:
        run_dir, hint = resumed_dir(out, old_run, args.run_name), "give another --run-name"
    else:
        run_dir = out / (args.run_name or f"{scenario}-{algo}-seed{seed}")
        model = run_dir / ("model.msgpack" if algo in JAX_ALGOS else "model.zip")
        resume = f"--resume {model}" if model.is_file() else "--resume one of its checkpoints"
        hint = f"give another --run-name or --seed, continue it with {resume}, or delete it"
    check_run_dir(run_dir, hint)  # refused now; made once the run's start has loaded (Run.begin)
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
    """Train as `args` say; returns the exit status."""
    run, old = plan(args)
    torch.set_num_threads(args.torch_threads)
    if run.algo in JAX_ALGOS:
        return train_jax(args, run, stop)
    cfg = run.config
    scenario, settings, n_envs, seed, algo = (
        cfg["scenario"],
        cfg["settings"],
        cfg["n_envs"],
        cfg["seed"],
        run.algo,
    )
    env = JaxVecEnv(n_envs, scenario, seed=seed, stagger=cfg["stagger"], **settings)
    records: dict[str, float] = {}
    if args.resume:
        stats = vecnormalize_path(args.resume)
        if stats is None and old.get("normalize"):
            raise FileNotFoundError(f"checkpoint {args.resume!r} has no normalisation statistics beside it")
        if stats is not None:
            env = load_normalization(stats, env, training=True, allow_pickle=args.allow_pickle)
        model = load_model(
            args.resume, algo, env=env, device=cfg["device"], config=old, allow_pickle=args.allow_pickle
        )
        model.set_random_seed(seed)
        model.tensorboard_log = str(run.dir / "tb")
        run.begin()
        run.update(resumed_at=int(model.num_timesteps), timesteps=int(model.num_timesteps))
    else:
        env = normalize_env(env, normalize_kwargs(cfg["hyperparams"]))
        model = make_model(
            algo, env, scenario, seed, str(run.dir / "tb"), device=cfg["device"], entry=cfg["hyperparams"]
        )
        run.begin()
        if cfg["bc_teacher"] and not stop.signal:
            teacher = make_router(cfg["bc_teacher"], int(model.action_space.n))
            bc = behaviour_clone(model, env, teacher, args.bc_steps)
            records = {f"bc/{k}": bc[k] for k in ("agreement", "value_explained_variance")}
            run.update(bc=bc)
            print(
                f"imitated {cfg['bc_teacher']} for {bc['samples']} steps: agreement {bc['agreement']:.3f}, "
                f"critic explained variance {bc['value_explained_variance']:.3f}"
            )
    timesteps = cfg["timesteps_planned"]
    checkpoints = Checkpoints(run, args.checkpoint_every, timesteps, int(model.num_timesteps), "zip")
    callbacks = [
        StopCallback(stop),
        TrainingStartCallback(records),
        ServingMetricsCallback(),
        CheckpointCallback(checkpoints),
    ]
    evaluator = None
    if args.eval_every > 0:
        best = run.dir / "best_model.zip"
        evaluator = EvalVsRoundRobin(scenario, settings, args.eval_every, args.eval_seeds, best, stop)
        callbacks.append(evaluator)
    start = time.time()
    model.learn(
        timesteps,
        callback=CallbackList(callbacks),
        progress_bar=not args.no_progress,
        reset_num_timesteps=not args.resume,
        tb_log_name=algo,
    )
    seconds = time.time() - start
    final_eval = {}
    if evaluator is not None and not stop.signal:
        final_eval = evaluator.evaluate()
        model.logger.dump(model.num_timesteps)
    save_sb3(model, run.dir / "model.zip")
    env.close()
    steps = int(model.num_timesteps)
    done = steps - int(cfg.get("resumed_at") or 0)
    code = finish(
        run,
        stop,
        run.dir / "model.zip",
        steps,
        steps_per_second=round(done / max(seconds, 1e-9), 1),
        final_eval=final_eval,
    )
    if not stop.signal:
        print(
            f"saved {run.dir / 'model.zip'} after {steps} steps in {seconds:.0f} s "
            f"({run.config['steps_per_second']} steps/s)"
        )
        print_held_out(final_eval)
    return code


def train_jax(args: argparse.Namespace, run: Run, stop: StopOnSignal) -> int:
    """Train with the JAX learner (`agents.jax_ppo`): the same files, logs and evaluation as an SB3
    run, the model as `.msgpack` checkpoints that hold their observation statistics and
    optimiser state (so --resume continues them)."""
    import jax
    from torch.utils.tensorboard import SummaryWriter
    from tqdm import tqdm

    from agents.jax_ppo import JaxPPO, PPOConfig, load_checkpoint
    from agents.routers import make_rule

    cfg = run.config
    scenario, settings = cfg["scenario"], cfg["settings"]
    env_cfg, params = scenarios.make(scenario, **settings)
    ppo = PPOConfig.from_entry(cfg["hyperparams"], cfg["conf_file"])
    learner = JaxPPO(env_cfg, params, ppo, cfg["n_envs"], cfg["timesteps_planned"], stagger=cfg["stagger"])
    resume = load_checkpoint(args.resume) if args.resume else None
    learner.setup(cfg["seed"], resume=resume)
    run.begin()
    if resume is not None:
        run.update(resumed_at=learner.num_timesteps, timesteps=learner.num_timesteps)
    writer = SummaryWriter(str(run.dir / "tb" / f"{run.algo}_1"))
    writer.add_custom_scalars(LAYOUT)
    if cfg["bc_teacher"] and not stop.signal:
        bc = learner.warm_start(make_rule(cfg["bc_teacher"]), args.bc_steps, BC_EPOCHS, BC_BATCH)
        run.update(bc=bc)
        writer.add_scalar("bc/agreement", bc["agreement"], 0)
        writer.add_scalar("bc/value_explained_variance", bc["value_explained_variance"], 0)
        print(
            f"imitated {cfg['bc_teacher']} for {bc['samples']} steps: agreement {bc['agreement']:.3f}, "
            f"critic explained variance {bc['value_explained_variance']:.3f}"
        )
    held_out = HeldOut(scenario, settings, args.eval_seeds) if args.eval_every > 0 else None
    best, best_cost, final_eval = run.dir / "best_model.msgpack", float("inf"), {}
    start_steps = learner.num_timesteps
    next_eval = start_steps + args.eval_every
    checkpoints = Checkpoints(run, args.checkpoint_every, cfg["timesteps_planned"], start_steps, "msgpack")

    last: list[tuple[int, dict[str, float]]] = []

    def evaluate() -> dict[str, float]:
        nonlocal best_cost
        if last and last[-1][0] == learner.num_timesteps:  # evaluated at this step already
            return last[-1][1]
        out = held_out.run({m: learner.router(f"learned-{m}", m == "deterministic") for m in MODES})
        for k, v in out.items():
            writer.add_scalar(k, v, learner.num_timesteps)
        if out["eval/objective_learned_deterministic"] < best_cost:
            best_cost = out["eval/objective_learned_deterministic"]
            learner.save(best)
        last.append((learner.num_timesteps, out))
        return out

    train_start, compile_s, update_s, updates = time.time(), 0.0, 0.0, 0
    bar = tqdm(total=learner.n_updates * learner.n_envs * ppo.n_steps, disable=args.no_progress, unit="step")
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
        for tag, value in logs.items():
            writer.add_scalar(tag, value, learner.num_timesteps)
        writer.add_scalar(
            "time/fps",
            (learner.num_timesteps - start_steps) / (time.time() - train_start),
            learner.num_timesteps,
        )
        bar.update(learner.n_envs * ppo.n_steps)
        if held_out is not None and learner.num_timesteps >= next_eval and not stop.signal:
            next_eval += args.eval_every
            evaluate()
        if checkpoints.due(learner.num_timesteps):
            checkpoints.save(learner.num_timesteps, learner.save)
    bar.close()
    seconds = time.time() - run.start
    if held_out is not None and not stop.signal:
        final_eval = evaluate()
    learner.save(run.dir / "model.msgpack")
    writer.close()
    # PPO steps/s of the compiled updates (rollout and optimisation; evaluations and saving apart)
    steady = (updates - 1) * learner.n_envs * ppo.n_steps / max(update_s, 1e-9)
    done = learner.num_timesteps - start_steps
    code = finish(
        run,
        stop,
        run.dir / "model.msgpack",
        learner.num_timesteps,
        device=jax.default_backend(),
        steps_per_second=round(done / max(seconds, 1e-9), 1),
        steps_per_second_compiled=round(steady, 1) if updates > 1 else None,
        compile_seconds=round(compile_s, 1),
        final_eval=final_eval,
    )
    if not stop.signal:
        print(
            f"saved {run.dir / 'model.msgpack'} after {learner.num_timesteps} steps in {seconds:.0f} s "
            f"({run.config['steps_per_second']} steps/s; after compiling, "
            f"{run.config['steps_per_second_compiled']})"
        )
        print_held_out(final_eval)
    return code


if __name__ == "__main__":
    sys.exit(main())
