"""JAX's persistent compilation cache, on by default, so a configuration compiles once per machine.

Compiling an episode of the JAX core takes tens of seconds on a CPU; with the cache on, a second
process (another `train.py` or `evaluate.py` run, a test worker) loads the compiled program
instead. `import burstgym` calls `enable()`, which points JAX at a cache folder unless the user
chose otherwise:

- `BURSTGYM_JAX_CACHE=/some/folder` moves the cache there; `BURSTGYM_JAX_CACHE=off` (or 0, false,
  no, none) leaves JAX as it is: burstgym turns nothing on;
- a cache folder already given to JAX (`JAX_COMPILATION_CACHE_DIR`, or
  `jax.config.update("jax_compilation_cache_dir", ...)`) is left as it is;
- otherwise the folder is `$XDG_CACHE_HOME/burstgym/jax` (default `~/.cache/burstgym/jax`).

Every program is written, however short its compile (`MIN_COMPILE_SECONDS`, unless
`JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS` says otherwise): building a scenario runs ~20 small
operations one by one (the latency model's arithmetic of its capacity), each compiled apart in
tens of milliseconds, beside the one program that draws its length sample
(docs/performance.md, "Compiling"); loaded from the cache they take a fraction of that. They
add about 1 MB to the folder. JAX keys each entry by the program, the JAX and XLA versions, the
compile options and the device, so a stale entry is never used; the folder can be deleted at
any time. See JAX's "Persistent compilation cache" (https://docs.jax.dev/en/latest/persistent_compilation_cache.html).
JAX still traces a program in every process before it can look it up; the rollout engine's
programs are also kept traced, in `programs/` of the same folder (`burstgym.program_store`).

`jit` is `jax.jit` with `COMPILER_OPTIONS`, used for the core's programs (the rollout engine's
episodes, the environments' steps and metrics, the JAX learner). Four options, all per program,
so the user's own JAX programs in the same process are untouched (docs/performance.md,
"Compiling"):
- XLA:CPU's copy insertion uses its region-based live-range analysis, which proves more of the
  copies around `while` and `cond` carries unneeded: a scan of the `prefix` step
  (`benchmarks/step_scan.py`) holds 368 copies instead of 558, `bursty`'s 195 instead of 298.
  Copies do not change values.
- XLA's tree-reduction rewrite is off. On CPU it splits every reduction of more than 32 elements
  into a `reduce-window` over blocks of 32 and a reduction of the blocks: two kernels, the first
  of which nothing fuses with, for each `any`, `sum` or `max` over a node's slot-by-chunk table.
  The same scan holds 63 `reduce-window`s instead of 434 on `prefix`, 72 instead of 184 on
  `bursty`. Integer and boolean
  reductions give the same values in any order; a float sum of more than 32 terms may round
  differently than with the rewrite, the same in every program compiled with these options (the
  engines agree bit for bit, tests/test_jax_rollout.py).
- XLA:CPU's parallel task assignment is off: it cuts each kernel it judges large (90 of a
  `prefix` episode's, e.g. the per-pair masks over a node's `[S, B]` slot-by-chunk table) into
  parts run on the intra-op thread pool, which on the engine's kernels of some thousand elements
  cost more than it saved (one thread: the `prefix` episode 25% faster without it). Each part
  computes the same elements, so results are bit-identical. The JAX learner's programs (its
  rollouts, which run the policy network at every step, and its updates) keep it
  (`jit(..., parallel=True)`, `PARALLEL_OPTIONS`): without it both ran slower.
- LLVM's optimisation level 1 instead of XLA's default 3 (`LLVM_LEVEL`), for every core program
  but the JAX learner's: XLA's own passes are the same and only the machine code is optimised
  less; the `prefix` episode compiled in 31.2 and 37.2 s against 43.9 and 40.6 s at level 3 and
  ran as fast (docs/performance.md, "LLVM optimisation level 1"). The learner's programs, which
  run the policy network, keep level 3: their measured rates were too noisy to show a gain in run
  time. A level named in XLA_FLAGS (`--xla_backend_optimization_level=N`) is kept for the whole
  process instead.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

ENV = "BURSTGYM_JAX_CACHE"
OFF = ("off", "0", "false", "no", "none")
# Programs compiled faster than this are not written (JAX's default is 1 s); 0 writes every one
# (see the module docstring).
MIN_COMPILE_SECONDS = 0.0
# XLA debug options the core's programs compile with (see the module docstring).
# The JAX learner's programs: XLA:CPU's parallel task assignment kept.
PARALLEL_OPTIONS = {
    "xla_cpu_copy_insertion_use_region_analysis": True,
    "xla_disable_hlo_passes": "tree_reduction_rewriter",
}
# Every other core program: the same, with the parallel task assignment off too, and LLVM's
# optimisation level `LLVM_LEVEL` (XLA's default is 3) unless XLA_FLAGS names a level for the
# whole process (as the test suite does), which is then kept.
LLVM_LEVEL = 1
_LEVEL_NAMED = "--xla_backend_optimization_level" in os.environ.get("XLA_FLAGS", "")
COMPILER_OPTIONS = {
    **PARALLEL_OPTIONS,
    "xla_disable_hlo_passes": PARALLEL_OPTIONS["xla_disable_hlo_passes"] + ",cpu-parallel-task-assigner",
    **({} if _LEVEL_NAMED else {"xla_backend_optimization_level": LLVM_LEVEL}),
}


def default_dir() -> Path:
    """`$XDG_CACHE_HOME/burstgym/jax`, or `~/.cache/burstgym/jax`."""
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "burstgym" / "jax"


def enable(path: str | os.PathLike | None = None) -> Path | None:
    """Turn JAX's persistent compilation cache on in `path` (default: `BURSTGYM_JAX_CACHE`, else a
    folder JAX was already given, else `default_dir()`); returns the folder JAX will use, or None
    when `BURSTGYM_JAX_CACHE` (or `path`) says off. Works before or after `jax` is imported, as long
    as nothing has been compiled yet (JAX reads the setting at its first compilation)."""
    setting = str(path) if path is not None else os.environ.get(ENV)
    if setting is not None and setting.strip().lower() in OFF:
        return None
    chosen = _jax_dir()
    if not setting and chosen:
        return Path(chosen)
    folder = Path(setting).expanduser() if setting else default_dir()
    min_seconds = float(os.environ.get("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", MIN_COMPILE_SECONDS))
    if "jax" in sys.modules:
        import jax

        jax.config.update("jax_compilation_cache_dir", str(folder))
        jax.config.update("jax_persistent_cache_min_compile_time_secs", min_seconds)
    else:  # read by JAX when it is imported (and inherited by child processes)
        os.environ["JAX_COMPILATION_CACHE_DIR"] = str(folder)
        os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = str(min_seconds)
    return folder


def _jax_dir() -> str | None:
    """The cache folder JAX was given already (environment or config), if any."""
    if "jax" in sys.modules:
        import jax

        return jax.config.jax_compilation_cache_dir or None
    return os.environ.get("JAX_COMPILATION_CACHE_DIR") or None


def jit(fn: Callable, *, parallel: bool = False, **kwargs: Any) -> Callable:
    """`jax.jit(fn, **kwargs)` compiled with `COMPILER_OPTIONS`, or with `PARALLEL_OPTIONS` when
    `parallel` (its large kernels cut into parts for XLA:CPU's intra-op thread pool)."""
    import jax

    return jax.jit(fn, compiler_options=PARALLEL_OPTIONS if parallel else COMPILER_OPTIONS, **kwargs)
