"""The cluster: routing one request to a node, and advancing every node's events in time.

Between two arrivals the nodes do not interact, so `advance` runs one `jax.lax.while_loop` in
which each pass handles the next event of every node at once (vectorised over nodes): an
iteration (or a folded run of decode iterations) ending, a node waking or falling asleep, a new
iteration starting. Latency and energy are accrued per node between its events: by Little's law
the latency accrued over an interval is the integral of the number of requests in the node (see
docs/semantics.md, "Objective"). Times are relative to the current arrival.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from burstgym import prefix_cache as pc
from burstgym import scheduler
from burstgym.prefix_cache import Chunks
from burstgym.types import (
    ASLEEP,
    BUSY,
    EMPTY,
    ERROR_SLOT_OVERFLOW,
    IDLE,
    RUNNING,
    WAITING,
    WAKING,
    EnvConfig,
    EnvParams,
    NodeParams,
    NodeState,
    PrefixCache,
    Slots,
)
from burstgym.workload import Requests

# Far above any real stretch between two arrivals (each pass handles one event per node); a loop
# that reaches it stops and sets ERROR_RUNAWAY, which the Python faces raise.
MAX_EVENTS_PER_ADVANCE = 1_000_000


class Accrual(NamedTuple):
    """What the objective accrued during one step, per node ([N] each)."""

    latency_s: jax.Array  # request-seconds spent in the node (waiting or running)
    ttft_s: jax.Array  # request-seconds spent waiting for a first token
    energy_j: jax.Array  # joules drawn


class Cluster(NamedTuple):
    """The parts of the state the event loop changes."""

    slots: Slots
    nodes: NodeState
    cache: PrefixCache
    # [N, S, B] int32 table positions of the slots' pinned chunks (prefix caching; set by `advance`)
    at: jax.Array | None = None


def _bcast(mask: jax.Array, x: jax.Array) -> jax.Array:
    return mask.reshape(mask.shape + (1,) * (x.ndim - mask.ndim))


def tree_where(mask: jax.Array, a, b):
    """Take pytree `a` where mask[i] else `b`, along the leading axis of every leaf ([N] or [B])."""
    return jax.tree.map(lambda x, y: jnp.where(_bcast(mask, x), x, y), a, b)


def map_clusters(fn: Callable, xs: Any) -> Any:
    """`jax.lax.map(fn, xs)`: `fn` on one cluster after another along the leading axis of `xs`'s
    leaves. A batch of one calls `fn` directly: a loop around one cluster would slice each of its
    fields out of the batch and write it back on every call."""
    if jax.tree.leaves(xs)[0].shape[0] == 1:
        return jax.tree.map(lambda x: x[None], fn(jax.tree.map(lambda x: x[0], xs)))
    return jax.lax.map(fn, xs)


def node_configs(nodes: NodeParams) -> scheduler.NodeConfig:
    """The scheduler's view of the node parameters (still [N] per field; vmap slices it)."""
    return scheduler.NodeConfig(
        latency=nodes.latency,
        power=nodes.power,
        speed=nodes.speed,
        max_num_seqs=nodes.max_num_seqs,
        max_num_batched_tokens=nodes.max_num_batched_tokens,
        block_size=nodes.block_size,
        kv_blocks=nodes.kv_blocks,
        max_batch_size=nodes.max_batch_size,
        max_queue_delay=nodes.max_queue_delay,
    )


class Geometry(NamedTuple):
    """Prefix chunks of the requests in the slots (fixed during a step)."""

    chunks: Chunks  # [N, S, B] each


def geometry(slots: Slots, requests: Requests, params: EnvParams, cfg: EnvConfig) -> Geometry | None:
    """The prefix geometry of the current slots (None without prefix caching)."""
    if not cfg.prefix_caching:
        return None
    per_node = jax.vmap(pc.slot_chunks, in_axes=(None, 0, None, 0))
    return Geometry(per_node(requests, slots.req, cfg.chunk_tokens, params.nodes.block_size))


