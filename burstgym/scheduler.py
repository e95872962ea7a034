"""Node schedulers: which requests run in a node's next iteration, and what an iteration does.

Functions here act on one node (slot arrays of shape [S], scalar parameters); the cluster vmaps
them over nodes. The rules are those of docs/semantics.md:
- `continuous`: iteration-level batching as in vLLM / Orca (Yu et al., OSDI'22; Kwon et al.,
  SOSP'23): a token budget shared greedily, KV blocks, preemption by recompute of the most
  recently admitted request, FCFS admission with head-of-line blocking, chunked prefill
  (Agrawal et al., Sarathi-Serve, OSDI'24).
- `dynamic`: a batching window as in Triton's dynamic batcher: an idle node launches a batch
  when `max_batch_size` requests wait or the oldest has waited `max_queue_delay`; the batch
  prefills together, decodes until its last member is done, and only then does the next start.

Order without sorting: a node's slot table is kept in the order the contract ranks requests —
running requests by admission (oldest first), then waiting requests in queue order — with empty
slots as holes among the running ones and after the queue. Every operation preserves that order:
admission turns the head of the queue into the newest running requests in place; preemption turns
the newest running requests into the head of the queue (earliest-admitted first) in place; a
finish leaves a hole; an arrival is appended after the last occupied slot, once `compact` has
closed the holes (the cluster compacts once per routing step, not per event). Greedy budgets and
FCFS rules are then prefix sums over slots, in which holes count zero. Sorting and per-event
compaction are avoided because XLA's CPU sort and scatter dominated the step time.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from burstgym.latency import LatencyModel, step_time
from burstgym.types import EMPTY, NO_REQUEST, RUNNING, WAITING, Slots


class NodeConfig(NamedTuple):
    """One node's scheduler parameters (scalars): a slice of `NodeParams`."""

    latency: LatencyModel
    speed: jax.Array
    max_num_seqs: jax.Array
    max_num_batched_tokens: jax.Array
    block_size: jax.Array
    kv_blocks: jax.Array
    max_batch_size: jax.Array
    max_queue_delay: jax.Array


class Plan(NamedTuple):
    """The outcome of planning one iteration on one node."""

    slots: Slots  # with `sched` set, admissions and preemptions applied
    duration: jax.Array  # [] float, seconds (0 when nothing was scheduled)
    started: jax.Array  # [] bool, whether anything was scheduled
    preempted: jax.Array  # [S] bool, slots preempted by this plan


def _ceil_div(a: jax.Array, b: jax.Array) -> jax.Array:
    return (a + b - 1) // b


def _greedy(need_sorted: jax.Array, budget: jax.Array) -> jax.Array:
    """Tokens given in order from a shared budget: each takes min(need, what is left)."""
    before = jnp.cumsum(need_sorted) - need_sorted
    return jnp.clip(budget - before, 0, need_sorted)


def kv_blocks_used(slots: Slots, block_size: jax.Array) -> jax.Array:
    """KV blocks held by the running requests of a node."""
    held = jnp.where(slots.status == RUNNING, _ceil_div(slots.computed, block_size), 0)
    return held.sum()


def _batch_time(slots: Slots, cfg: NodeConfig) -> jax.Array:
    """Duration of the iteration described by `slots.sched` (docs/semantics.md, step 4)."""
    t = slots.sched
    seq_len = slots.prompt + slots.generated
    decoding = (t == 1) & (slots.computed == seq_len - 1)
    prefill = (t > 0) & ~decoding
    tf = t.astype(slots.arrival.dtype)
    computed = slots.computed.astype(tf.dtype)
    prefill_tokens = jnp.where(prefill, tf, 0.0).sum()
    prefill_pairs = jnp.where(prefill, tf * (computed + (tf + 1.0) / 2.0), 0.0).sum()
    decode_seqs = decoding.sum()
    kv_tokens = jnp.where(decoding, computed, 0.0).sum()
    return cfg.speed * step_time(cfg.latency, prefill_tokens, decode_seqs, kv_tokens, prefill_pairs)


