"""The cluster: routing one request to a node, and advancing every node's events in time.

Between two arrivals the nodes do not interact, so `advance` runs one `jax.lax.while_loop` in
which each pass handles the next event of every node at once (vectorised over nodes): an
iteration ending, a node waking or falling asleep, a new iteration starting. Latency and energy
are accrued per node between its events: by Little's law the latency accrued over an interval is
the integral of the number of requests in the node (see docs/semantics.md, "Objective").
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from burstgym import scheduler
from burstgym.types import (
    ASLEEP,
    BUSY,
    EMPTY,
    IDLE,
    NO_REQUEST,
    RUNNING,
    WAITING,
    WAKING,
    EnvConfig,
    EnvParams,
    NodeParams,
    NodeState,
    RequestLog,
    Slots,
)

# A safety net, far above any real episode: a runaway loop stops instead of hanging the process.
MAX_EVENTS_PER_ADVANCE = 10_000_000


class Accrual(NamedTuple):
    """What the objective accrued during one step, per node ([N] each)."""

    latency_s: jax.Array  # request-seconds spent in the node (waiting or running)
    energy_j: jax.Array  # joules drawn


def _bcast(mask: jax.Array, x: jax.Array) -> jax.Array:
    return mask.reshape(mask.shape + (1,) * (x.ndim - mask.ndim))


def tree_where(mask: jax.Array, a, b):
    """Take pytree `a` where mask[i] else `b`, along the leading axis of every leaf ([N] or [B])."""
    return jax.tree.map(lambda x, y: jnp.where(_bcast(mask, x), x, y), a, b)


def node_configs(nodes: NodeParams) -> scheduler.NodeConfig:
    """The scheduler's view of the node parameters (still [N] per field; vmap slices it)."""
    return scheduler.NodeConfig(
        latency=nodes.latency,
        speed=nodes.speed,
        max_num_seqs=nodes.max_num_seqs,
        max_num_batched_tokens=nodes.max_num_batched_tokens,
        block_size=nodes.block_size,
        kv_blocks=nodes.kv_blocks,
        max_batch_size=nodes.max_batch_size,
        max_queue_delay=nodes.max_queue_delay,
    )


def _start_time(slots: Slots, nodes: NodeState, params: EnvParams, cfg: EnvConfig) -> jax.Array:
    """[N] earliest time at which each node, if idle, can start an iteration (inf: not now)."""
    has_req = (slots.status != EMPTY).any(axis=1)
    if cfg.scheduler == "continuous":
        return jnp.where(has_req, nodes.last_time, jnp.inf)
    return jax.vmap(scheduler.dynamic_can_start)(slots, node_configs(params.nodes), nodes.last_time)


def next_event(slots: Slots, nodes: NodeState, params: EnvParams, cfg: EnvConfig) -> jax.Array:
    """[N] time of each node's next event (docs/semantics.md, "Node state")."""
    has_req = (slots.status != EMPTY).any(axis=1)
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
        nodes.phase == BUSY, p.busy_power_w, jnp.where(nodes.phase == ASLEEP, p.sleep_power_w, p.idle_power_w)
    )


def accrue(
    slots: Slots, nodes: NodeState, acc: Accrual, until: jax.Array, mask: jax.Array, params: EnvParams
) -> tuple[NodeState, Accrual]:
    """Accrue latency and energy on the masked nodes from their `last_time` to `until` ([N])."""
    dt = jnp.where(mask, until - nodes.last_time, 0.0)
    in_node = (slots.status != EMPTY).sum(axis=1)
    energy = _power(nodes, params) * dt
    nodes = nodes._replace(
        last_time=jnp.where(mask, until, nodes.last_time),
        energy_j=nodes.energy_j + energy,
        busy_s=nodes.busy_s + jnp.where(nodes.phase == BUSY, dt, 0.0),
    )
    return nodes, acc._replace(latency_s=acc.latency_s + in_node * dt, energy_j=acc.energy_j + energy)


def _handle_events(
    slots: Slots,
    nodes: NodeState,
    log: RequestLog,
    acc: Accrual,
    tau: jax.Array,
    active: jax.Array,
    until: jax.Array,
    params: EnvParams,
    cfg: EnvConfig,
) -> tuple[Slots, NodeState, RequestLog, Accrual]:
    """Handle the next event (at `tau`, [N]) of every active node (docs/semantics.md, "Handling a
    node event"); a new iteration that starts a stretch of identical decodes before `until`
    covers the whole stretch (`scheduler.decode_run`)."""
    nodes, acc = accrue(slots, nodes, acc, tau, active, params)
    tau_s = tau[:, None]

    # 1. An iteration ends: tokens land, first tokens and finishes are logged.
    ending = active & (nodes.phase == BUSY)
    res = jax.vmap(scheduler.finish_iteration)(slots, nodes.repeat)
    ending_s = ending[:, None]
    first = res.first_token & ending_s
    done = res.finished & ending_s
    first_token = log.first_token.at[jnp.where(first, res.finished_req, NO_REQUEST)].set(
        jnp.broadcast_to(tau_s, first.shape), mode="drop"
    )
    finish = log.finish.at[jnp.where(done, res.finished_req, NO_REQUEST)].set(
        jnp.broadcast_to(tau_s, done.shape), mode="drop"
    )
    slots = tree_where(ending, res.slots, slots)
    log = log._replace(first_token=first_token, finish=finish)

    # 2-3. Iteration over or woken: idle. Idle, empty and past the timeout: asleep.
    to_idle = ending | (active & (nodes.phase == WAKING))
    phase = jnp.where(to_idle, IDLE, nodes.phase)
    idle_since = jnp.where(to_idle, tau, nodes.idle_since)
    empty = ~(slots.status != EMPTY).any(axis=1)
    asleep = active & (phase == IDLE) & empty & (tau >= idle_since + params.nodes.sleep_timeout)
    phase = jnp.where(asleep, ASLEEP, phase)
    nodes = nodes._replace(phase=phase, idle_since=idle_since)

    # 4. Start the next iteration where the scheduler allows it.
    start_ok = active & (phase == IDLE) & (_start_time(slots, nodes, params, cfg) <= tau)
    ncfg = node_configs(params.nodes)
    if cfg.scheduler == "continuous":
        plan = jax.vmap(scheduler.plan_continuous)(slots, ncfg)
    else:
        plan = jax.vmap(scheduler.plan_dynamic)(slots, ncfg)
    preempted = plan.preempted & start_ok[:, None]
    log = log._replace(
        preemptions=log.preemptions.at[jnp.where(preempted, slots.req, NO_REQUEST)].add(1, mode="drop")
    )
    slots = tree_where(start_ok, plan.slots, slots)
    started = start_ok & plan.started
    room = until - tau
    repeat, duration = jax.vmap(scheduler.decode_run, in_axes=(0, 0, 0, None))(
        plan, ncfg, room, cfg.scheduler == "continuous"
    )
    nodes = nodes._replace(
        phase=jnp.where(started, BUSY, nodes.phase),
        iter_end=jnp.where(started, tau + duration, nodes.iter_end),
        repeat=jnp.where(started, repeat, nodes.repeat),
    )
    return slots, nodes, log, acc


