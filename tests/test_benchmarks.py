"""The benchmark scripts' own logic (their measurements are not tests: docs/performance.md)."""

from __future__ import annotations

import sys

import jax
import jax.numpy as jnp
import pytest
from conftest import load_script

from burstgym import prefix_cache


def test_kernels_are_named_after_the_source_line_that_made_them():
    a = jnp.arange(8, dtype=jnp.int32)
    hlo = jax.jit(prefix_cache.ceil_div).lower(a, a + 1).compile().as_text()
    sources = load_script("benchmarks/throughput").instruction_sources(hlo)
    divides = [where for op, _, where in sources.values() if op == "divide"]
    line = prefix_cache.ceil_div.__code__.co_firstlineno + 2  # the body after the docstring
    assert divides and set(divides) == {f"burstgym/prefix_cache.py:{line} ceil_div"}
    assert all(len(v) == 3 for v in sources.values())


def test_step_scan_times_a_scanned_episode_and_counts_its_copies():
    out = load_script("benchmarks/step_scan").measure("bursty", "step", episode_length=8, repeats=2)
    assert out["us_per_step_min"] <= out["us_per_step_median"] and out["us_per_step_min"] > 0
    assert out["copies"] > 0 and out["reduce_windows"] > 0 and out["compile_s"] >= 0
    again = load_script("benchmarks/step_scan").measure("bursty", "step", episode_length=8, repeats=1)
    assert again["reward_sum"] == out["reward_sum"]  # the same episode: comparable across versions


@pytest.mark.parametrize(
    "script, argv, message",
    [
        (
            "throughput",
            ["--chunk", "abc"],
            "argument --chunk: expected auto, all or a positive number, got 'abc'",
        ),
        ("throughput", ["--jax-routers", "nope"], "argument --jax-routers: invalid choice: 'nope'"),
        ("throughput", ["--batch", "-3"], "--batch and --jax-clusters sizes and --episodes must be positive"),
        ("throughput", ["--scenario", "nope"], "unknown scenario 'nope'"),
        ("throughput", ["--set", "slot_widths=[7,x]"], "scenario setting 'slot_widths' must be a tuple"),
        (
            "throughput",
            ["--scenario", "trace", "--set", "trace=/nope.jsonl"],
            "trace file '/nope.jsonl' does not",
        ),
        ("training", ["--rollouts", "0"], "--n-envs, --episode-length and --rollouts must be positive"),
        ("training", ["--scenario", "nope"], "unknown scenario 'nope'"),
        ("step_scan", ["--scenario", "nope"], "unknown scenario 'nope'"),
    ],
)
def test_a_benchmark_refuses_bad_input_in_one_line(script, argv, message, monkeypatch, capsys):
    main = load_script(f"benchmarks/{script}").main
    monkeypatch.setattr(sys, "argv", [f"{script}.py", *argv])
    with pytest.raises(SystemExit) as exit_:
        main()
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    last = err.strip().splitlines()[-1]
    assert "Traceback" not in err and last.startswith(f"{script}.py: error: ") and message in last, err