def plan_continuous(slots: Slots, cfg: NodeConfig) -> Plan:
    """Plan the next continuous-batching iteration of one node (docs/semantics.md, steps 1-4)."""
    n_slots = slots.status.shape[0]
    pos = jnp.arange(n_slots)
    running = slots.status == RUNNING
    waiting = slots.status == WAITING
    seq_len = slots.prompt + slots.generated
    budget = cfg.max_num_batched_tokens
    bs = cfg.block_size

    # 1. Running requests (table order = admission order) share the budget greedily.
    t = _greedy(jnp.where(running, seq_len - slots.computed, 0), budget)

    # 2. KV blocks: preempt the most recently admitted until the rest fit.
    held = jnp.where(running, _ceil_div(slots.computed, bs), 0)
    extra = jnp.where(running, _ceil_div(slots.computed + t, bs) - held, 0)
    free = cfg.kv_blocks - held.sum()
    n_run = running.sum()
    # Keeping the first j running requests fits iff their extra blocks <= free + blocks held by the rest.
    keep_extra = jnp.cumsum(extra) - extra
    freed = held.sum() - (jnp.cumsum(held) - held)
    # Slots j.. beyond the last running request give the "all fit" case, handled apart.
    fits = keep_extra <= free + freed
    keep = jnp.where(extra.sum() <= free, n_slots, jnp.max(jnp.where(fits, pos, 0)))
    preempted = running & (pos >= keep)
    n_pre = preempted.sum()
    t = jnp.where(preempted, 0, t)
    free_after = free + jnp.where(preempted, held, 0).sum() - jnp.where(preempted, 0, extra).sum()

    # 3. Admission, only when nothing was preempted: FCFS with head-of-line blocking. The queue
    # follows the running requests in the table (preempted requests, now its head, need no move).
    budget_left = budget - t.sum()
    tw = _greedy(jnp.where(waiting, seq_len, 0), budget_left)
    rank = jnp.cumsum(waiting) - waiting
    ok = (
        waiting
        & (tw > 0)
        & (jnp.cumsum(_ceil_div(tw, bs)) <= free_after)
        & (rank < cfg.max_num_seqs - n_run)
        & (n_pre == 0)
    )
    # Prefix rule over the queue: admitted iff every waiting request before it was admitted.
    admitted = waiting & (jnp.cumsum(waiting & ~ok) == 0)

    # Prefix sums promote int32 to int64 under x64; keep the slot table's dtypes (a while_loop carry).
    sched = jnp.where(admitted, tw, t).astype(slots.sched.dtype)
    new = slots._replace(
        status=jnp.where(preempted, WAITING, jnp.where(admitted, RUNNING, slots.status)),
        computed=jnp.where(preempted, 0, slots.computed),
        sched=sched,
    )
    return Plan(new, _batch_time(new, cfg), sched.sum() > 0, preempted)


def dynamic_can_start(slots: Slots, cfg: NodeConfig, now: jax.Array) -> jax.Array:
    """Earliest time >= now at which an idle dynamic-batching node launches (inf if never)."""
    batch_open = (slots.status == RUNNING).any()
    waiting = slots.status == WAITING
    n_wait = waiting.sum()
    oldest = jnp.min(jnp.where(waiting, slots.arrival, jnp.inf))
    launch = jnp.where(n_wait >= cfg.max_batch_size, now, jnp.maximum(now, oldest + cfg.max_queue_delay))
    return jnp.where(batch_open, now, jnp.where(n_wait > 0, launch, jnp.inf))


def plan_dynamic(slots: Slots, cfg: NodeConfig) -> Plan:
    """Plan the next iteration of a dynamic-batching node: a new batch's prefill, or a decode."""
    running = slots.status == RUNNING
    waiting = slots.status == WAITING
    # With no batch open, the first max_batch_size requests of the queue join.
    joins = waiting & (jnp.cumsum(waiting) <= cfg.max_batch_size) & ~running.any()
    status = jnp.where(joins, RUNNING, slots.status)
    seq_len = slots.prompt + slots.generated
    sched = jnp.where(status == RUNNING, seq_len - slots.computed, 0).astype(slots.sched.dtype)
    new = slots._replace(status=status, sched=sched)
    return Plan(new, _batch_time(new, cfg), sched.sum() > 0, jnp.zeros_like(running))


# Cap on a run's length, so integer conversions stay in range when the horizon is infinite.
_MAX_RUN = 2**20


