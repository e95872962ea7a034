"""Microseconds per step of a user's own JAX program over the functional environment: a
`jax.lax.scan` of `BurstBalance.step_env` (or `step`, with auto-reset) over one cluster's episode,
round-robin actions, compiled with a plain `jax.jit` (none of burstgym's compiler options). One
compiling call, then `--repeats` timed calls on the same episode; prints and optionally writes the
median, the minimum, the compile seconds (and of them the tracing's), the reward sum (to compare
versions) and the compiled program's `copy` and `reduce-window` instructions. XLA options given
through `XLA_FLAGS` apply, so the core's compiler options (`burstgym.compile_cache.COMPILER_OPTIONS`)
can be measured one by one:

    python benchmarks/step_scan.py --scenario prefix --function step_env --json scan.json
    XLA_FLAGS=--xla_cpu_copy_insertion_use_region_analysis=true python benchmarks/step_scan.py
    XLA_FLAGS=--xla_disable_hlo_passes=tree_reduction_rewriter python benchmarks/step_scan.py
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import time

import jax
import jax.numpy as jnp

from burstgym import scenarios
from burstgym.env import BurstBalance
from burstgym.latency.cliargs import int_at_least, refusals


def measure(scenario: str, function: str, episode_length: int, repeats: int) -> dict:
    """The figures of one scan (see the module docstring)."""
    cfg, params = scenarios.make(scenario, episode_length=episode_length)
    core = BurstBalance(cfg)
    step = getattr(core, function)
    steps = episode_length - 1  # step_env must not step past the episode's last arrival

    def run(state):
        def body(s, _):
            obs, s, reward, done, info = step(s, (s.step % cfg.n_nodes).astype(jnp.int32), params)
            return s, reward

        return jax.lax.scan(body, state, None, length=steps)

    _, state = core.reset(jax.random.key(0), params)
    start = time.perf_counter()
    traced = jax.jit(run).trace(state)
    trace_s = time.perf_counter() - start
    compiled = traced.lower().compile()
    compile_s = time.perf_counter() - start
    hlo = compiled.as_text()
    rewards = jax.block_until_ready(compiled(state))[1]
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(compiled(state))
        times.append((time.perf_counter() - start) / steps * 1e6)
    return {
        "scenario": scenario,
        "function": function,
        "episode_length": episode_length,
        "us_per_step_median": round(statistics.median(times), 1),
        "us_per_step_min": round(min(times), 1),
        "compile_s": round(compile_s, 1),
        "trace_s": round(trace_s, 2),
        "reward_sum": float(rewards.sum()),
        "copies": len(re.findall(r"= \S+ copy\(", hlo)),
        "reduce_windows": len(re.findall(r"= \S+ reduce-window\(", hlo)),
        "device": jax.default_backend(),
        "jax": jax.__version__,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--scenario", default="prefix")
    ap.add_argument("--function", default="step_env", choices=["step_env", "step"])
    ap.add_argument("--episode-length", type=int_at_least(2), default=512)
    ap.add_argument("--repeats", type=int_at_least(1), default=5)
    ap.add_argument("--json", help="also write the figures to this JSON file")
    args = ap.parse_args()
    with refusals(ap):
        out = measure(args.scenario, args.function, args.episode_length, args.repeats)
    print(
        f"{args.scenario} {args.function}: {out['us_per_step_median']} us per step (median of "
        f"{args.repeats}; min {out['us_per_step_min']}), compile {out['compile_s']} s (tracing "
        f"{out['trace_s']} s), "
        f"reward sum {out['reward_sum']:.6g}, {out['copies']} copy and {out['reduce_windows']} "
        "reduce-window instructions"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)


if __name__ == "__main__":
    main()
