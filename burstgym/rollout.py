"""Whole episodes of many clusters routed by JAX routers, in jitted calls without a Python step loop.

`rollout(cfg, params, routers, seeds)` runs `len(routers) x len(seeds)` clusters (cluster
`r * S + s` replays seed `s` under router `r`, as `agents.rollout` lays them out): a vmapped
reset, then one `lax.scan` over the episode's arrivals of router view -> router -> `step_env`
(the batched step without auto-reset, so each episode's final state and request log are kept),
then the episode metrics. A router is any hashable object of the `burstgym.routing.Router`
protocol,

    init(n_nodes, seed, stream) -> state     # stream: the episode's seed (a traced uint32)
    act(state, view, mask) -> (action, state)

over one cluster's `RouterView` ([N] fields) and action mask (`agents.routers` has every
heuristic and production rule). A router whose `observes` attribute is true (a learned policy:
`agents.jax_ppo.JaxPolicyRouter`) is called `act(state, view, mask, obs, weights)` with the
cluster's observation vector (`burstgym.observation.observe`, as the environment returns it) and
the pytree its `weights()` returns; one whose `reads_state` is true gets the cluster's `State` and
`EnvParams` instead (`burstgym.routing.act`). Weights are an argument of the compiled episode, not
constants in it: a router hashes by its structure, so policies of one shape share one compilation
whatever their weights (a training run's held-out evaluations compile once). Several routers in
one call share the scan (a `lax.switch` on each cluster's router index); each cluster carries a
tuple of every router's state, whose structures may differ, and uses its own router's.

Two jitted calls, compiled ahead of time so compile time is reported apart from run time: the
reset (compiled per configuration) and the episode (reset state in, final state out), which is
compiled once per configuration up to its workload, since the step never reads the workload:
configurations that differ only in load or arrival process (a regime map) share it. Parameters
get a leading cluster axis (`per_cluster`, see `step_clusters` for why). Within a device the
clusters run `chunk` at a time (`lax.map` over vmapped groups): one at a time on CPU; on an
accelerator as many as its free memory holds, read from the compiled program's memory analysis
(`fit_chunk`, docs/performance.md).

Sharding: the cluster axis is placed with a `NamedSharding` over every visible device (a 1-D mesh
"clusters") when the device count divides the number of clusters, and each device runs its own
clusters' episodes (`shard_map`: clusters never interact, so no step communicates across
devices). With the default device alone there is no mesh: the same computation, unsharded.
Otherwise the call runs on the default device.

Errors: the core's error bits (`info["error"]`, cumulative per cluster) are tracked inside the scan
with the first step at which each cluster raised one; after the call, `EpisodeBatch.check()`
raises what the step-by-step rollout (agents/rollout.py) would have raised at its first failing
step: the same message, `simulation error at request k: ...` (`burstgym.gym_env.check_error`).
"""

from __future__ import annotations

import dataclasses
import functools
import os
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from burstgym import routing
from burstgym.cluster import map_clusters
from burstgym.compile_cache import jit
from burstgym.env import BurstBalance
from burstgym.gym_env import check_error
from burstgym.observation import action_mask, observe
from burstgym.program_store import compile_stored
from burstgym.types import EnvConfig, EnvParams, State

AXIS = "clusters"

try:  # jax >= 0.6
    from jax import shard_map as _shard_map

    def _smap(f, mesh, in_specs, out_specs):
        return _shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)

except ImportError:  # pragma: no cover - older jax
    from jax.experimental.shard_map import shard_map as _shard_map

    def _smap(f, mesh, in_specs, out_specs):
        return _shard_map(f, mesh, in_specs=in_specs, out_specs=out_specs, check_rep=False)


