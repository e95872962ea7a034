"""PPO training steps/s: SB3's PPO (on the JAX-fed `JaxVecEnv`) against the JAX learner
(`agents.jax_ppo`) in one run, on the same scenario, clusters, episode length and
hyperparameters (`agents/hyperparams.yml`), the same node-scoring policy. Each side runs one
warm-up rollout and update first (JIT compile, reported apart), then `--rollouts` timed ones; the
JAX learner's rollouts and updates are also timed apart (`rollout_s`, `update_s`).

    python benchmarks/training.py --scenario prefix --n-envs 128 --rollouts 4 --json ppo.json
    python benchmarks/training.py --profile    # the JAX learner's update, by kind of kernel

`--profile` traces one update of the JAX learner (`JaxPPO.learn`, after a warm-up update) with
`jax.profiler` and lists the kinds of XLA kernels with the most traced time
(benchmarks/xla_trace.py). The rollout's time is the environment step's, which
`benchmarks/throughput.py --kernels` and `benchmarks/step_scan.py` break down.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import sys
import time
from pathlib import Path

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax  # noqa: E402
import torch  # noqa: E402

from agents.hyperparams import load, normalize_kwargs  # noqa: E402
from agents.jax_ppo import JaxPPO, PPOConfig  # noqa: E402
from agents.learners import make_model, normalize_env  # noqa: E402
from agents.sb3_vec_env import JaxVecEnv  # noqa: E402
from burstgym import scenarios  # noqa: E402
from burstgym.latency.cliargs import int_at_least, refusals  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the scripts' shared module
import xla_trace  # noqa: E402


def sb3_rate(scenario: str, n_envs: int, episode_length: int, rollouts: int, entry: dict) -> dict:
    """SB3 PPO: seconds of one warm-up `learn` of one rollout, then steps/s of `rollouts` more."""
    env = normalize_env(
        JaxVecEnv(n_envs, scenario, seed=0, stagger=True, episode_length=episode_length),
        normalize_kwargs(entry),
    )
    model = make_model("ppo", env, scenario, 0, None, entry=entry)
    steps = model.n_steps * n_envs
    start = time.perf_counter()
    model.learn(steps)
    warm = time.perf_counter() - start
    start = time.perf_counter()
    model.learn(steps * rollouts, reset_num_timesteps=False)
    run = time.perf_counter() - start
    env.close()
    return {"learner": "sb3-ppo", "warmup_s": round(warm, 2), "steps": steps * rollouts, "seconds": run}


def jax_learner(scenario: str, n_envs: int, episode_length: int, entry: dict, updates: int) -> JaxPPO:
    """The JAX learner of the hyperparameter `entry` on `n_envs` clusters, planned for `updates`
    updates (its learning-rate schedule's horizon), not yet set up."""
    cfg, params = scenarios.make(scenario, episode_length=episode_length)
    ppo = PPOConfig.from_entry(entry)
    return JaxPPO(cfg, params, ppo, n_envs, n_envs * ppo.n_steps * updates)


def jax_rate(scenario: str, n_envs: int, episode_length: int, rollouts: int, entry: dict) -> dict:
    """The JAX learner: seconds of the first update (compile and run), then steps/s of `rollouts`
    more, and the seconds of their rollouts (`JaxPPO.collect`) and updates (`JaxPPO.learn`) apart."""
    learner = jax_learner(scenario, n_envs, episode_length, entry, rollouts + 1)
    start = time.perf_counter()
    learner.setup(0)
    learner.update()
    warm = time.perf_counter() - start
    collect = learn = 0.0
    for _ in range(rollouts):
        start = time.perf_counter()
        rollout = jax.block_until_ready(learner.collect())
        middle = time.perf_counter()
        learner.learn(*rollout)  # returns host floats: it has finished
        collect += middle - start
        learn += time.perf_counter() - middle
    return {
        "learner": "jax-ppo",
        "warmup_s": round(warm, 2),
        "steps": n_envs * learner.ppo.n_steps * rollouts,
        "seconds": collect + learn,
        "rollout_s": round(collect, 3),
        "update_s": round(learn, 3),
    }


def jax_profile(scenario: str, n_envs: int, episode_length: int, entry: dict, top: int = 8) -> dict:
    """The JAX learner's update: after one warm-up update, one rollout's update traced, as its
    steps, kernels run, traced milliseconds and the `top` kinds by traced time (kind,
    milliseconds, runs)."""
    learner = jax_learner(scenario, n_envs, episode_length, entry, 3)
    learner.setup(0)
    learner.update()
    rollout = jax.block_until_ready(learner.collect())
    _, events = xla_trace.traced(lambda: learner.learn(*rollout))
    kinds = xla_trace.time_by_kind(events)
    return {
        "steps": n_envs * learner.ppo.n_steps,
        "kernels": sum(runs for _, _, runs in kinds),
        "traced_ms": round(sum(us for _, us, _ in kinds) / 1e3, 2),
        "top": [(k, round(us / 1e3, 2), runs) for k, us, runs in kinds[:top]],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--scenario", default="prefix")
    ap.add_argument("--n-envs", type=int_at_least(1), default=128)
    ap.add_argument("--episode-length", type=int_at_least(1), default=256)
    ap.add_argument(
        "--rollouts", type=int_at_least(1), default=4, help="timed rollouts (and updates) per learner"
    )
    ap.add_argument("--learners", nargs="+", default=["sb3-ppo", "jax-ppo"], choices=["sb3-ppo", "jax-ppo"])
    ap.add_argument(
        "--profile", action="store_true", help="only trace one JAX learner update, its kernels by kind"
    )
    ap.add_argument("--json", help="also write the figures to this JSON file")
    args = ap.parse_args()
    with refusals(ap):
        run(args)


def run(args: argparse.Namespace) -> None:
    """Time each learner of the command line; print and optionally write the figures."""
    torch.set_num_threads(1)
    entry = load("ppo", args.scenario)
    if args.profile:
        p = jax_profile(args.scenario, args.n_envs, args.episode_length, entry)
        top = ", ".join(f"{k} {ms} ms ({runs})" for k, ms, runs in p["top"])
        print(f"jax-ppo update of {p['steps']} steps: {p['kernels']} kernels, {p['traced_ms']} ms traced")
        print(f"  most traced time: {top}")
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"scenario": args.scenario, "n_envs": args.n_envs, "update": p}, f, indent=2)
        return
    fns = {"sb3-ppo": sb3_rate, "jax-ppo": jax_rate}
    rows = []
    for name in args.learners:
        row = fns[name](args.scenario, args.n_envs, args.episode_length, args.rollouts, entry)
        row["steps_per_s"] = round(row["steps"] / row["seconds"], 1)
        row["seconds"] = round(row["seconds"], 2)
        rows.append(row)
        parts = ""
        if "rollout_s" in row:
            row["rollout_steps_per_s"] = round(row["steps"] / row["rollout_s"], 1)
            parts = (
                f"; rollouts {row['rollout_s']} s ({row['rollout_steps_per_s']} steps/s), "
                f"updates {row['update_s']} s"
            )
        print(
            f"{name}: {row['steps_per_s']} steps/s ({row['steps']} steps in {row['seconds']} s{parts}; "
            f"warm-up {row['warmup_s']} s)"
        )
    out = {
        "scenario": args.scenario,
        "n_envs": args.n_envs,
        "episode_length": args.episode_length,
        "hyperparams": dataclasses.asdict(PPOConfig.from_entry(entry)),
        "device": jax.default_backend(),
        "jax": jax.__version__,
        "torch": torch.__version__,
        "cpus": os.cpu_count(),
        "machine": platform.machine(),
        "load_average": os.getloadavg(),
        "results": rows,
    }
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)


if __name__ == "__main__":
    main()
