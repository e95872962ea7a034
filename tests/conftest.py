"""Shared helpers for the tests of the JAX core: jitted episode rollouts cached per configuration,
and the invariant counts read from the slot table.

Compilation dominates the run time of these tests, so every jitted function is cached per
(EnvConfig, x64 flag) and reused by every test and hypothesis example with that configuration,
and the processes of one test run share compiled programs through JAX's persistent cache
(`pytest_configure`). The test processes compile with two XLA options (added to XLA_FLAGS below
unless the caller's XLA_FLAGS names them; inherited by the workers and subprocesses): LLVM's
optimisation level 0, and XLA:CPU's older elemental emitters in place of its MLIR fusion emitters.
XLA's own passes are unchanged, the machine code is slower, and the suite, which compiles far
longer than it runs, finishes sooner (docs/performance.md, "Compiling"). Results agree with the
default code generation's to rounding; where a test compares two differently built programs bit
for bit (the engines, a sharded and an unsharded call), the agreement is a property of the default
emitters that users run, so a test marked `default_codegen` runs in a child process that compiles
with them (`pytest_pyfunc_call`).
"""

from __future__ import annotations

import functools
import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

# The suite's XLA options (see the module docstring), read when JAX starts its CPU backend, after
# this file is imported
if "--xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_backend_optimization_level=0"
if "--xla_cpu_use_fusion_emitters" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_cpu_use_fusion_emitters=false"

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from burstgym import cluster, scenarios, scheduler
from burstgym import prefix_cache as pc
from burstgym.env import BurstBalance
from burstgym.rollout import clear_compiled
from burstgym.types import EMPTY, RUNNING, WAITING, EnvConfig

_CACHE_DIR = pytest.StashKey[str]()
ROOT = Path(__file__).resolve().parents[1]
# Small, tight nodes: 4 running requests, a 6-deep queue, 768 KV tokens, short requests (the
# shared small cluster `BASE` and `TIGHT_SHARED_PREFIX` below).
TIGHT_NODES = dict(
    max_num_seqs=4,
    queue_capacity=6,
    kv_capacity_tokens=768,
    max_num_batched_tokens=256,
    prompt_median=64.0,
    prompt_max=256,
    output_median=32.0,
    output_max=128,
)
# Shared system prompts in 64-token chunks on the tight nodes' 768 KV tokens (12 chunks): under
# skewed overload, requests holding their own and shared chunks are preempted and release them
# (`prefix` scenario settings; callers add nodes, length and load).
TIGHT_SHARED_PREFIX = dict(
    **TIGHT_NODES, prefix_groups=8, prefix_median=128.0, prefix_max=256, chunk_tokens=64
)


