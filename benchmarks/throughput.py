"""Routing decisions per second: the vector environment at several batch sizes, the single
Gymnasium environment, and the plain-Python reference simulator, measured in one run.

Each configuration runs whole episodes (the final, draining step included) with round-robin
actions after a warm-up episode that pays the JIT compile, and reports decisions (environment
steps) per second of wall time.

    python benchmarks/throughput.py                      # 1, 256, 4096 environments
    python benchmarks/throughput.py --batch 1 64 --episode-length 128 --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax  # noqa: E402
import numpy as np  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from burstgym import reference  # noqa: E402
from burstgym.gym_env import BurstBalanceEnv, BurstBalanceVectorEnv  # noqa: E402


def vector_rate(n_envs: int, scenario: str, settings: dict, episodes: int) -> float:
    """Decisions per second of `BurstBalanceVectorEnv(n_envs)` over whole episodes."""
    env = BurstBalanceVectorEnv(n_envs, scenario, **settings)
    length = env.cfg.episode_length
    n_nodes = env.cfg.n_nodes
    env.reset(seed=0)
    base = np.arange(n_envs)
    for k in range(length):  # warm-up episode: compiles step and auto-reset
        env.step((base + k) % n_nodes)
    start = time.perf_counter()
    for k in range(episodes * length):
        env.step((base + k) % n_nodes)
    return n_envs * episodes * length / (time.perf_counter() - start)


def single_rate(scenario: str, settings: dict, episodes: int) -> float:
    """Decisions per second of the single Gymnasium environment over whole episodes."""
    env = BurstBalanceEnv(scenario, **settings)
    n_nodes = env.cfg.n_nodes
    steps = 0
    start = None
    for ep in range(episodes + 1):
        if ep == 1:
            start = time.perf_counter()
        env.reset(seed=ep)
        done, k = False, 0
        while not done:
            _, _, terminated, truncated, _ = env.step(k % n_nodes)
            done = terminated or truncated
            k += 1
        steps += k if ep else 0
    return steps / (time.perf_counter() - start)


def reference_rate(scenario: str, settings: dict, episodes: int) -> float:
    """Decisions per second of the reference simulator on the same streams, round-robin routed."""
    env = BurstBalanceEnv(scenario, **settings)
    nodes = reference.nodes_from_params(env.cfg, env.params)
    total, elapsed = 0, 0.0
    for ep in range(episodes):
        _, state = env.core.reset(jax.random.key(ep), env.params)
        req = jax.tree.map(np.asarray, state.requests)
        e = env.cfg.episode_length
        actions = np.arange(e) % len(nodes)
        start = time.perf_counter()
        reference.simulate(
            nodes, req.arrival[:e], req.prompt[:e], req.output[:e], actions, chunk_ids=req.chunk_ids[:e],
            id_tokens=req.id_tokens[:e], chunk_tokens=req.chunk_tokens, grain=env.cfg.chunk_tokens,
        )
        elapsed += time.perf_counter() - start
        total += e
    return total / elapsed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--scenario", default="bursty")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 256, 4096], help="vector env sizes")
    ap.add_argument("--episode-length", type=int, default=128)
    ap.add_argument("--episodes", type=int, default=1, help="timed episodes per configuration")
    ap.add_argument("--json", help="also write the figures to this JSON file")
    args = ap.parse_args()
    settings = {"episode_length": args.episode_length}
    console = Console()
    rates: dict[str, float] = {}
    with console.status("single Gymnasium environment"):
        rates["gymnasium env (1)"] = single_rate(args.scenario, settings, args.episodes)
    with console.status("reference simulator"):
        rates["reference simulator"] = reference_rate(args.scenario, settings, args.episodes)
    for b in args.batch:
        with console.status(f"vector env x{b}"):
            rates[f"vector env ({b})"] = vector_rate(b, args.scenario, settings, args.episodes)
    single = rates["gymnasium env (1)"]
    table = Table(
        title=f"decisions/s, scenario {args.scenario}, episode_length {args.episode_length}, "
        f"{os.cpu_count()} CPUs, jax {jax.__version__} on {jax.default_backend()}"
    )
    table.add_column("configuration")
    table.add_column("decisions/s", justify="right")
    table.add_column("x single env", justify="right")
    for name, r in rates.items():
        table.add_row(name, f"{r:,.0f}", f"{r / single:,.1f}")
    console.print(table)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {"scenario": args.scenario, "episode_length": args.episode_length, "rates": rates},
                f,
                indent=2,
            )


if __name__ == "__main__":
    main()
