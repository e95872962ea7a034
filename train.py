"""Train a Stable-Baselines3 router on a burstgym scenario.

    python train.py                                   # PPO on "prefix" (shared prefixes, prefix caching)
    python train.py --scenario bursty-dynamic --algo ppo --timesteps 2000000 --n-envs 512 --seed 1
    python train.py --resume runs/prefix-ppo-seed0/checkpoints/rl_model_32768_steps.zip --timesteps 100000
    tensorboard --logdir runs

Hyperparameters (and the defaults of --timesteps, --n-envs, --scenario, --episode-length) come
from the algorithm's rl-zoo3-format file, `agents/hyperparams.yml` for PPO (--conf-file to use
another). Writes `runs/<scenario>-<algo>-seed<seed>/`: `model.zip` (the final model),
`best_model.zip` (the best on the held-out evaluation), the observation-normalisation statistics
of each (`vecnormalize.pkl`, `best_model_vecnormalize.pkl`), `config.json` (what it was trained
with), `checkpoints/` (models and their statistics), and TensorBoard logs in `tb/` with SB3's
curves, serving metrics of training episodes (`serving/...`), a periodic evaluation against
round-robin on held-out seeds (`eval/..._deterministic`, `eval/..._stochastic`) and a
custom-scalars layout that puts serving metrics beside the learning curves.

--resume continues a checkpoint in a new run directory (`<old run>-resumed`, or --run-name), on
the old run's algorithm, scenario and settings unless given again; the old run is not touched.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import torch  # noqa: E402
from stable_baselines3.common.callbacks import BaseCallback, CallbackList, CheckpointCallback  # noqa: E402
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
    vecnormalize_path,
)
from agents.rollout import Rollout  # noqa: E402
from agents.routers import ROUTERS, make_router  # noqa: E402
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
    with its normalisation statistics."""

    def __init__(self, scenario: str, settings: dict[str, Any], every: int, n_seeds: int, best_path: Path):
        super().__init__()
        self.best_path = best_path
        self.best = float("inf")
        self.held_out = HeldOut(scenario, settings, n_seeds)
        self.every = every
        self.next_at = every
        self.last: tuple[int, dict[str, float]] | None = None  # (timesteps, records) of the latest

    def _on_step(self) -> bool:
        if self.every > 0 and self.num_timesteps >= self.next_at:
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
            self.model.save(self.best_path)
            if norm is not None:
                norm.save(self.best_path.with_name(f"{self.best_path.stem}_vecnormalize.pkl"))
        self.last = (self.num_timesteps, out)
        return out


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
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="runs", help="parent directory of the run directory")
    p.add_argument(
        "--run-name", default=None, help="default: <scenario>-<algo>-seed<seed>; resumed: <old run>-resumed"
    )
    p.add_argument("--eval-every", type=int, default=32_768, help="timesteps between evaluations (0: none)")
    p.add_argument("--eval-seeds", type=int, default=8)
    p.add_argument("--checkpoint-every", type=int, default=32_768, help="timesteps between checkpoints")
    p.add_argument(
        "--bc-teacher",
        default="auto",
        help="router the actor imitates first ('none': off; 'auto': sglang-cache-aware where the "
        "scenario caches shared prefixes, else jsq)",
    )
    p.add_argument("--bc-steps", type=int, default=16_384, help="environment steps of imitation data")
    p.add_argument("--no-stagger", action="store_true", help="all clusters' first episodes of full length")
    p.add_argument("--resume", default=None, help="checkpoint .zip to continue training from")
    p.add_argument("--device", default="cpu", help=f"torch device: {', '.join(DEVICES)} (default cpu)")
    p.add_argument("--torch-threads", type=int, default=1, help="1 leaves the other core to JAX")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    args = p.parse_args(argv)
    try:
        return train(args)
    except (ValueError, FileNotFoundError) as e:
        print(f"train.py: error: {e}", file=sys.stderr)
        return 2