def _start_time(slots: Slots, nodes: NodeState, params: EnvParams, cfg: EnvConfig) -> jax.Array:
    """[N] earliest time at which each node, if idle, can start an iteration (inf: not now)."""
    has_req = scheduler.occupied(slots).any(axis=1)
    if cfg.scheduler == "continuous":
        return jnp.where(has_req, nodes.last_time, jnp.inf)
    return jax.vmap(scheduler.dynamic_can_start)(
        slots, nodes.batch_rows, node_configs(params.nodes), nodes.last_time
    )


def next_event(slots: Slots, nodes: NodeState, params: EnvParams, cfg: EnvConfig) -> jax.Array:
    """[N] time of each node's next event (docs/semantics.md, "Node state")."""
    has_req = scheduler.occupied(slots).any(axis=1)
    start = _start_time(slots, nodes, params, cfg)
    sleep = jnp.where(has_req, jnp.inf, nodes.idle_since + params.nodes.sleep_timeout)
    idle = jnp.minimum(start, sleep)
    return jnp.select(
        [nodes.phase == BUSY, nodes.phase == WAKING, nodes.phase == ASLEEP],
        [nodes.iter_end, nodes.wake_end, jnp.full_like(nodes.iter_end, jnp.inf)],
        idle,
    )


def _power(nodes: NodeState, params: EnvParams) -> jax.Array:
    p = params.nodes
    return jnp.where(
        nodes.phase == BUSY,
        nodes.busy_w,
        jnp.where(nodes.phase == ASLEEP, p.sleep_power_w, p.power.idle_w),
    )


def accrue(
    slots: Slots, nodes: NodeState, acc: Accrual, until: jax.Array, mask: jax.Array, params: EnvParams
) -> tuple[NodeState, Accrual]:
    """Accrue latency and energy on the masked nodes from their `last_time` to `until` ([N])."""
    dt = jnp.where(mask, until - nodes.last_time, 0.0)
    held = scheduler.occupied(slots)
    in_node = held.sum(axis=1)
    no_token = (held & jnp.isnan(slots.ttft)).sum(axis=1)
    energy = _power(nodes, params) * dt
    nodes = nodes._replace(
        last_time=jnp.where(mask, until, nodes.last_time),
        energy_j=nodes.energy_j + energy,
        busy_s=nodes.busy_s + jnp.where(nodes.phase == BUSY, dt, 0.0),
    )
    acc = Accrual(acc.latency_s + in_node * dt, acc.ttft_s + no_token * dt, acc.energy_j + energy)
    return nodes, acc


