"""Training throughput: environment steps per second of the JAX-fed `JaxVecEnv` against SB3's
`DummyVecEnv` over the single Gymnasium environment (each wrapped in `Monitor`), measured in one
run on the same scenario, batch size and random actions, after a warm-up episode (JIT compile).

    python benchmarks/vec_env.py --n-envs 64 --episode-length 128 --episodes 2
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import numpy as np  # noqa: E402
from stable_baselines3.common.monitor import Monitor  # noqa: E402
from stable_baselines3.common.vec_env import DummyVecEnv, VecEnv  # noqa: E402

from agents.sb3_vec_env import JaxVecEnv  # noqa: E402
from burstgym.gym_env import BurstBalanceEnv  # noqa: E402
from burstgym.latency.cliargs import int_at_least, refusals  # noqa: E402


def steps_per_second(env: VecEnv, n_steps: int, warmup: int, seed: int = 0) -> float:
    """Environment steps per second of `env` over `n_steps` batched steps after `warmup` ones."""
    rng = np.random.default_rng(seed)
    n_nodes = env.action_space.n
    env.reset()
    for _ in range(warmup):
        env.step(rng.integers(0, n_nodes, env.num_envs))
    start = time.perf_counter()
    for _ in range(n_steps):
        env.step(rng.integers(0, n_nodes, env.num_envs))
    return n_steps * env.num_envs / (time.perf_counter() - start)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--scenario", default="bursty")
    p.add_argument("--n-envs", type=int_at_least(1), default=64)
    p.add_argument("--episode-length", type=int_at_least(1), default=128)
    p.add_argument("--episodes", type=int_at_least(1), default=2, help="episodes timed after the warm-up one")
    args = p.parse_args()
    with refusals(p):
        run(args)


def run(args: argparse.Namespace) -> None:
    """Time both vector environments on the command line's scenario and print the rates."""
    length = args.episode_length
    jax_env = JaxVecEnv(args.n_envs, args.scenario, seed=0, episode_length=length)
    jax_rate = steps_per_second(jax_env, args.episodes * length, length)
    single = [lambda: Monitor(BurstBalanceEnv(args.scenario, episode_length=length))] * args.n_envs
    dummy = DummyVecEnv(single)
    dummy_rate = steps_per_second(dummy, args.episodes * length, length)
    print(f"{args.scenario}, {args.n_envs} envs, episodes of {length} requests:")
    print(f"  JaxVecEnv (one jitted call)        {jax_rate:10.0f} steps/s")
    print(f"  DummyVecEnv(BurstBalanceEnv)       {dummy_rate:10.0f} steps/s")
    print(f"  speed-up                           {jax_rate / dummy_rate:10.1f}x")


if __name__ == "__main__":
    main()
