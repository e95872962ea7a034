"""burstgym.compile_cache: the persistent compilation cache that `import burstgym` turns on (on by
default in the user's cache folder, moved or switched off by BURSTGYM_JAX_CACHE, a folder given to
JAX left alone, and a second process loading what the first compiled; each of these cases runs in a
fresh Python process, since JAX reads the setting at its first compilation), and the compiler
options of the core's programs (`compile_cache.jit`, checked in this process)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from burstgym import compile_cache, scenarios
from burstgym.env import BurstBalance

PROGRAM = textwrap.dedent(
    """
    import json, sys
    import jax, jax.numpy as jnp
    hits = []
    jax.monitoring.register_event_listener(
        lambda name, **kw: hits.append(name) if name == "/jax/compilation_cache/cache_hits" else None
    )
    import burstgym
    from burstgym import compile_cache
    folder = compile_cache.enable()  # what import burstgym did, returned again
    jax.jit(lambda x: jnp.cumsum(x * 3.0) - 1.0)(jnp.arange(64.0)).block_until_ready()
    print(json.dumps({"folder": None if folder is None else str(folder),
                      "jax_dir": jax.config.jax_compilation_cache_dir or None, "hits": len(hits)}))
    """
)


def _run(tmp_path: Path, **env: str) -> dict:
    """Run PROGRAM with `env` over a clean environment (no cache setting of the test run): its
    program compiles in milliseconds, so a second process loads it only because burstgym writes
    every program (compile_cache.MIN_COMPILE_SECONDS)."""
    base = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_", "BURSTGYM_JAX"))}
    base.update(
        XDG_CACHE_HOME=str(tmp_path / "xdg"),
        JAX_PLATFORMS="cpu",
        **env,
    )
    out = subprocess.run(
        [sys.executable, "-c", PROGRAM], env=base, capture_output=True, text=True, timeout=300, check=False
    )
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def _files(folder: Path) -> list[Path]:
    return [p for p in folder.rglob("*") if p.is_file()] if folder.exists() else []


def test_on_by_default_in_the_user_cache_folder_and_reused_by_a_second_process(tmp_path) -> None:
    folder = tmp_path / "xdg" / "burstgym" / "jax"
    first = _run(tmp_path)
    assert first == {"folder": str(folder), "jax_dir": str(folder), "hits": 0}
    assert _files(folder), "nothing was written to the cache folder"
    second = _run(tmp_path)
    assert second["hits"] >= 1  # the second process loaded the program instead of compiling it


def test_moved_by_the_environment_variable(tmp_path) -> None:
    moved = tmp_path / "elsewhere"
    out = _run(tmp_path, BURSTGYM_JAX_CACHE=str(moved))
    assert out["folder"] == out["jax_dir"] == str(moved)
    assert _files(moved) and not _files(tmp_path / "xdg")


@pytest.mark.parametrize("off", ["off", "0", "OFF"])
def test_switched_off_writes_nothing(tmp_path, off) -> None:
    out = _run(tmp_path, BURSTGYM_JAX_CACHE=off)
    assert out == {"folder": None, "jax_dir": None, "hits": 0}
    assert not _files(tmp_path)


def test_a_folder_given_to_jax_is_left_as_it_is(tmp_path) -> None:
    mine = tmp_path / "jax-own"
    # JAX's own settings stay too: its default writes only programs compiled in over a second
    out = _run(tmp_path, JAX_COMPILATION_CACHE_DIR=str(mine), JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0")
    assert out["folder"] == out["jax_dir"] == str(mine)
    assert _files(mine) and not _files(tmp_path / "xdg")


@pytest.mark.parametrize("flags", ["", "--xla_backend_optimization_level=0"])
def test_core_programs_compile_at_llvm_level_1_unless_xla_flags_names_a_level(flags) -> None:
    """The core's programs get LLVM level 1 (the learner's keep XLA's default), unless the process's
    XLA_FLAGS names a level, which then holds for every program (the test suite sets 0)."""
    show = "import json\nfrom burstgym import compile_cache as c\n"
    show += "print(json.dumps([c.COMPILER_OPTIONS, c.PARALLEL_OPTIONS]))"
    env = {**os.environ, "XLA_FLAGS": flags, "JAX_PLATFORMS": "cpu", "BURSTGYM_JAX_CACHE": "off"}
    out = subprocess.run([sys.executable, "-c", show], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    core, learner = json.loads(out.stdout.strip().splitlines()[-1])
    assert core.get("xla_backend_optimization_level") == (None if flags else 1)
    assert "xla_backend_optimization_level" not in learner


def test_core_programs_compile_with_fewer_copies_and_reductions_and_the_same_results() -> None:
    """`compile_cache.jit` (the core's programs) compiles the step with XLA's region-based copy
    insertion, without its tree-reduction rewrite and without its parallel task assignment: fewer
    copies and `reduce-window` kernels than plain `jax.jit`, no kernel cut into parts, and
    bit-identical states and rewards over this episode (a copy never changes a value; without the
    rewrite only a float sum of more than 32 terms may round differently, and none does here)."""
    cfg, params = scenarios.make("prefix", episode_length=16, slot_widths=[], chunk_widths=[])
    core = BurstBalance(cfg)
    _, state = core.reset(jax.random.key(3), params)
    action = jnp.int32(0)
    plain = jax.jit(core.step_env).lower(state, action, params).compile()
    ours = compile_cache.jit(core.step_env).lower(state, action, params).compile()

    def count(compiled, op: str) -> int:
        return len(re.findall(rf"= \S+ {op}\(", compiled.as_text()))

    assert count(ours, "copy") < count(plain, "copy")
    assert count(ours, "reduce-window") < count(plain, "reduce-window") / 2
    assert "outer_dimension_partitions" not in ours.as_text()  # no kernel cut for the thread pool
    a = b = state
    for k in range(cfg.episode_length):
        _, a, ra, done_a, _ = plain(a, jnp.int32(k % cfg.n_nodes), params)
        _, b, rb, done_b, _ = ours(b, jnp.int32(k % cfg.n_nodes), params)
        assert np.asarray(ra).tobytes() == np.asarray(rb).tobytes()
        assert bool(done_a) == bool(done_b)

    def raw(x) -> bytes:
        return np.asarray(
            jax.random.key_data(x) if jnp.issubdtype(x.dtype, jax.dtypes.prng_key) else x
        ).tobytes()

    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        assert raw(x) == raw(y)
    assert bool(done_b)


@pytest.mark.skipif(
    len(os.sched_getaffinity(0)) < 2, reason="XLA:CPU cuts kernels into parts only with 2+ cores"
)
def test_core_programs_keep_kernels_whole_and_the_learner_s_programs_may_cut_them() -> None:
    """`compile_cache.jit` turns XLA:CPU's parallel task assignment off (no kernel is cut into
    parts for the intra-op thread pool), `jit(..., parallel=True)` keeps it, and both compute the
    same bits."""

    def fn(x: jax.Array) -> jax.Array:
        return jnp.tanh(x * 1.5 + 0.25) * x

    x = jnp.linspace(-3.0, 3.0, 1 << 20).reshape(1024, 1024)
    whole = compile_cache.jit(fn).lower(x).compile()
    cut = compile_cache.jit(fn, parallel=True).lower(x).compile()
    assert "outer_dimension_partitions" not in whole.as_text()
    assert "outer_dimension_partitions" in cut.as_text()
    assert np.asarray(whole(x)).tobytes() == np.asarray(cut(x)).tobytes()