def _handle_events(
    c: Cluster,
    acc: Accrual,
    tau: jax.Array,
    active: jax.Array,
    until: jax.Array,
    geo: Geometry | None,
    params: EnvParams,
    cfg: EnvConfig,
) -> tuple[Cluster, Accrual]:
    """Handle the next event (at `tau`, [N]) of every active node (docs/semantics.md, "Handling a
    node event"); a new iteration that starts a stretch of identical decodes before `until`
    covers the whole stretch (`scheduler.decode_run`)."""
    slots, nodes, cache, at = c
    nodes, acc = accrue(slots, nodes, acc, tau, active, params)
    ncfg = node_configs(params.nodes)

    # 1. An iteration (or a run) ends: tokens land, first tokens and finishes are recorded.
    ending = active & (nodes.phase == BUSY)
    res = jax.vmap(scheduler.finish_iteration)(
        slots, nodes.repeat, nodes.iter_start, nodes.run_d0, nodes.run_growth, params.nodes.latency.frontend_s
    )
    done = res.finished & ending[:, None]
    if geo is not None:
        # Only the ending nodes' pairs are released, so the other nodes' caches come back unchanged
        # (no select over the [N, H] tables); and only when some request finished (a `lax.cond`:
        # most events finish none, and the release would change nothing).
        cache, pinned = jax.lax.cond(
            done.any(),
            lambda: jax.vmap(scheduler.release_finished)(cache, res.slots, done, geo.chunks, at),
            lambda: (cache, res.slots),
        )
        res = res._replace(slots=pinned)
    slots = tree_where(ending, res.slots, slots)
    batch_over = ending & ~(slots.status == RUNNING).any(axis=1)
    nodes = nodes._replace(batch_rows=jnp.where(batch_over, 0, nodes.batch_rows))

    # 2-3. Iteration over or woken: idle. Idle, empty and past the timeout: asleep.
    to_idle = ending | (active & (nodes.phase == WAKING))
    phase = jnp.where(to_idle, IDLE, nodes.phase)
    idle_since = jnp.where(to_idle, tau, nodes.idle_since)
    empty = ~scheduler.occupied(slots).any(axis=1)
    asleep = active & (phase == IDLE) & empty & (tau >= idle_since + params.nodes.sleep_timeout)
    phase = jnp.where(asleep, ASLEEP, phase)
    nodes = nodes._replace(phase=phase, idle_since=idle_since)

    # 4. Start the next iteration where the scheduler allows it.
    start_ok = active & (phase == IDLE) & (_start_time(slots, nodes, params, cfg) <= tau)
    if cfg.scheduler == "continuous":
        if geo is None:
            plan = jax.vmap(lambda s, n, k: scheduler.plan_continuous(s, n, k, None))(slots, ncfg, cache)
        else:
            # A node that does not start plans as if empty, which leaves its cache unchanged, so the
            # plan's cache needs no select over the [N, U] tables (its slots are selected below).
            planned = slots._replace(status=jnp.where(start_ok[:, None], slots.status, EMPTY))
            plan = jax.vmap(
                lambda s, n, k, ch, a: scheduler.plan_continuous(s, n, k, ch, a, cfg.cache_entries, "nodes"),
                axis_name="nodes",
            )(planned, ncfg, cache, geo.chunks, at)
            at = plan.at
        mode = "continuous"
    else:
        plan = jax.vmap(scheduler.plan_dynamic, in_axes=(0, 0, 0, 0, None))(
            slots, nodes.batch_rows, nodes.batch_prompt, ncfg, cfg.padding
        )
        plan = plan._replace(cache=cache)
        mode = "padded" if cfg.padding else "unpadded"
    new_slots = plan.slots
    if geo is not None:
        private = jax.vmap(scheduler.kv_blocks_used)(new_slots, geo.chunks, params.nodes.block_size)
        held_blocks = plan.cache.cached
    else:
        private = jax.vmap(scheduler.kv_blocks_used, in_axes=(0, None, 0))(
            new_slots, None, params.nodes.block_size
        )
        held_blocks = 0
    free = params.nodes.kv_blocks - private - held_blocks
    room = until - tau
    if geo is None:
        run = jax.vmap(lambda pl, k, r, f: scheduler.decode_run(pl, k, r, f, mode, None))(
            plan, ncfg, room, free
        )
    else:
        run = jax.vmap(lambda pl, k, r, f, ch: scheduler.decode_run(pl, k, r, f, mode, ch))(
            plan, ncfg, room, free, geo.chunks
        )
    slots = tree_where(start_ok, new_slots, slots)
    if cfg.prefix_caching:
        cache = plan.cache
    started = start_ok & plan.started
    stats = plan.stats
    watts = run.energy / jnp.where(run.duration > 0, run.duration, 1.0)
    nodes = nodes._replace(
        phase=jnp.where(started, BUSY, nodes.phase),
        iter_start=jnp.where(started, tau, nodes.iter_start),
        iter_end=jnp.where(started, tau + run.duration, nodes.iter_end),
        repeat=jnp.where(started, run.repeat, nodes.repeat),
        run_d0=jnp.where(started, plan.duration, nodes.run_d0),
        run_growth=jnp.where(started, run.growth, nodes.run_growth),
        busy_w=jnp.where(started, watts, nodes.busy_w),
        batch_rows=jnp.where(started, plan.batch_rows, nodes.batch_rows),
        batch_prompt=jnp.where(started, plan.batch_prompt, nodes.batch_prompt),
        prefill_tokens=nodes.prefill_tokens
        + jnp.where(started, plan.shape.prefill_tokens, 0).astype(jnp.int32),
        saved_tokens=nodes.saved_tokens + jnp.where(start_ok, stats.saved, 0).astype(jnp.int32),
        hit_tokens=nodes.hit_tokens + jnp.where(start_ok, stats.first_hit, 0).astype(jnp.int32),
        admitted_prompt=nodes.admitted_prompt + jnp.where(start_ok, stats.first_prompt, 0).astype(jnp.int32),
    )
    return Cluster(slots, nodes, cache, at), acc


