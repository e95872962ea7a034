"""Train a Stable-Baselines3 router on a burstgym scenario.

    python train.py                                   # PPO on "prefix" (shared prefixes, prefix caching)
    python train.py --scenario bursty-dynamic --algo ppo --timesteps 2000000 --n-envs 512 --seed 1
    python train.py --resume runs/prefix-ppo-seed0/checkpoints/model_100000_steps.zip --timesteps 100000
    tensorboard --logdir runs

Writes `runs/<scenario>-<algo>-seed<seed>/`: `model.zip` (the final model), `best_model.zip` (the
best on the held-out evaluation), `config.json` (what it was trained with), `checkpoints/`, and
TensorBoard logs in `tb/` with SB3's curves, serving metrics of finished training episodes
(`serving/...`) and a periodic evaluation against round-robin on held-out seeds (`eval/...`).
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

import numpy as np  # noqa: E402
import torch  # noqa: E402
from stable_baselines3.common.callbacks import BaseCallback, CallbackList, CheckpointCallback  # noqa: E402

from agents.cli import parse_settings  # noqa: E402
from agents.heuristics import RoundRobin  # noqa: E402
from agents.hyperparams import hyperparams  # noqa: E402
from agents.learners import ALGOS, PolicyRouter, behaviour_clone, check_algo, load_model, make_model  # noqa: E402
from agents.rollout import Rollout  # noqa: E402
from agents.routers import ROUTERS, make_router  # noqa: E402
from agents.sb3_vec_env import JaxVecEnv  # noqa: E402
from burstgym import scenarios  # noqa: E402

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


class ServingMetricsCallback(BaseCallback):
    """Records the serving metrics of training episodes as they finish (`serving/...`)."""

    def _on_step(self) -> bool:
        finished = [info["metrics"] for info in self.locals["infos"] if "metrics" in info]
        if finished:
            for tag in SERVING_TAGS:
                self.logger.record(f"serving/{tag}", float(np.mean([m[tag] for m in finished])))
            share = np.mean([m["load_share"] for m in finished], axis=0)
            for node, value in enumerate(share):
                self.logger.record(f"serving/load_share_node{node}", float(value))
        return True


class EvalVsRoundRobin(BaseCallback):
    """Every `every` timesteps, the deterministic policy and round-robin on the same held-out seeds
    (`eval/...`: objective of each, the policy's change against round-robin, its p99 latency)."""

    def __init__(self, scenario: str, settings: dict[str, Any], every: int, n_seeds: int, best_path: Path):
        super().__init__()
        self.best_path = best_path
        self.best = float("inf")
        self.rollout = Rollout(scenario, **settings)
        self.baseline = RoundRobin(self.rollout.cfg.n_nodes)
        self.every = every
        self.seeds = list(range(EVAL_SEED_BASE, EVAL_SEED_BASE + n_seeds))
        self.next_at = every

    def _on_step(self) -> bool:
        if self.every > 0 and self.num_timesteps >= self.next_at:
            self.next_at += self.every
            self.evaluate()
        return True

    def evaluate(self) -> dict[str, float]:
        """Run the evaluation now and record it."""
        res = self.rollout.run([PolicyRouter(self.model), self.baseline], self.seeds)
        learned, rr = res["learned"], res["round-robin"]
        out = {
            "eval/objective_learned": float(learned.cost.mean()),
            "eval/objective_round_robin": float(rr.cost.mean()),
            "eval/change_vs_round_robin_pct": float(100 * (learned.cost.mean() / rr.cost.mean() - 1)),
            "eval/e2e_p99_learned": float(learned.metrics["e2e_p99"].mean()),
            "eval/e2e_p99_round_robin": float(rr.metrics["e2e_p99"].mean()),
            "eval/skew_index_learned": float(learned.metrics["skew_index"].mean()),
        }
        for k, v in out.items():
            self.logger.record(k, v)
        if learned.cost.mean() < self.best:  # model selection on held-out seeds, as rl-zoo3's best_model
            self.best = float(learned.cost.mean())
            self.model.save(self.best_path)
        return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--scenario", default="prefix", help=f"one of: {', '.join(scenarios.SCENARIOS)}")
    p.add_argument("--algo", default="ppo", help=f"one of: {', '.join(ALGOS)}")
    p.add_argument("--timesteps", type=int, default=65_536, help="environment steps (routing decisions)")
    p.add_argument("--n-envs", type=int, default=128, help="clusters stepped together by the JAX core")
    p.add_argument("--episode-length", type=int, default=256, help="requests per episode")
    p.add_argument("--load", type=float, default=None, help="override the scenario's load")
    p.add_argument("--trace", default=None, help="trace file to replay (scenario 'trace')")
    p.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="other scenario settings")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="runs", help="parent directory of the run directory")
    p.add_argument("--run-name", default=None, help="default: <scenario>-<algo>-seed<seed>")
    p.add_argument("--eval-every", type=int, default=32_768, help="timesteps between evaluations (0: none)")
    p.add_argument("--eval-seeds", type=int, default=8)
    p.add_argument("--checkpoint-every", type=int, default=32_768, help="timesteps between checkpoints")
    p.add_argument("--bc-teacher", default="jsq", help="heuristic the actor imitates first ('none': off)")
    p.add_argument("--bc-steps", type=int, default=16_384, help="environment steps of imitation data")
    p.add_argument("--resume", default=None, help="checkpoint .zip to continue training from")
    p.add_argument("--torch-threads", type=int, default=1, help="1 leaves the other core to JAX")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    args = p.parse_args(argv)
    try:
        return train(args)
    except (ValueError, FileNotFoundError) as e:
        print(f"train.py: error: {e}", file=sys.stderr)
        return 2