@dataclass
class EpisodeBatch:
    """Every cluster's episode, one row per cluster (router r, seed s at row r * S + s)."""

    objective: np.ndarray  # [C] float64, minus the summed rewards times reward_scale
    rewards: np.ndarray  # [C, E] float32, each step's reward
    node: np.ndarray  # [C, E] int32, node each request was routed to
    dropped: np.ndarray  # [C, E] bool
    ttft: np.ndarray  # [C, E] float, NaN when dropped or unfinished
    e2e: np.ndarray  # [C, E] float, NaN when dropped or unfinished
    metrics: dict[str, np.ndarray]  # [C] per metric, [C, N] per node (burstgym.metrics)
    error: np.ndarray  # [C] int32, the final error bits
    error_step: np.ndarray  # [C] int32, the step of each cluster's first error (E: none)
    error_first: np.ndarray  # [C] int32, the error bits at that step
    # with `keep_router_state`, every cluster's router states after its last decision: a tuple with
    # one state per router (the engine carries all of them; cluster r * S + s uses router r's),
    # leaves [C, ...]; None without it
    router_state: Any
    compile_s: float  # seconds spent compiling in this call (0 when every function was cached)
    run_s: float  # seconds running the compiled reset and episode (to results on the device)
    devices: int  # devices the cluster axis was sharded over (1: unsharded)
    chunk: int  # clusters vmapped together in one group on each device
    threads: int  # calls of the compiled episode run at once on parts of the clusters (CPU)
    # the compiled episode's arguments, outputs and temporaries (XLA's analysis), times `threads`
    memory_bytes: int

    def first_error(self) -> tuple[int, int] | None:
        """(step, bits) of the batch's first error, as the step-by-step rollout sees it: the first
        step at which any cluster raised one and the union of the bits raised then; None if none."""
        e = self.rewards.shape[1]
        step = int(self.error_step.min(initial=e))
        if step >= e:
            return None
        return step, int(np.bitwise_or.reduce(self.error_first[self.error_step == step]))

    def check(self) -> None:
        """Raise the batch's first error as agents/rollout.py would (RuntimeError naming each bit)."""
        first = self.first_error()
        if first is not None:
            check_error(first[1], f" at request {first[0]}")


def one_at_a_time(memory_limit: int | None = None) -> bool:
    """Whether `rollout(chunk="auto")` steps its clusters one at a time (on CPU without a memory
    limit, where a vmapped batch gains nothing) rather than in vmapped groups: a call then holds
    the router states of the clusters being stepped only, however many routers it runs."""
    return memory_limit is None and jax.default_backend() == "cpu"