def advance(
    c: Cluster,
    acc: Accrual,
    until: jax.Array,
    drain: jax.Array,
    geo: Geometry | None,
    params: EnvParams,
    cfg: EnvConfig,
) -> tuple[Cluster, Accrual, jax.Array, jax.Array]:
    """Process every node event at a time <= `until`; returns (cluster, accrual, the time advanced
    to, runaway flag). Accrual is left at each node's last event.

    With `drain` (the last step of an episode that ends by draining, docs/semantics.md "End of
    episode"), `until` is ignored: the nodes that hold requests run until every request has
    finished, then every node handles its events up to the episode's end `t_end = max(0, last
    finish)` (sleep transitions), and `t_end` is returned. One loop serves both phases, so the
    event handling is compiled once.
    """
    inf = jnp.asarray(jnp.inf, until.dtype)

    def due(k: Cluster, limit: jax.Array, emptying: jax.Array) -> tuple[jax.Array, jax.Array]:
        tau = next_event(k.slots, k.nodes, params, cfg)
        holds = scheduler.occupied(k.slots).any(axis=1)
        return tau, (tau <= limit) & (holds | ~emptying)

    def settle(k: Cluster, limit: jax.Array, emptying: jax.Array):
        """(limit, emptying, tau, active): once the draining nodes are empty, move on to t_end."""
        tau, active = due(k, limit, emptying)
        switch = emptying & ~active.any()
        t_end = jnp.maximum(0.0, k.nodes.last_time.max()).astype(limit.dtype)
        limit = jnp.where(switch, t_end, limit)
        emptying = emptying & ~switch
        tau2, active2 = due(k, limit, emptying)
        return limit, emptying, jnp.where(switch, tau2, tau), jnp.where(switch, active2, active)

    def cond(carry):
        return carry[3].any() & (carry[4] < MAX_EVENTS_PER_ADVANCE)

    def body(carry):
        k, a, tau, active, count, limit, emptying = carry
        k, a = _handle_events(k, a, tau, active, limit, geo, params, cfg)
        limit, emptying, tau, active = settle(k, limit, emptying)
        return (k, a, tau, active, count + 1, limit, emptying)

    if geo is not None:  # table positions of the slots' chunks, kept up to date by every plan
        c = c._replace(at=jax.vmap(pc.locate)(c.cache, geo.chunks.ids))
    limit0 = jnp.where(drain, inf, until)
    limit0, emptying0, tau0, active0 = settle(c, limit0, drain)
    init = (c, acc, tau0, active0, jnp.int32(0), limit0, emptying0)
    k, a, _, active, count, limit, _ = jax.lax.while_loop(cond, body, init)
    return k, a, limit, active.any() & (count >= MAX_EVENTS_PER_ADVANCE)


