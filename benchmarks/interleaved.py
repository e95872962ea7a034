"""The rollout engine of this checkout against the one of another commit, timed in one process,
alternating, so both see the same machine at the same moments.

On a shared machine the speed of a fresh process moves by more than most changes (two runs of the
same `throughput.py` command a minute apart can differ by a fifth), so an A/B comparison of two
worktrees in alternating processes needs many pairs. Here the other commit's `burstgym` and
`agents` are extracted with `git archive` into a temporary folder as `burstgym_base` and
`agents_base` (their imports renamed), both engines compile the same scenario, and each round
runs one episode batch of each, in turn; the per-round ratio cancels what the machine does in
between. It also reports whether both give the same episodes (objective, TTFT) and each one's
compile seconds (with `BURSTGYM_JAX_CACHE=off`, else what loading them from the cache took).

    python benchmarks/interleaved.py --base 3bbacdb --scenario bursty --clusters 32 --rounds 14
"""

from __future__ import annotations

import argparse
import importlib
import io
import json
import re
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from burstgym.latency.cliargs import int_at_least, refusals  # noqa: E402

PACKAGES = ("burstgym", "agents")


def extract(commit: str, into: Path) -> None:
    """`burstgym` and `agents` of `commit` under `into` as `burstgym_base` and `agents_base`."""
    done = subprocess.run(
        ["git", "-C", str(ROOT), "archive", "--format=tar", commit, *PACKAGES], capture_output=True
    )
    if done.returncode != 0:
        raise ValueError(f"--base {commit!r}: {done.stderr.decode().strip().splitlines()[-1]}")
    with tarfile.open(fileobj=io.BytesIO(done.stdout)) as tar:
        tar.extractall(into, filter="data")
    rename = re.compile(r"\b(" + "|".join(PACKAGES) + r")\b")
    for package in PACKAGES:
        (into / package).rename(into / f"{package}_base")
    for path in into.rglob("*.py"):
        path.write_text(rename.sub(r"\1_base", path.read_text()))


def engine(package: str, agents: str, scenario: str, length: int):
    """(rollout, cfg, params, routers) of one copy of the package."""
    scenarios = importlib.import_module(f"{package}.scenarios")
    rollout = importlib.import_module(f"{package}.rollout").rollout
    routers = importlib.import_module(f"{agents}.routers")
    cfg, params = scenarios.make(scenario, episode_length=length)
    return rollout, cfg, params, [routers.make_rule("round-robin")]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", required=True, help="the commit to compare with (any name git knows)")
    ap.add_argument("--scenario", default="bursty")
    ap.add_argument("--episode-length", type=int_at_least(2), default=512)
    ap.add_argument("--clusters", type=int_at_least(1), default=32, help="clusters per episode batch")
    ap.add_argument("--rounds", type=int_at_least(1), default=14)
    ap.add_argument(
        "--threads", type=int_at_least(1), default=1, help="threads each batch runs from (rollout's threads=)"
    )
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args()
    with refusals(ap), tempfile.TemporaryDirectory() as folder:
        extract(args.base, Path(folder))
        sys.path.insert(0, folder)
        versions = {
            f"{args.base} (base)": engine("burstgym_base", "agents_base", args.scenario, args.episode_length),
            "this checkout": engine("burstgym", "agents", args.scenario, args.episode_length),
        }
        results = compare(versions, args.clusters, args.rounds, args.episode_length, args.threads)
    text = json.dumps(
        {
            "base": args.base,
            "scenario": args.scenario,
            "clusters": args.clusters,
            "threads": args.threads,
            **results,
        },
        indent=1,
    )
    print(text)
    if args.json:
        Path(args.json).write_text(text + "\n")


def compare(versions: dict, clusters: int, rounds: int, length: int, threads: int = 1) -> dict:
    """Compile both (the compile seconds each reports), check their episodes, then time `rounds`
    alternating batches, each run from `threads` threads (one part of the clusters each)."""
    first, compile_s = {}, {}
    for name, (rollout, cfg, params, rule) in versions.items():
        first[name] = rollout(cfg, params, rule, list(range(clusters)), threads=threads)
        compile_s[name] = first[name].compile_s
    a, b = first.values()
    ttft_a, ttft_b = np.asarray(a.ttft), np.asarray(b.ttft)
    both = np.isfinite(ttft_a) & np.isfinite(ttft_b)
    rel = np.abs(ttft_a - ttft_b)[both] / np.maximum(np.abs(ttft_a[both]), 1e-12)
    rates = {name: [] for name in versions}
    for r in range(rounds):
        seeds = [s + 1000 * (r + 1) for s in range(clusters)]
        for name, (rollout, cfg, params, rule) in versions.items():
            start = time.perf_counter()
            rollout(cfg, params, rule, seeds, threads=threads)
            rates[name].append(clusters * length / (time.perf_counter() - start))
    base, new = rates.values()
    ratios = [y / x for x, y in zip(base, new, strict=True)]
    return {
        "compile_s": compile_s,
        "decisions_per_s": {
            n: {"median": float(np.median(v)), "max": max(v), "min": min(v)} for n, v in rates.items()
        },
        "ratio_per_round": ratios,
        "ratio_median": float(np.median(ratios)),
        "rounds_faster": int(sum(x > 1 for x in ratios)),
        "same_objective": bool(np.array_equal(np.asarray(a.objective), np.asarray(b.objective))),
        "same_ttft": bool(np.array_equal(ttft_a, ttft_b, equal_nan=True)),
        "max_relative_ttft_difference": float(rel.max()) if rel.size else 0.0,
    }


if __name__ == "__main__":
    main()