def decode_run(plan: Plan, cfg: NodeConfig, room: jax.Array, kv_limited: bool) -> tuple[jax.Array, jax.Array]:
    """Fold a stretch of identical decode iterations into one event: (iterations m, their duration).

    When the planned iteration only decodes (no prefill, no admission, no preemption), the
    iterations after it stay the same until a request finishes, a KV block runs short or an
    arrival comes: each decodes the same n sequences over n more KV tokens. Step time is affine
    in `kv_tokens` at a fixed batch (burstgym.latency), so the m iterations take
    `m d0 + b m (m - 1) / 2` with `b` the growth per iteration, and the node can jump to their
    end in one event. This changes no outcome (each iteration still happens, with the same
    duration up to rounding); it only cuts the number of passes of the event loop, which the
    slowest of the vmapped clusters sets. `room` is the time left before the next arrival.
    Returns m = 1 and the planned duration when no run applies.
    """
    new = plan.slots
    running = new.status == RUNNING
    n = running.sum()
    seq_len = new.prompt + new.generated
    decoding = (new.sched == 1) & (new.computed == seq_len - 1)
    # Every running sequence decodes and none was just admitted (a fresh one-token prompt also
    # "decodes"): then admission stays blocked, since the budget, the sequence limit and the
    # free blocks only stay or shrink while nothing finishes.
    steady = (
        plan.started
        & (decoding == running).all()
        & ~plan.preempted.any()
        & ~(running & (new.generated == 0)).any()
    )
    # No one finishes inside the run: request r emits m tokens and finishes at generated == output.
    m_fin = jnp.min(jnp.where(running, new.output - new.generated, _MAX_RUN)) - 1
    if kv_limited:
        # Over m iterations each sequence needs at most m // block_size + 1 new blocks.
        free = cfg.kv_blocks - kv_blocks_used(new, cfg.block_size)
        m_kv = (free // jnp.maximum(n, 1)) * cfg.block_size - 1
    else:
        m_kv = jnp.int32(_MAX_RUN)
    d0 = plan.duration
    kv0 = jnp.where(decoding, new.computed, 0).sum().astype(d0.dtype)
    nf = n.astype(d0.dtype)
    b = jnp.maximum(cfg.speed * step_time(cfg.latency, 0.0, nf, kv0 + nf, 0.0) - d0, 0.0)

    def total(m: jax.Array) -> jax.Array:
        mf = m.astype(d0.dtype)
        return mf * d0 + b * mf * (mf - 1.0) / 2.0

    # Largest m with total(m) <= room: the positive root of b m^2 / 2 + (d0 - b / 2) m = room.
    lin = d0 - b / 2.0
    root = jnp.where(
        b > 0, (jnp.sqrt(lin * lin + 2.0 * b * room) - lin) / jnp.where(b > 0, b, 1.0), room / d0
    )
    m_time = jnp.floor(jnp.minimum(root, _MAX_RUN)).astype(jnp.int32)
    m_time = jnp.where(total(m_time) > room, m_time - 1, m_time)
    m = jnp.minimum(jnp.minimum(m_fin, m_kv), m_time).astype(jnp.int32)
    use = steady & (d0 > 0) & (m >= 2)
    m = jnp.where(use, m, 1)
    return m, jnp.where(use, total(m), d0)


class IterationResult(NamedTuple):
    """The effect of an iteration ending on one node."""

    slots: Slots
    first_token: jax.Array  # [S] bool, slots whose first output token came in this iteration
    finished: jax.Array  # [S] bool, slots whose last output token came (now freed)
    finished_req: jax.Array  # [S] int32, request index of each finished slot


def compact(slots: Slots) -> Slots:
    """Move the occupied slots to the front, keeping their order (a stable compaction)."""
    keep = slots.status != EMPTY
    target = jnp.where(keep, jnp.cumsum(keep) - 1, keep.shape[0])

    def pack(field: jax.Array, empty: int) -> jax.Array:
        return jnp.full_like(field, empty).at[target].set(field, mode="drop")

    return Slots(
        *(pack(f, NO_REQUEST if name == "req" else 0) for name, f in zip(Slots._fields, slots, strict=True))
    )


def finish_iteration(slots: Slots, repeat: jax.Array) -> IterationResult:
    """Apply the scheduled tokens: KV grows, a sequence that reaches its length emits a token.

    `repeat` > 1 ends a run of identical decode iterations (`decode_run`): each decoding
    sequence then gains `repeat` KV tokens and output tokens.
    """
    seq_len = slots.prompt + slots.generated
    scheduled = slots.sched > 0
    emits = scheduled & (slots.computed + slots.sched == seq_len)
    computed = slots.computed + slots.sched + jnp.where(scheduled, repeat - 1, 0)
    generated = slots.generated + jnp.where(emits, repeat, 0)
    first = emits & (slots.generated == 0)
    finished = emits & (generated >= slots.output)
    new = slots._replace(
        computed=computed,
        generated=generated,
        sched=jnp.zeros_like(slots.sched),
        status=jnp.where(finished, EMPTY, slots.status),
        req=jnp.where(finished, NO_REQUEST, slots.req),
    )
    return IterationResult(new, first, finished, slots.req)