class Routed(NamedTuple):
    """The cluster after one request was routed."""

    slots: Slots
    nodes: NodeState
    dropped: jax.Array  # [] bool
    error: jax.Array  # [] int32, ERROR_SLOT_OVERFLOW when the node's slot table was full
    joined: jax.Array  # [N] bool, one-hot of the node whose queue the request joined (none if dropped)


def route(
    slots: Slots,
    nodes: NodeState,
    req: jax.Array,
    prompt: jax.Array,
    output: jax.Array,
    node: jax.Array,
    params: EnvParams,
) -> Routed:
    """Send request `req`, arriving now (time 0), to `node`: join its queue, or be dropped if it is full.

    The slot table holds `EnvConfig.slots` requests per node; an accepted request that finds no
    free slot is not served and sets ERROR_SLOT_OVERFLOW (the Python faces raise it): a table
    too small for the scenario is an error, never a silent drop.
    """
    p = params.nodes
    accept = ~would_drop(slots, params)[node]
    free = slots.status[node] == EMPTY
    overflow = accept & ~free.any()
    slot = jnp.argmax(free)
    put_ok = accept & ~overflow
    # The request's cell and node are written through one-hot masks: elementwise selects, which
    # XLA fuses, instead of an indexed read and a scatter per field (each its own kernel), and one
    # select per packed array of the slots (`burstgym.record`) rather than one per field.
    n_nodes, n_slots = slots.status.shape
    on_node = jnp.arange(n_nodes) == node
    cell = on_node[:, None] & (jnp.arange(n_slots) == slot)[None, :] & put_ok
    row = Slots(
        req=req, status=WAITING, arrival=0.0, prompt=prompt, output=output, computed=0, generated=0,
        sched=0, pin=0, hit=-1, preempted=0, ttft=jnp.nan, e2e=jnp.nan,
    )  # fmt: skip
    slots = jax.tree.map(lambda new, old: jnp.where(cell[:, None, :], new.astype(old.dtype), old), row, slots)
    wakes = on_node & put_ok & (nodes.phase == ASLEEP)
    nodes = nodes._replace(
        phase=jnp.where(wakes, WAKING, nodes.phase),
        wake_end=jnp.where(wakes, p.wake_delay, nodes.wake_end),
        routed=nodes.routed + on_node,
    )
    error = jnp.where(overflow, ERROR_SLOT_OVERFLOW, 0).astype(jnp.int32)
    return Routed(slots, nodes, ~accept, error, on_node & accept)


def would_drop(slots: Slots, params: EnvParams) -> jax.Array:
    """[N] bool: whether a request routed to each node now would be dropped (its queue is full)."""
    n_wait = (slots.status == WAITING).sum(axis=1)
    return n_wait >= params.nodes.queue_capacity


def kv_utilisation(slots: Slots, cache: PrefixCache, geo: Geometry | None, params: EnvParams, cfg: EnvConfig):
    """([N] fraction of KV blocks held by running requests, [N] fraction held by the prefix cache).

    The first is what vLLM reports as KV-cache usage (cached blocks no request holds are free to
    reuse); for dynamic batching it is the batch's context tokens over the KV capacity.
    """
    p = params.nodes
    if cfg.scheduler == "dynamic":
        ctx = jnp.where(slots.status == RUNNING, slots.prompt + slots.generated, 0).sum(axis=1)
        return ctx / jnp.maximum(p.kv_blocks * p.block_size, 1), jnp.zeros_like(p.speed)
    if geo is None:
        private = jax.vmap(scheduler.kv_blocks_used, in_axes=(0, None, 0))(slots, None, p.block_size)
        return private / jnp.maximum(p.kv_blocks, 1), jnp.zeros_like(p.speed)
    private = jax.vmap(scheduler.kv_blocks_used)(slots, geo.chunks, p.block_size)
    held, pinned = cache.cached, cache.pinned
    total = jnp.maximum(p.kv_blocks, 1)
    return (private + pinned) / total, held / total