def train(args: argparse.Namespace) -> int:
    """Train as `args` say; returns the exit status."""
    check_algo(args.algo)
    if args.bc_teacher not in ("none", *ROUTERS):
        valid = ", ".join(ROUTERS)
        raise ValueError(f"unknown router {args.bc_teacher!r} for --bc-teacher; valid: none, {valid}")
    if args.bc_teacher != "none" and args.algo == "dqn":
        raise ValueError(
            "--bc-teacher needs an actor-critic algorithm (ppo, a2c, maskable-ppo); use --bc-teacher none"
        )
    if args.timesteps < 1 or args.n_envs < 1:
        raise ValueError("--timesteps and --n-envs must be positive")
    settings = {"episode_length": args.episode_length, **parse_settings(args.set)}
    if args.load is not None:
        settings["load"] = args.load
    if args.trace is not None:
        settings["trace"] = args.trace
    scenarios.make(args.scenario, **settings)  # refuse bad settings before anything is written
    if args.resume and not Path(args.resume).is_file():
        raise FileNotFoundError(f"checkpoint {args.resume!r} does not exist")
    torch.set_num_threads(args.torch_threads)
    run_dir = Path(args.out) / (args.run_name or f"{args.scenario}-{args.algo}-seed{args.seed}")
    run_dir.mkdir(parents=True, exist_ok=True)

    env = JaxVecEnv(args.n_envs, args.scenario, seed=args.seed, **settings)
    if args.resume:
        model = load_model(args.resume, args.algo, env=env)
        model.tensorboard_log = str(run_dir / "tb")
    else:
        model = make_model(args.algo, env, args.scenario, args.seed, str(run_dir / "tb"))
        if args.bc_teacher != "none":
            teacher = make_router(args.bc_teacher, env.n_nodes)
            agreement = behaviour_clone(model, env, teacher, args.bc_steps)
            print(f"imitated {args.bc_teacher} for {args.bc_steps} steps: agreement {agreement:.3f}")
    callbacks = [
        ServingMetricsCallback(),
        CheckpointCallback(max(args.checkpoint_every // args.n_envs, 1), str(run_dir / "checkpoints")),
    ]
    evaluator = None
    if args.eval_every > 0:
        evaluator = EvalVsRoundRobin(
            args.scenario, settings, args.eval_every, args.eval_seeds, run_dir / "best_model.zip"
        )
        callbacks.append(evaluator)
    start = time.time()
    model.learn(
        args.timesteps,
        callback=CallbackList(callbacks),
        progress_bar=not args.no_progress,
        reset_num_timesteps=not args.resume,
        tb_log_name=args.algo,
    )
    seconds = time.time() - start
    final_eval = {}
    if evaluator is not None:
        evaluator.model = model
        final_eval = evaluator.evaluate()
        model.logger.dump(model.num_timesteps)
    model.save(run_dir / "model.zip")
    config = {
        "algo": args.algo,
        "scenario": args.scenario,
        "settings": settings,
        "seed": args.seed,
        "n_envs": args.n_envs,
        "timesteps": int(model.num_timesteps),
        "train_seconds": round(seconds, 1),
        "steps_per_second": round(args.timesteps / seconds, 1),
        "resumed_from": args.resume,
        "bc_teacher": None if args.resume or args.bc_teacher == "none" else args.bc_teacher,
        "hyperparams": hyperparams(args.algo, args.scenario),
        "final_eval": final_eval,
    }
    (run_dir / "config.json").write_text(json.dumps(config, indent=2, default=str))
    env.close()
    print(
        f"saved {run_dir / 'model.zip'} after {model.num_timesteps} steps in {seconds:.0f} s "
        f"({config['steps_per_second']} steps/s)"
    )
    if final_eval:
        e = final_eval
        print(
            f"held-out evaluation: objective {e['eval/objective_learned']:.1f} vs round-robin "
            f"{e['eval/objective_round_robin']:.1f} ({e['eval/change_vs_round_robin_pct']:+.2f}%)"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
