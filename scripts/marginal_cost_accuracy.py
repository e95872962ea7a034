"""How well marginal-cost's latency model predicts the simulator: per request, the TTFT and
end-to-end latency `burstgym.prediction.estimate` predicts on the node it is routed to (round-robin)
against the simulated ones.

    python scripts/marginal_cost_accuracy.py --scenarios steady bursty bursty-dynamic prefix --seeds 4

Two predictions per request: with the workload's mean output length (what the router uses) and
with the request's own output length (the model's error once the unknown length is removed).
Prints the mean and median absolute error in % of the simulated latency.
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np

from agents.marginal_cost import MarginalCost
from burstgym import scenarios
from burstgym.env import BurstBalance
from burstgym.latency.cliargs import int_at_least, refusals


def errors(scenario: str, seeds: list[int], episode_length: int, n_nodes: int) -> dict[str, np.ndarray]:
    """Relative errors |predicted - simulated| / simulated of every served request of the episodes:
    keys ttft, e2e (mean output) and ttft_known, e2e_known (own output)."""
    cfg, params = scenarios.make(scenario, n_nodes=n_nodes, episode_length=episode_length)
    core = BurstBalance(cfg)
    router = MarginalCost.for_scenario(cfg, params)

    @jax.jit
    def predict(state, output):
        view = core.view(state, params)
        node = state.step % n_nodes
        mean = router.estimate(view)
        known = router.replace(lengths=router.lengths._replace(mean_output=output)).estimate(view)
        return jnp.stack([mean.ttft[node], mean.e2e[node], known.ttft[node], known.e2e[node]])

    step = jax.jit(core.step_env)
    out = []
    for seed in seeds:
        _, state = core.reset(jax.random.key(seed), params)
        outputs = np.asarray(state.requests.output, np.float32)
        rows = []
        for k in range(episode_length):
            rows.append(np.asarray(predict(state, outputs[k])))
            _, state, *_ = step(state, jnp.int32(k % n_nodes), params)
        simulated = np.stack([state.log.ttft, state.log.e2e] * 2, axis=1)
        served = ~np.asarray(state.log.dropped)
        out.append((np.abs(np.stack(rows) - simulated) / simulated)[served])
    rel = np.concatenate(out)
    return dict(zip(("ttft", "e2e", "ttft_known", "e2e_known"), rel.T, strict=True))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--scenarios", nargs="+", default=["steady", "bursty", "bursty-dynamic", "prefix"])
    p.add_argument("--seeds", type=int_at_least(1), default=4)
    p.add_argument("--episode-length", type=int_at_least(1), default=256)
    p.add_argument("--nodes", type=int_at_least(1), default=4)
    args = p.parse_args()
    with refusals(p):
        run(args)


def run(args: argparse.Namespace) -> None:
    """Print the error table for the command line's scenarios."""
    print(
        "| scenario | TTFT mean / median error | e2e mean / median error | with its own output: TTFT | e2e |"
    )
    print("|---|---:|---:|---:|---:|")
    for name in args.scenarios:
        e = errors(name, list(range(args.seeds)), args.episode_length, args.nodes)

        def cell(x: np.ndarray) -> str:
            return f"{100 * np.mean(x):.1f}% / {100 * np.median(x):.1f}%"

        cells = [cell(e[k]) for k in ("ttft", "e2e", "ttft_known", "e2e_known")]
        print(f"| {name} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