def load_script(name: str):
    """The repository's script `name`.py (train, evaluate, benchmarks/throughput) as a module, for
    tests that call its functions."""
    spec = importlib.util.spec_from_file_location(f"_{Path(name).name}", ROOT / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses defined in the script look their module up
    spec.loader.exec_module(module)
    return module


def _kv_used(state, params, cfg):
    """[N] KV blocks in use: those running requests hold privately plus every chunk the prefix
    cache holds (pinned or not); without a cache, running requests' blocks from the slot table."""
    slots, block_size = state.slots, params.nodes.block_size
    if not cfg.prefix_caching:
        blocks = (slots.computed + block_size[:, None] - 1) // block_size[:, None]
        return jnp.where(slots.status == RUNNING, blocks, 0).sum(axis=1)
    geo = cluster.geometry(slots, state.requests, params, cfg)
    private = jax.vmap(scheduler.kv_blocks_used)(slots, geo.chunks, block_size)
    held = jax.vmap(pc.scan_usage)(state.cache, block_size)[:, 0]  # recounted, not the kept total
    return private + held


def _cache_scan(state, params):
    """[4, N] the prefix cache's totals recounted from its table (zeros without a cache)."""
    return jax.vmap(pc.scan_usage)(state.cache, params.nodes.block_size).T


def pytest_configure(config) -> None:
    """Share compiled programs between every process of one test run (the pytest-xdist workers and
    the train.py / rl-zoo3 subprocesses) through JAX's persistent compilation cache, in a fresh
    directory per run (removed at its end); a cache directory the user set is used as it is."""
    if not hasattr(config, "workerinput") and "JAX_COMPILATION_CACHE_DIR" not in os.environ:
        path = tempfile.mkdtemp(prefix="burstgym-tests-jax-cache-")
        os.environ["JAX_COMPILATION_CACHE_DIR"] = path  # inherited by the workers and subprocesses
        os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
        os.environ["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = "0"
        config.stash[_CACHE_DIR] = path
    if "JAX_COMPILATION_CACHE_DIR" in os.environ:
        jax.config.update("jax_compilation_cache_dir", os.environ["JAX_COMPILATION_CACHE_DIR"])
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
        jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


def pytest_unconfigure(config) -> None:
    path = config.stash.get(_CACHE_DIR, None)
    if path is not None:
        shutil.rmtree(path, ignore_errors=True)


def default_codegen_env() -> dict[str, str]:
    """This process's environment with XLA:CPU's default fusion emitters, the code generation users
    run, for a child process (see the module docstring)."""
    flags = os.environ.get("XLA_FLAGS", "").split()
    flags = [f for f in flags if not f.startswith("--xla_cpu_use_fusion_emitters")]
    return {**os.environ, "XLA_FLAGS": " ".join([*flags, "--xla_cpu_use_fusion_emitters=true"])}


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem: pytest.Function) -> bool | None:
    """A test marked `default_codegen` runs in a child pytest that compiles with the default
    emitters, unless this process does already; its failure is this test's, with its output."""
    if pyfuncitem.get_closest_marker("default_codegen") is None:
        return None
    if "--xla_cpu_use_fusion_emitters=false" not in os.environ.get("XLA_FLAGS", ""):
        return None
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", pyfuncitem.nodeid]
    env = default_codegen_env()
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    if proc.returncode != 0:
        pytest.fail(
            f"with XLA:CPU's default emitters (a child pytest):\n{proc.stdout[-6000:]}{proc.stderr[-2000:]}",
            pytrace=False,
        )
    return True


def _mappings() -> tuple[int, int]:
    """(memory mappings this process holds, the kernel's limit per process); (0, 0) where /proc
    does not say."""
    try:
        with open("/proc/self/maps") as maps, open("/proc/sys/vm/max_map_count") as limit:
            return sum(1 for _ in maps), int(limit.read())
    except (OSError, ValueError):
        return 0, 0


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
    """A test worker compiles thousands of programs, each XLA:CPU executable holding memory
    mappings of its own; past the kernel's limit per process (vm.max_map_count, 65,530 by
    default) the worker crashes wherever the next mapping fails (a segfault in a compile or a
    step). After a module that leaves the worker at over a third of the limit, every compiled
    program is dropped (burstgym.rollout.clear_compiled and this file's cache) and later tests
    compile again."""
    yield
    held, limit = _mappings()
    if limit and held > limit // 3:
        rollout_fn.cache_clear()
        clear_compiled()


# Compiler options for the few programs that run longer than they compile (long episodes, many
# clusters): XLA's default LLVM optimisation level, not the suite's level 0 (docs/performance.md,
# "Compiling").
OPTIMIZED = {"xla_backend_optimization_level": 3}


@functools.cache
def rollout_fn(cfg: EnvConfig, x64: bool = False, optimized: bool = False):
    """A jitted `(key, params, actions[E]) -> (obs0, state0, final state, per-step trace)`,
    compiled with `OPTIMIZED` if `optimized`.

    One `lax.scan` over `step_env` runs a whole episode in one call. The trace holds, per step:
    obs, reward, done, the clock (time of the next arrival), the nodes' clocks on the same
    absolute scale, the error bits, and the counts the invariants need (finished, in flight,
    dropped, KV blocks used, the prefix cache's kept and recounted totals). `x64` is part of the
    cache key because a function traced under `jax.enable_x64` has float64 shapes.
    """
    env = BurstBalance(cfg)

    def run(key, params, actions):
        obs0, st0 = env.reset(key, params)

        def body(st, a):
            obs, st, r, d, info = env.step_env(st, a, params)
            slots = st.slots
            out = {
                "obs": obs,
                "reward": r,
                "done": d,
                "time": st.clock,
                "last_time": st.nodes.last_time + st.clock,
                "finished": jnp.isfinite(st.log.e2e).sum(),
                "error": st.error,
                "in_flight": (slots.status != EMPTY).sum(),
                "waiting": (slots.status == WAITING).sum(axis=1),
                "running": (slots.status == RUNNING).sum(axis=1),
                "dropped": st.log.dropped.sum(),
                "kv_used": _kv_used(st, params, cfg),
                "mask": info["action_mask"],
                # the prefix cache's kept totals, and the same recounted from its chunks
                "cache_kept": jnp.stack(
                    [st.cache.cached, st.cache.pinned, st.cache.cached_tokens, st.cache.entries]
                ),
                "cache_scan": _cache_scan(st, params),
            }
            return st, out

        st, trace = jax.lax.scan(body, st0, actions)
        return obs0, st0, st, trace

    return jax.jit(run, compiler_options=OPTIMIZED if optimized else None)


def rollout(cfg: EnvConfig, params, seed: int, actions, x64: bool = False, optimized: bool = False):
    """Run one episode with fixed actions; NumPy trace. Call inside `jax.enable_x64(x64)`."""
    fn = rollout_fn(cfg, x64, optimized)
    obs0, st0, st, trace = fn(jax.random.key(seed), params, jnp.asarray(actions, jnp.int32))
    return obs0, st0, st, jax.tree.map(np.asarray, trace)


# A small, overloaded cluster shared by the core and invariant tests (one compile per scheduler):
# 4 nodes, 4 running / 6 waiting per node, 768 KV tokens, short requests.
BASE = dict(
    n_nodes=4,
    episode_length=160,
    load=1.0,
    max_batch_size=4,
    block_size=16,
    **TIGHT_NODES,
)


def base(scheduler: str = "continuous", **overrides):
    """(cfg, params) of the shared small cluster for `scheduler` (float32 unless under x64)."""
    name = "bursty" if scheduler == "continuous" else "bursty-dynamic"
    return scenarios.make(name, **{**BASE, **overrides})