def advance(
    slots: Slots,
    nodes: NodeState,
    log: RequestLog,
    acc: Accrual,
    until: jax.Array,
    drain: jax.Array,
    params: EnvParams,
    cfg: EnvConfig,
) -> tuple[Slots, NodeState, RequestLog, Accrual]:
    """Process every node event at a time <= `until`.

    With `drain`, only nodes that still hold requests are advanced (used with `until = inf` to
    finish every request at the end of an episode). Accrual is left at each node's last event.
    """

    def due(s: Slots, n: NodeState) -> tuple[jax.Array, jax.Array]:
        tau = next_event(s, n, params, cfg)
        holds = (s.status != EMPTY).any(axis=1)
        return tau, (tau <= until) & (holds | ~drain)

    def cond(carry):
        return carry[5].any() & (carry[6] < MAX_EVENTS_PER_ADVANCE)

    def body(carry):
        s, n, lg, a, tau, active, count = carry
        s, n, lg, a = _handle_events(s, n, lg, a, tau, active, until, params, cfg)
        return (s, n, lg, a, *due(s, n), count + 1)

    init = (slots, nodes, log, acc, *due(slots, nodes), jnp.int32(0))
    slots, nodes, log, acc, *_ = jax.lax.while_loop(cond, body, init)
    return slots, nodes, log, acc


class Routed(NamedTuple):
    """The cluster after one request was routed."""

    slots: Slots
    nodes: NodeState
    log: RequestLog
    dropped: jax.Array  # [] bool


def route(
    slots: Slots,
    nodes: NodeState,
    log: RequestLog,
    req: jax.Array,
    arrival: jax.Array,
    prompt: jax.Array,
    output: jax.Array,
    node: jax.Array,
    params: EnvParams,
) -> Routed:
    """Send request `req` to `node`: join its waiting queue, or be dropped if the queue is full."""
    p = params.nodes
    # Close the holes finished requests left, so the arrival lands after the queue's tail.
    slots = jax.vmap(scheduler.compact)(slots)
    accept = ~would_drop(slots, params)[node]
    slot = jnp.argmax(slots.status[node] == EMPTY)

    def put(field: jax.Array, value) -> jax.Array:
        return field.at[node, slot].set(jnp.where(accept, value, field[node, slot]))

    slots = Slots(
        req=put(slots.req, req),
        status=put(slots.status, WAITING),
        arrival=put(slots.arrival, arrival),
        prompt=put(slots.prompt, prompt),
        output=put(slots.output, output),
        computed=put(slots.computed, 0),
        generated=put(slots.generated, 0),
        sched=put(slots.sched, 0),
    )
    wakes = accept & (nodes.phase[node] == ASLEEP)
    nodes = nodes._replace(
        phase=nodes.phase.at[node].set(jnp.where(wakes, WAKING, nodes.phase[node])),
        wake_end=nodes.wake_end.at[node].set(
            jnp.where(wakes, arrival + p.wake_delay[node], nodes.wake_end[node])
        ),
        routed=nodes.routed.at[node].add(1),
    )
    log = log._replace(node=log.node.at[req].set(node), dropped=log.dropped.at[req].set(~accept))
    return Routed(slots, nodes, log, ~accept)


def would_drop(slots: Slots, params: EnvParams) -> jax.Array:
    """[N] bool: whether a request routed to each node now would be dropped."""
    n_wait = (slots.status == WAITING).sum(axis=1)
    full = ~(slots.status == EMPTY).any(axis=1)
    return (n_wait >= params.nodes.queue_capacity) | full


def kv_utilisation(slots: Slots, params: EnvParams, cfg: EnvConfig) -> jax.Array:
    """[N] fraction of KV capacity in use (dynamic batching: context tokens of the batch)."""
    p = params.nodes
    if cfg.scheduler == "continuous":
        used = jax.vmap(scheduler.kv_blocks_used)(slots, p.block_size)
        return used / jnp.maximum(p.kv_blocks, 1)
    ctx = jnp.where(slots.status == RUNNING, slots.prompt + slots.generated, 0).sum(axis=1)
    return ctx / jnp.maximum(p.kv_blocks * p.block_size, 1)
