"""The measuring scripts' own logic, benchmarks/ and scripts/ (their measurements are not tests:
docs/performance.md)."""

from __future__ import annotations

import sys
from pathlib import Path

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


def test_kernel_traces_count_a_loop_s_kernels_not_the_loop():
    xla_trace = load_script("benchmarks/xla_trace")
    # one thread: a loop [0, 10) running two kernels, then a kernel after it; another thread's kernel
    events = [
        {"name": "while.3", "tid": 1, "ts": 0.0, "dur": 10.0},
        {"name": "add_fusion.1", "tid": 1, "ts": 1.0, "dur": 2.0},
        {"name": "add_fusion.2", "tid": 1, "ts": 4.0, "dur": 3.0},
        {"name": "copy.7", "tid": 1, "ts": 10.0, "dur": 1.0},
        {"name": "dot", "tid": 2, "ts": 2.0, "dur": 5.0},
    ]
    assert [e["name"] for e in xla_trace.leaves(events)] == ["add_fusion.1", "add_fusion.2", "copy.7", "dot"]
    assert xla_trace.time_by_kind(events) == [("add_fusion", 5.0, 2), ("dot", 5.0, 1), ("copy", 1.0, 1)]


def test_a_traced_call_returns_its_result_and_its_program_s_kernels():
    xla_trace = load_script("benchmarks/xla_trace")
    f = jax.jit(lambda x: jnp.tanh(x) @ x)
    x = jnp.ones((16, 16))
    names = set(load_script("benchmarks/throughput").instruction_sources(f.lower(x).compile().as_text()))
    out, events = xla_trace.traced(lambda: f(x))
    assert out.shape == (16, 16) and events
    assert {e["name"] for e in events} <= names  # each event is an instruction of the program


def test_step_scan_times_a_scanned_episode_and_counts_its_copies():
    out = load_script("benchmarks/step_scan").measure("bursty", "step", episode_length=8, repeats=2)
    assert out["us_per_step_min"] <= out["us_per_step_median"] and out["us_per_step_min"] > 0
    assert out["copies"] > 0 and out["reduce_windows"] > 0 and 0 < out["trace_s"] <= out["compile_s"] + 0.05
    again = load_script("benchmarks/step_scan").measure("bursty", "step", episode_length=8, repeats=1)
    assert again["reward_sum"] == out["reward_sum"]  # the same episode: comparable across versions


def test_interleaved_times_another_commit_s_engine_against_this_one(tmp_path):
    """Both engines run and are timed in turn (HEAD against this checkout: the same code in a clean
    clone, so the same episodes there)."""
    tool = load_script("benchmarks/interleaved")
    tool.extract("HEAD", tmp_path)
    assert (tmp_path / "burstgym_base" / "rollout.py").is_file() and not (tmp_path / "burstgym").exists()
    assert "import burstgym_base" in (tmp_path / "burstgym_base" / "env.py").read_text().replace(
        "from", "import"
    )
    sys.path.insert(0, str(tmp_path))
    try:
        versions = {
            "base": tool.engine("burstgym_base", "agents_base", "bursty", 8),
            "tree": tool.engine("burstgym", "agents", "bursty", 8),
        }
        out = tool.compare(versions, clusters=2, rounds=2, length=8, threads=2)
    finally:
        sys.path.remove(str(tmp_path))
        for name in [m for m in sys.modules if m.split(".")[0] in ("burstgym_base", "agents_base")]:
            del sys.modules[name]
    assert len(out["ratio_per_round"]) == 2 and all(r > 0 for r in out["ratio_per_round"])
    assert set(out["decisions_per_s"]) == {"base", "tree"} and set(out["compile_s"]) == {"base", "tree"}
    assert out["decisions_per_s"]["tree"]["min"] > 0 and out["max_relative_ttft_difference"] >= 0


@pytest.mark.parametrize(
    "script, argv, message",
    [
        (
            "benchmarks/throughput",
            ["--chunk", "abc"],
            "argument --chunk: expected auto, all or a positive number, got 'abc'",
        ),
        (
            "benchmarks/throughput",
            ["--jax-routers", "nope"],
            "argument --jax-routers: invalid choice: 'nope'",
        ),
        (
            "benchmarks/throughput",
            ["--batch", "-3"],
            "argument --batch: must be an integer >= 1, got '-3'",
        ),
        ("benchmarks/throughput", ["--scenario", "nope"], "unknown scenario 'nope'"),
        (
            "benchmarks/throughput",
            ["--set", "slot_widths=[7,x]"],
            "scenario setting 'slot_widths' must be a tuple",
        ),
        (
            "benchmarks/throughput",
            ["--scenario", "trace", "--set", "trace=/nope.jsonl"],
            "trace file '/nope.jsonl' does not",
        ),
        (
            "benchmarks/training",
            ["--rollouts", "0"],
            "argument --rollouts: must be an integer >= 1, got '0'",
        ),
        ("benchmarks/training", ["--scenario", "nope"], "unknown scenario 'nope'"),
        ("benchmarks/step_scan", ["--scenario", "nope"], "unknown scenario 'nope'"),
        (
            "benchmarks/vec_env",
            ["--episodes", "0"],
            "argument --episodes: must be an integer >= 1, got '0'",
        ),
        ("benchmarks/vec_env", ["--scenario", "nope"], "unknown scenario 'nope'"),
        (
            "scripts/marginal_cost_accuracy",
            ["--seeds", "0"],
            "argument --seeds: must be an integer >= 1, got '0'",
        ),
        ("scripts/marginal_cost_accuracy", ["--scenarios", "nope"], "unknown scenario 'nope'"),
        ("benchmarks/interleaved", ["--base", "no-such-commit"], "--base 'no-such-commit': fatal: "),
        (
            "benchmarks/interleaved",
            ["--base", "HEAD", "--rounds", "0"],
            "argument --rounds: must be an integer >= 1",
        ),
        ("benchmarks/interleaved", ["--base", "HEAD", "--scenario", "nope"], "unknown scenario 'nope'"),
    ],
)
def test_a_measuring_script_refuses_bad_input_in_one_line(script, argv, message, monkeypatch, capsys):
    main = load_script(script).main
    name = f"{Path(script).name}.py"
    monkeypatch.setattr(sys, "argv", [name, *argv])
    with pytest.raises(SystemExit) as exit_:
        main()
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    last = err.strip().splitlines()[-1]
    assert "Traceback" not in err and last.startswith(f"{name}: error: ") and message in last, err
