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
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from burstgym.latency import LatencyModel, step_time
from burstgym.types import EMPTY, NO_REQUEST, RUNNING, WAITING, Slots

_BIG = jnp.iinfo(jnp.int32).max


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
    admitted: jax.Array  # [] int32, admissions made
    preempted: jax.Array  # [S] bool, slots preempted by this plan


def _ceil_div(a: jax.Array, b: jax.Array) -> jax.Array:
    return (a + b - 1) // b


def _greedy(need_sorted: jax.Array, budget: jax.Array) -> jax.Array:
    """Tokens given in order from a shared budget: each takes min(need, what is left)."""
    before = jnp.cumsum(need_sorted) - need_sorted
    return jnp.clip(budget - before, 0, need_sorted)


def _place(order: jax.Array, sorted_values: jax.Array) -> jax.Array:
    """Undo a permutation: the value at sorted position i goes back to slot order[i]."""
    return jnp.zeros_like(sorted_values).at[order].set(sorted_values)


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


def plan_continuous(
    slots: Slots, cfg: NodeConfig, admit_counter: jax.Array, preempt_counter: jax.Array
) -> Plan:
    """Plan the next continuous-batching iteration of one node."""
    n_slots = slots.status.shape[0]
    pos = jnp.arange(n_slots)
    running = slots.status == RUNNING
    seq_len = slots.prompt + slots.generated
    budget = cfg.max_num_batched_tokens
    bs = cfg.block_size

    # 1. Running requests, oldest admission first, share the token budget greedily.
    order = jnp.argsort(jnp.where(running, slots.admit, _BIG))
    run_s = running[order]
    need_s = jnp.where(run_s, (seq_len - slots.computed)[order], 0)
    t_s = _greedy(need_s, budget)

    # 2. KV blocks: preempt the most recently admitted until the rest fit.
    comp_s = slots.computed[order]
    held_s = jnp.where(run_s, _ceil_div(comp_s, bs), 0)
    extra_s = jnp.where(run_s, _ceil_div(comp_s + t_s, bs) - held_s, 0)
    free = cfg.kv_blocks - held_s.sum()
    n_run = run_s.sum()
    # Keeping the first j running requests fits iff their extra blocks <= free + blocks held by the rest.
    keep_extra = jnp.cumsum(extra_s) - extra_s
    freed = held_s.sum() - (jnp.cumsum(held_s) - held_s)
    fits = (keep_extra <= free + freed) & (pos <= n_run)
    all_fit = extra_s.sum() <= free
    keep = jnp.where(all_fit, n_run, jnp.max(jnp.where(fits, pos, 0)))
    pre_s = run_s & (pos >= keep)
    n_pre = pre_s.sum()
    t_s = jnp.where(pre_s, 0, t_s)
    free_after = free + jnp.where(pre_s, held_s, 0).sum() - jnp.where(pre_s, 0, extra_s).sum()
    budget_left = budget - t_s.sum()

    preempted = _place(order, pre_s)
    # Most recently admitted is preempted first and gets the larger counter; the earliest ends first.
    pre_key = -(preempt_counter + (n_run - _place(order, pos)))
    t_run = _place(order, t_s)

    # 3. Admission, only when nothing was preempted: FCFS with head-of-line blocking.
    waiting = slots.status == WAITING
    worder = jnp.argsort(jnp.where(waiting, slots.key, _BIG))
    wait_s = waiting[worder]
    wneed_s = jnp.where(wait_s, seq_len[worder], 0)
    tw_s = _greedy(wneed_s, budget_left)
    blocks_s = _ceil_div(tw_s, bs)
    ok_s = (
        wait_s
        & (tw_s > 0)
        & (jnp.cumsum(blocks_s) <= free_after)
        & (pos < cfg.max_num_seqs - (n_run - n_pre))
        & (n_pre == 0)
    )
    adm_s = jnp.cumprod(ok_s.astype(jnp.int32)).astype(bool)
    n_adm = adm_s.sum()
    admitted = _place(worder, adm_s)
    t_adm = _place(worder, jnp.where(adm_s, tw_s, 0))
    admit_no = admit_counter + _place(worder, pos)

    sched = jnp.where(admitted, t_adm, t_run)
    new = slots._replace(
        status=jnp.where(preempted, WAITING, jnp.where(admitted, RUNNING, slots.status)),
        key=jnp.where(preempted, pre_key, slots.key),
        admit=jnp.where(admitted, admit_no, slots.admit),
        computed=jnp.where(preempted, 0, slots.computed),
        sched=sched,
    )
    duration = _batch_time(new, cfg)
    return Plan(new, duration, sched.sum() > 0, n_adm, preempted)


def dynamic_can_start(slots: Slots, cfg: NodeConfig, now: jax.Array) -> jax.Array:
    """Earliest time >= now at which an idle dynamic-batching node launches (inf if never)."""
    batch_open = (slots.status == RUNNING).any()
    waiting = slots.status == WAITING
    n_wait = waiting.sum()
    oldest = jnp.min(jnp.where(waiting, slots.arrival, jnp.inf))
    launch = jnp.where(n_wait >= cfg.max_batch_size, now, jnp.maximum(now, oldest + cfg.max_queue_delay))
    return jnp.where(batch_open, now, jnp.where(n_wait > 0, launch, jnp.inf))


def plan_dynamic(slots: Slots, cfg: NodeConfig, admit_counter: jax.Array) -> Plan:
    """Plan the next iteration of a dynamic-batching node: a new batch's prefill, or a decode."""
    n_slots = slots.status.shape[0]
    pos = jnp.arange(n_slots)
    running = slots.status == RUNNING
    batch_open = running.any()
    waiting = slots.status == WAITING
    worder = jnp.argsort(jnp.where(waiting, slots.key, _BIG))
    join_s = waiting[worder] & (pos < cfg.max_batch_size) & ~batch_open
    joins = _place(worder, join_s)
    admit_no = admit_counter + _place(worder, pos)
    status = jnp.where(joins, RUNNING, slots.status)
    seq_len = slots.prompt + slots.generated
    sched = jnp.where(status == RUNNING, seq_len - slots.computed, 0)
    new = slots._replace(status=status, admit=jnp.where(joins, admit_no, slots.admit), sched=sched)
    return Plan(new, _batch_time(new, cfg), sched.sum() > 0, joins.sum(), jnp.zeros(n_slots, bool))


class IterationResult(NamedTuple):
    """The effect of an iteration ending on one node."""

    slots: Slots
    first_token: jax.Array  # [S] bool, slots whose first output token came in this iteration
    finished: jax.Array  # [S] bool, slots whose last output token came (now freed)
    finished_req: jax.Array  # [S] int32, request index of each finished slot


def finish_iteration(slots: Slots) -> IterationResult:
    """Apply the scheduled tokens: KV grows, a sequence that reaches its length emits a token."""
    seq_len = slots.prompt + slots.generated
    computed = slots.computed + slots.sched
    emits = (slots.sched > 0) & (computed == seq_len)
    generated = slots.generated + emits
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