def usable_cores() -> int:
    """CPU cores this process may run on (its affinity mask where the OS has one)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def cluster_mesh(n_clusters: int, devices: Sequence[Any] | None = None) -> Mesh | None:
    """The 1-D mesh over `devices` (default: every visible device) when their count divides
    `n_clusters`, else None (run unsharded)."""
    devices = list(jax.devices() if devices is None else devices)
    if not devices or n_clusters % len(devices):
        return None
    return Mesh(np.asarray(devices), (AXIS,))


# Compiled resets and episodes, per configuration (and routers, layout), kept for the process.
_EPISODE: dict[Any, Any] = {}
_RESET: dict[Any, Any] = {}


def compiled_episodes() -> list[Any]:
    """The episodes compiled so far in this process (`jax.stages.Compiled`), to read their
    programs (`as_text()`, `memory_analysis()`); `clear_compiled` empties the list."""
    return list(_EPISODE.values())


def clear_compiled() -> None:
    """Forget every compiled reset and episode of this module and JAX's own compilation caches.
    Each compiled XLA:CPU program holds memory mappings of its own, and Linux limits a process to
    `vm.max_map_count` of them (65,530 by default): a process that compiles thousands of
    configurations runs into it and crashes. Later calls compile again (or load from the
    persistent cache, burstgym.compile_cache)."""
    _EPISODE.clear()
    _RESET.clear()
    jax.clear_caches()


def per_cluster(params: EnvParams, n_clusters: int) -> EnvParams:
    """`params` with a leading cluster axis on every leaf (one copy per cluster)."""
    return jax.tree.map(lambda x: jnp.broadcast_to(jnp.asarray(x), (n_clusters,) + jnp.shape(x)), params)


def step_clusters(
    core: BurstBalance, states: State, actions: jax.Array, params: EnvParams, one_at_a_time: bool = False
) -> tuple[jax.Array, State, jax.Array, jax.Array, dict[str, jax.Array]]:
    """`BurstBalance.batched_step_env` with per-cluster parameters (`per_cluster`).

    `one_at_a_time`: step the clusters one after another (`lax.map`, each at the slot width it
    needs), as the rollout engine does on CPU, so that the two agree bit for bit there. A single
    cluster (one at a time, or a batch of one) steps without a batch axis (`step_env`): under
    `vmap` an event loop whose condition is batched selects between its old and new carry on
    every pass, which a batch of one pays for nothing (`prefix`, 64 clusters one at a time: 2,699
    decisions/s unbatched against 2,202 through a vmap of one, compile 15.0 s against 17.5 s).

    With shared parameters a parameter is a broadcast scalar, and XLA rewrites `x / broadcast(s)`
    into `x * (1 / s)` in some programs and not in others (a standalone step, but not the same
    step inside a scan whose loop hoists the broadcast), so the reward `-cost / reward_scale`
    differs in its last bit between the step-by-step rollout and the scanned one. Per-cluster
    parameters are never broadcast: every program divides exactly, and both rollouts agree bit
    for bit.
    """
    if not one_at_a_time and actions.shape[0] > 1:
        return core.batched_step_env(states, actions, params, per_cluster=True)
    return map_clusters(lambda args: core.step_env(*args), (states, actions, params))


def chunk_size(n_clusters: int, target: int) -> int:
    """The largest divisor of `n_clusters` that is at most `target` (at least 1)."""
    target = max(1, min(target, n_clusters))
    return max(d for d in range(1, target + 1) if n_clusters % d == 0)


# Share of a device's free memory a compiled episode may plan to use (XLA's analysis leaves out
# fragmentation and the runtime's own buffers).
MEMORY_HEADROOM = 0.8


def episode_memory(compiled: Any) -> int:
    """Bytes a compiled episode needs: arguments, outputs and temporaries, less what outputs
    reuse of donated arguments (XLA's `memory_analysis`; 0 when the backend gives none)."""
    m = compiled.memory_analysis()
    if m is None:
        return 0
    total = m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes
    return int(total - m.alias_size_in_bytes)


def device_free_bytes(devices: Sequence[Any]) -> int | None:
    """The least free memory over `devices` (bytes_limit minus bytes in use), or None when the
    backend does not report it (CPU)."""
    free = []
    for d in devices:
        stats = d.memory_stats() if hasattr(d, "memory_stats") else None
        if not stats or "bytes_limit" not in stats:
            return None
        free.append(int(stats["bytes_limit"]) - int(stats.get("bytes_in_use", 0)))
    return min(free)


def fit_chunk(n_local: int, compile_at: Callable[[int], tuple[Any, float]], budget: int, resident: int):
    """The largest group size (a divisor of `n_local`, the clusters per device) whose compiled
    episode needs at most `budget` bytes (`episode_memory`), of which `resident` (its arguments,
    on the device already) do not grow with the group. All at once first; then the size the last
    analysis predicts (the rest of the need is about linear in the group size), at most half the
    last size, until one fits (1 at the least, whatever it needs). `compile_at(k)` compiles for
    groups of k and returns (compiled, seconds). Returns (k, compiled, compile seconds spent)."""
    k, spent = n_local, 0.0
    while True:
        compiled, seconds = compile_at(k)
        spent += seconds
        need = episode_memory(compiled)
        if need <= budget or k == 1:
            return k, compiled, spent
        guess = int(k * max(budget - resident, 0) / max(need - resident, 1))
        k = chunk_size(n_local, min(max(guess, 1), k // 2))


def _episode_fn(cfg: EnvConfig, routers: tuple[Any, ...], chunk: int | None, keep_router_state: bool):
    """(states, router index, router seeds, streams, params, router weights) -> outputs, for one
    shard of clusters (params per cluster), `chunk` clusters vmapped at a time (None: all); the
    router states are an output only with `keep_router_state`."""
    core = BurstBalance(cfg)
    n, e = cfg.n_nodes, cfg.episode_length
    observes = any(getattr(r, "observes", False) for r in routers)

    # Router states: a tuple with one state per router (their structures may differ), of which
    # each cluster uses its own router's; one compiled scan serves every router (a switch on the
    # router index, a true branch when one cluster runs at a time).
    def init_all(seed, stream):
        return tuple(r.init(n, seed, stream) for r in routers)

    def branch(i: int, weights):
        def act(rstates, view, mask, obs, state, params):
            extra = dict(obs=obs, weights=weights[i], cluster_state=state, params=params)
            action, new = routing.act(routers[i], rstates[i], view, mask, **extra)
            return action.astype(jnp.int32), rstates[:i] + (new,) + rstates[i + 1 :]

        return act

    def route(weights, ridx, rstates, views, masks, obs, states, params):
        acts = [branch(i, weights) for i in range(len(routers))]

        def one(i, *args):
            return acts[0](*args) if len(acts) == 1 else jax.lax.switch(i, acts, *args)

        args = (rstates, views, masks, obs, states, params)
        if ridx.shape[0] == 1:  # one cluster: a scalar index, so only its router's branch runs
            out = one(ridx[0], *jax.tree.map(lambda x: x[0], args))
            return jax.tree.map(lambda x: x[None], out)
        return jax.vmap(one)(ridx, *args)

    def run(states, ridx, rseed, stream, params, weights):
        rstates = jax.vmap(init_all)(rseed, stream)
        c = ridx.shape[0]
        view_of = jax.vmap(core.view)
        obs_of = jax.vmap(lambda v, p: observe(v, p, cfg))

        def body(carry, k):
            states, rstates, first_k, first_bits = carry
            views = view_of(states, params)
            masks = jax.vmap(action_mask)(views)
            obs = obs_of(views, params) if observes else jnp.zeros((c, 0), jnp.float32)
            actions, rstates = route(weights, ridx, rstates, views, masks, obs, states, params)
            _, states, reward, _, info = step_clusters(core, states, actions, params)
            err = info["error"]
            new = (err != 0) & (first_k == e)
            first_k = jnp.where(new, k, first_k)
            first_bits = jnp.where(new, err, first_bits)
            return (states, rstates, first_k, first_bits), reward

        init = (states, rstates, jnp.full(c, e, jnp.int32), jnp.zeros(c, jnp.int32))
        (states, rstates, first_k, first_bits), rewards = jax.lax.scan(
            body, init, jnp.arange(e, dtype=jnp.int32)
        )
        return states, rewards.T, first_k, first_bits, rstates

    def chunked(states, ridx, rseed, stream, params, weights):
        c = ridx.shape[0]
        k = c if chunk is None else chunk_size(c, chunk)
        args = (states, ridx, rseed, stream, params)
        if k == c:
            out = run(*args, weights)
        else:
            split = jax.tree.map(lambda x: x.reshape((c // k, k) + x.shape[1:]), args)
            out = jax.lax.map(lambda a: run(*a, weights), split)
            out = jax.tree.map(lambda x: x.reshape((c,) + x.shape[2:]), out)
        states, rewards, first_k, first_bits, rstates = out
        metrics = jax.vmap(core.metrics)(states, params)
        log = states.log
        return {
            "rewards": rewards,
            "node": log.node,
            "dropped": log.dropped,
            "ttft": log.ttft,
            "e2e": log.e2e,
            "metrics": metrics,
            "error": states.error,
            "error_step": first_k,
            "error_first": first_bits,
            "router_state": rstates if keep_router_state else (),
        }

    return chunked


def _resident(args: tuple, n_devices: int) -> int:
    """Bytes of the episode's arguments on each device."""
    return sum(x.nbytes for x in jax.tree.leaves(args)) // n_devices


def _reset_fn(cfg: EnvConfig):
    core = BurstBalance(cfg)

    def reset(seeds, params):
        keys = jax.vmap(jax.random.key)(seeds)
        return jax.vmap(core.reset)(keys, params)[1]

    return reset


def _compiled(
    name: str,
    cache: dict,
    key: Any,
    build,
    args: tuple,
    mesh: Mesh | None,
    donate: tuple[int, ...] = (),
    replicated: int = 0,
):
    """The AOT-compiled `build()` for `args` (cached by key, shapes and mesh; without a mesh through
    `program_store.compile_stored`, so a later process compiles it without tracing `build()`), and
    the seconds spent compiling it now (0 when cached). Every argument leads with the cluster axis
    but the last `replicated` ones, which every device gets whole (router weights)."""
    shapes = jax.tree.map(lambda x: (x.shape, x.dtype), args)
    full = (key, str(shapes), None if mesh is None else tuple(d.id for d in mesh.devices.flat))
    if full in cache:
        return cache[full], 0.0
    start = time.perf_counter()
    if mesh is not None:
        fn = build()
        spec = PartitionSpec(AXIS)
        specs = tuple(spec if i < len(args) - replicated else PartitionSpec() for i in range(len(args)))
        fn = _smap(fn, mesh, specs, spec)
        shard = NamedSharding(mesh, spec)
        shardings = tuple(NamedSharding(mesh, s) for s in specs)
        jitted = jit(fn, in_shardings=shardings, out_shardings=shard, donate_argnums=donate)
        compiled = jitted.lower(*args).compile()
    else:
        compiled = compile_stored((name, key), build, args, donate_argnums=donate)
    cache[full] = compiled
    return compiled, time.perf_counter() - start


def rollout(
    cfg: EnvConfig,
    params: EnvParams,
    routers: Sequence[Any],
    seeds: Sequence[int],
    *,
    router_seeds: Sequence[int] | None = None,
    shard: bool = True,
    devices: Sequence[Any] | None = None,
    chunk: int | str | None = "auto",
    memory_limit: int | None = None,
    threads: int | None = None,
    check: bool = True,
    keep_router_state: bool = False,
) -> EpisodeBatch:
    """Episodes of every router in `routers` on every seed in `seeds` (see the module docstring).

    `router_seeds` (default: each router's `seed` attribute, else 0) seed the routers' PRNG keys,
    folded with each episode's seed. `shard=False` keeps every cluster on the default device.
    `chunk` clusters are vmapped together and the groups run one after another (`lax.map`); None
    vmaps every cluster of a device at once; "auto" (default) is 1 on CPU, where a vmapped batch
    runs each step's event loops for as long as its slowest cluster needs and gains nothing, and
    on accelerators the largest group whose compiled episode fits `MEMORY_HEADROOM` of the
    device's free memory (`fit_chunk`). `memory_limit` (bytes per device) makes "auto" fit the
    group to that budget instead, on any backend. `threads` (default: the CPU cores this process
    may use, `usable_cores`, on a single CPU device without a memory limit; 1 otherwise) splits the
    clusters into that many equal parts, the last cluster repeated to fill the last part and its
    copies dropped from the results, and runs the compiled episode on the parts at once from as
    many threads: on CPU a cluster's step is a sequence of small operations on one core, and the
    parts use the others. With `check` (default) the first simulation error is raised after the
    call. `keep_router_state` returns every cluster's router states (`EpisodeBatch.router_state`):
    each cluster carries the state of every router in the call, so they take the routers' states'
    size times the routers times the clusters (about 20 MB per cluster with every rule of
    `agents/routers/` on `energy`'s four nodes), and are left out by default."""
    if memory_limit is not None and memory_limit < 1:
        raise ValueError(f"memory_limit must be a positive number of bytes, got {memory_limit}")
    if threads is not None and threads < 1:
        raise ValueError(f"threads must be at least 1, got {threads}")
    if chunk == "auto" and one_at_a_time(memory_limit):
        chunk = 1
    fit = chunk == "auto"
    routers = tuple(routers)
    if not routers:
        raise ValueError("rollout needs at least one router")
    n_seeds = len(seeds)
    if router_seeds is None:
        router_seeds = [int(getattr(r, "seed", 0)) for r in routers]
    c = len(routers) * n_seeds
    seed_arr = np.tile(np.asarray(seeds, dtype=np.uint32), len(routers))
    ridx = np.repeat(np.arange(len(routers), dtype=np.int32), n_seeds)
    rseed = np.repeat(np.asarray(router_seeds, dtype=np.uint32), n_seeds)
    mesh = cluster_mesh(c, devices) if shard else None
    if mesh is not None and mesh.devices.size == 1 and mesh.devices.flat[0] == jax.devices()[0]:
        mesh = None  # one default device: the same computation without the shard_map
    if threads is None:
        single_cpu = jax.default_backend() == "cpu" and (mesh is None or mesh.devices.size == 1)
        threads = usable_cores() if single_cpu and memory_limit is None else 1
    threads = min(threads, c)
    if threads > 1:  # each part runs unsharded on the default device; pad to equal parts
        mesh = None
        pad = -c % threads
        seed_arr, ridx, rseed = (np.concatenate([x, np.repeat(x[-1:], pad)]) for x in (seed_arr, ridx, rseed))
    scale = float(np.asarray(params.reward_scale))
    params = per_cluster(params, len(seed_arr))
    if mesh is not None:
        put = functools.partial(jax.device_put, device=NamedSharding(mesh, PartitionSpec(AXIS)))
        seed_arr, ridx, rseed, params = put(seed_arr), put(ridx), put(rseed), put(params)
    else:
        seed_arr, ridx, rseed = (jnp.asarray(x) for x in (seed_arr, ridx, rseed))

    reset, t_reset = _compiled("rollout.reset", _RESET, cfg, lambda: _reset_fn(cfg), (seed_arr, params), mesh)
    start = time.perf_counter()
    states = reset(seed_arr, params)
    jax.block_until_ready(states)
    run_s = time.perf_counter() - start

    shared = dataclasses.replace(cfg, workload=None)
    weights = tuple(r.weights() if getattr(r, "observes", False) else () for r in routers)
    args = (states, ridx, rseed, seed_arr, params, weights)
    donate = (0,) if jax.default_backend() != "cpu" else ()
    n_devices = 1 if mesh is None else mesh.devices.size
    local = len(seed_arr) // (n_devices * threads)
    parts = [args]
    if threads > 1:
        cut = [jax.tree.map(lambda x, i=i: x[i * local : (i + 1) * local], args[:-1]) for i in range(threads)]
        parts = [part + (weights,) for part in cut]

    def compile_at(k: int | None):
        k = None if k is not None and k >= local else k  # every cluster of the device at once
        build = functools.partial(_episode_fn, cfg, routers, k, keep_router_state)
        key = (shared, routers, k, keep_router_state)
        return _compiled("rollout.episode", _EPISODE, key, build, parts[0], mesh, donate, replicated=1)

    budget = memory_limit
    if fit and budget is None:
        placed = list(mesh.devices.flat) if mesh is not None else list(states.requests.prompt.devices())
        free = device_free_bytes(placed)
        # the arguments are on the device already: what was free before them is free + resident
        budget = None if free is None else int(MEMORY_HEADROOM * (free + _resident(args, n_devices)))
    if fit and budget is not None:
        chunk, episode, t_episode = fit_chunk(local, compile_at, budget, _resident(args, n_devices))
    else:
        chunk = None if fit else chunk
        episode, t_episode = compile_at(chunk)
        chunk = local if chunk is None else chunk_size(local, chunk)
    start = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        outs = list(pool.map(lambda part: jax.block_until_ready(episode(*part)), parts))
    run_s += time.perf_counter() - start
    outs = jax.device_get(outs)
    out = outs[0] if threads == 1 else jax.tree.map(lambda *x: np.concatenate(x)[:c], *outs)
    rewards = np.asarray(out["rewards"])
    # summed in float64 one step at a time, as the step-by-step rollout does
    total = np.cumsum(rewards.astype(np.float64), axis=1)[:, -1] if rewards.shape[1] else np.zeros(c)
    dropped = np.asarray(out["dropped"])
    batch = EpisodeBatch(
        objective=-total * scale,
        rewards=rewards,
        node=np.asarray(out["node"]),
        dropped=dropped,
        ttft=np.where(dropped, np.nan, out["ttft"]),
        e2e=np.where(dropped, np.nan, out["e2e"]),
        metrics={k: np.asarray(v) for k, v in out["metrics"].items()},
        error=np.asarray(out["error"]),
        error_step=np.asarray(out["error_step"]),
        error_first=np.asarray(out["error_first"]),
        router_state=out["router_state"] if keep_router_state else None,
        compile_s=t_reset + t_episode,
        run_s=run_s,
        devices=n_devices,
        chunk=chunk,
        threads=threads,
        memory_bytes=episode_memory(episode) * threads,
    )
    if check:
        batch.check()
    return batch
