"""The benchmark scripts' own logic (their measurements are not tests: docs/performance.md)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
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