def source_run(checkpoint: Path) -> Path:
    """The run directory a checkpoint belongs to (`<run>/checkpoints/x.zip` or `<run>/x.zip`)."""
    parent = checkpoint.resolve().parent
    return parent.parent if parent.name == "checkpoints" else parent


def resumed_dir(out: Path, old_run: Path, run_name: str | None) -> Path:
    """A new run directory for a resumed run: `run_name`, else `<old>-resumed` (then -2, -3, ...
    while taken); never the old run's directory."""
    if run_name:
        run_dir = out / run_name
    else:
        run_dir = out / f"{old_run.name}-resumed"
        k = 2
        while run_dir.exists():
            run_dir = out / f"{old_run.name}-resumed-{k}"
            k += 1
    if run_dir.resolve() == old_run.resolve():
        raise ValueError(
            f"--resume would write into the checkpoint's own run {str(old_run)!r}; give another --run-name"
        )
    return run_dir


def train(args: argparse.Namespace) -> int:
    """Train as `args` say; returns the exit status."""
    old_config: dict[str, Any] = {}
    old_run = None
    if args.resume and args.algo in JAX_ALGOS:
        raise ValueError("--resume continues SB3 checkpoints; jax-ppo runs start afresh")
    if args.resume:
        if not Path(args.resume).is_file():
            raise FileNotFoundError(f"checkpoint {args.resume!r} does not exist")
        old_run = source_run(Path(args.resume))
        if (old_run / "config.json").is_file():
            old_config = json.loads((old_run / "config.json").read_text())
    algo = args.algo or old_config.get("algo", "ppo")
    check_algo(algo)
    if algo in JAX_ALGOS and args.resume:
        raise ValueError("--resume continues SB3 checkpoints; jax-ppo runs start afresh")
    device = check_device(args.device)
    if args.bc_teacher not in ("none", "auto", *ROUTERS):
        valid = ", ".join(ROUTERS)
        raise ValueError(f"unknown router {args.bc_teacher!r} for --bc-teacher; valid: none, auto, {valid}")
    if args.bc_teacher != "none" and algo == "dqn" and not args.resume:
        raise ValueError(
            "--bc-teacher needs an actor-critic algorithm (ppo, a2c, maskable-ppo); use --bc-teacher none"
        )
    conf = Path(args.conf_file) if args.conf_file else conf_file(algo)
    env_defaults = dict(load(algo, None, conf).get("env_kwargs") or {})
    scenario = args.scenario or old_config.get("scenario") or env_defaults.pop("scenario", "prefix")
    entry = load(algo, scenario, conf)
    env_kwargs = {k: v for k, v in (entry.get("env_kwargs") or {}).items() if k != "scenario"}
    same = "settings" in old_config and old_config.get("scenario") == scenario
    settings = dict(old_config["settings"]) if same else env_kwargs
    if args.episode_length is not None:
        settings["episode_length"] = args.episode_length
    settings.update(parse_settings(args.set))
    if args.load is not None:
        settings["load"] = args.load
    if args.trace is not None:
        settings["trace"] = args.trace
    timesteps = args.timesteps if args.timesteps is not None else int(entry.get("n_timesteps", 65_536))
    n_envs = args.n_envs or int(old_config.get("n_envs") or entry.get("n_envs", 128))
    if timesteps < 1 or n_envs < 1:
        raise ValueError("--timesteps and --n-envs must be positive")
    cfg, _ = scenarios.make(scenario, **settings)  # refuse bad settings before anything is written
    if args.bc_teacher == "auto":
        args.bc_teacher = default_teacher(cfg)
    norm_kwargs = normalize_kwargs(entry)
    stats = None
    if args.resume:
        stats = vecnormalize_path(args.resume)
        if stats is None and (old_config.get("normalize") if old_config else norm_kwargs):
            raise FileNotFoundError(f"checkpoint {args.resume!r} has no normalisation statistics beside it")
    torch.set_num_threads(args.torch_threads)
    out = Path(args.out)
    if old_run is not None:
        run_dir = resumed_dir(out, old_run, args.run_name)
    else:
        run_dir = out / (args.run_name or f"{scenario}-{algo}-seed{args.seed}")
    run_dir.mkdir(parents=True, exist_ok=True)
    if algo in JAX_ALGOS:
        return train_jax(args, conf, scenario, settings, entry, timesteps, n_envs, run_dir)

    env = JaxVecEnv(n_envs, scenario, seed=args.seed, stagger=not args.no_stagger, **settings)
    records: dict[str, float] = {}
    bc: dict[str, float] | None = None
    if args.resume:
        if stats is not None:
            env = load_normalization(stats, env)
            env.training = True  # statistics keep tracking the data, as in the old run
        model = load_model(args.resume, algo, env=env, device=device)
        model.tensorboard_log = str(run_dir / "tb")
    else:
        env = normalize_env(env, norm_kwargs)
        model = make_model(algo, env, scenario, args.seed, str(run_dir / "tb"), device=device, entry=entry)
        if args.bc_teacher != "none":
            teacher = make_router(args.bc_teacher, int(model.action_space.n))
            bc = behaviour_clone(model, env, teacher, args.bc_steps)
            records = {f"bc/{k}": bc[k] for k in ("agreement", "value_explained_variance")}
            print(
                f"imitated {args.bc_teacher} for {bc['samples']} steps: agreement {bc['agreement']:.3f}, "
                f"critic explained variance {bc['value_explained_variance']:.3f}"
            )
    callbacks = [
        TrainingStartCallback(records),
        ServingMetricsCallback(),
        CheckpointCallback(
            max(args.checkpoint_every // n_envs, 1),
            str(run_dir / "checkpoints"),
            save_vecnormalize=True,
        ),
    ]
    evaluator = None
    if args.eval_every > 0:
        best = run_dir / "best_model.zip"
        evaluator = EvalVsRoundRobin(scenario, settings, args.eval_every, args.eval_seeds, best)
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
    if evaluator is not None:
        final_eval = evaluator.evaluate()
        model.logger.dump(model.num_timesteps)
    model.save(run_dir / "model.zip")
    norm = model.get_vec_normalize_env()
    if norm is not None:
        norm.save(run_dir / "vecnormalize.pkl")
    config = {
        "algo": algo,
        "scenario": scenario,
        "settings": settings,
        "seed": args.seed,
        "n_envs": n_envs,
        "stagger": not args.no_stagger,
        "device": device,
        "timesteps": int(model.num_timesteps),
        "train_seconds": round(seconds, 1),
        "steps_per_second": round(timesteps / seconds, 1),
        "resumed_from": args.resume,
        "bc_teacher": None if args.resume or args.bc_teacher == "none" else args.bc_teacher,
        "bc": bc,
        "conf_file": str(conf),
        "hyperparams": old_config.get("hyperparams", entry) if args.resume else entry,
        "normalize": None if norm is None else {"norm_obs": norm.norm_obs, "norm_reward": norm.norm_reward},
        "final_eval": final_eval,
    }
    (run_dir / "config.json").write_text(json.dumps(config, indent=2, default=str))
    env.close()
    print(
        f"saved {run_dir / 'model.zip'} after {model.num_timesteps} steps in {seconds:.0f} s "
        f"({config['steps_per_second']} steps/s)"
    )
    print_held_out(final_eval)
    return 0


def train_jax(
    args: argparse.Namespace,
    conf: Path,
    scenario: str,
    settings: dict[str, Any],
    entry: dict[str, Any],
    timesteps: int,
    n_envs: int,
    run_dir: Path,
) -> int:
    """Train with the JAX learner (`agents.jax_ppo`): the same files, logs and evaluation as an SB3
    run, the model as `.msgpack` checkpoints that hold their observation statistics."""
    import jax
    from torch.utils.tensorboard import SummaryWriter
    from tqdm import tqdm

    from agents.jax_ppo import JaxPPO, PPOConfig
    from agents.routers import make_rule

    cfg, params = scenarios.make(scenario, **settings)
    ppo = PPOConfig.from_entry(entry, str(conf))
    learner = JaxPPO(cfg, params, ppo, n_envs, timesteps, stagger=not args.no_stagger)
    start = time.time()
    learner.setup(args.seed)
    bc = None
    writer = SummaryWriter(str(run_dir / "tb" / f"{args.algo or 'jax-ppo'}_1"))
    writer.add_custom_scalars(LAYOUT)
    if args.bc_teacher != "none":
        bc = learner.warm_start(make_rule(args.bc_teacher), args.bc_steps, BC_EPOCHS, BC_BATCH)
        writer.add_scalar("bc/agreement", bc["agreement"], 0)
        writer.add_scalar("bc/value_explained_variance", bc["value_explained_variance"], 0)
        print(
            f"imitated {args.bc_teacher} for {bc['samples']} steps: agreement {bc['agreement']:.3f}, "
            f"critic explained variance {bc['value_explained_variance']:.3f}"
        )
    held_out = HeldOut(scenario, settings, args.eval_seeds) if args.eval_every > 0 else None
    best, best_cost, final_eval = run_dir / "best_model.msgpack", float("inf"), {}
    next_eval, next_ckpt = args.eval_every, args.checkpoint_every
    (run_dir / "checkpoints").mkdir(exist_ok=True)

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

    train_start, compile_s, update_s = time.time(), 0.0, 0.0
    bar = tqdm(total=learner.n_updates * learner.n_envs * ppo.n_steps, disable=args.no_progress, unit="step")
    for k in range(learner.n_updates):
        t0 = time.time()
        logs = learner.update()
        if k == 0:
            compile_s = time.time() - t0  # the first call compiles the update
        else:
            update_s += time.time() - t0
        for tag, value in logs.items():
            writer.add_scalar(tag, value, learner.num_timesteps)
        writer.add_scalar(
            "time/fps", learner.num_timesteps / (time.time() - train_start), learner.num_timesteps
        )
        bar.update(learner.n_envs * ppo.n_steps)
        if held_out is not None and learner.num_timesteps >= next_eval:
            next_eval += args.eval_every
            evaluate()
        if args.checkpoint_every > 0 and learner.num_timesteps >= next_ckpt:
            next_ckpt += args.checkpoint_every
            learner.save(run_dir / "checkpoints" / f"rl_model_{learner.num_timesteps}_steps.msgpack")
    bar.close()
    seconds = time.time() - start
    if held_out is not None:
        final_eval = evaluate()
    learner.save(run_dir / "model.msgpack")
    writer.close()
    # PPO steps/s of the compiled updates (rollout and optimisation; evaluations and saving apart)
    steady = (learner.n_updates - 1) * learner.n_envs * ppo.n_steps / max(update_s, 1e-9)
    config = {
        "algo": "jax-ppo",
        "scenario": scenario,
        "settings": settings,
        "seed": args.seed,
        "n_envs": n_envs,
        "stagger": not args.no_stagger,
        "device": jax.default_backend(),
        "timesteps": learner.num_timesteps,
        "train_seconds": round(seconds, 1),
        "steps_per_second": round(learner.num_timesteps / seconds, 1),
        "steps_per_second_compiled": round(steady, 1) if learner.n_updates > 1 else None,
        "compile_seconds": round(compile_s, 1),
        "resumed_from": None,
        "bc_teacher": None if args.bc_teacher == "none" else args.bc_teacher,
        "bc": bc,
        "conf_file": str(conf),
        "hyperparams": entry,
        "normalize": {"norm_obs": True, "norm_reward": False} if ppo.norm_obs else None,
        "final_eval": final_eval,
    }
    (run_dir / "config.json").write_text(json.dumps(config, indent=2, default=str))
    print(
        f"saved {run_dir / 'model.msgpack'} after {learner.num_timesteps} steps in {seconds:.0f} s "
        f"({config['steps_per_second']} steps/s; after compiling, {config['steps_per_second_compiled']})"
    )
    print_held_out(final_eval)
    return 0


if __name__ == "__main__":
    sys.exit(main())
