"""Node schedulers: which requests run in a node's next iteration, and what an iteration does.

Functions here act on one node (slot arrays of shape [S], scalar parameters); the cluster vmaps
them over nodes. The rules are those of docs/semantics.md:
- `continuous`: iteration-level batching as in vLLM / Orca (Yu et al., OSDI'22; Kwon et al.,
  SOSP'23): a token budget shared greedily, KV blocks, preemption by recompute of the most
  recently admitted request, FCFS admission with head-of-line blocking, chunked prefill
  (Agrawal et al., Sarathi-Serve, OSDI'24), and automatic prefix caching (`burstgym.prefix_cache`):
  an admitted request skips the prefill of its longest run of cached leading chunks. The order of
  a step follows vLLM v0.11.0's V1 scheduler (vllm/v1/core/sched/scheduler.py `schedule`):
  running requests first, preempting from the newest when their blocks do not fit; waiting
  requests only when nothing was preempted, each looked up in the cache and allocated in turn.
- `dynamic`: a batching window as in Triton's dynamic batcher: an idle node launches a batch
  when `max_batch_size` requests wait or the oldest has waited `max_queue_delay`; the batch
  prefills together, decodes until its last member is done, and only then does the next start.
  With `padding` (static-batch engines behind the batcher), prompts are padded to the batch's
  longest and finished members keep their row until the batch ends.

Order without sorting: a node's slot table is kept in the order the contract ranks requests —
running requests by admission (oldest first), then waiting requests in queue order — with free
slots as holes among the running ones and after the queue. Every operation preserves that order:
admission turns the head of the queue into the newest running requests in place; preemption turns
the newest running requests into the head of the queue (earliest-admitted first) in place; a
finish leaves a hole; an arrival is appended after the last occupied slot, once `compact` has
closed the holes (the cluster compacts once per routing step, not per event). Greedy budgets and
FCFS rules are then prefix sums over slots, in which holes count zero.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp

from burstgym import chunk_table as ct
from burstgym import prefix_cache as pc
from burstgym.latency import LatencyModel, PowerModel, energy_j, step_time
from burstgym.prefix_cache import Chunks, ceil_div
from burstgym.types import DONE, RUNNING, WAITING, PrefixCache, Slots


class NodeConfig(NamedTuple):
    """One node's scheduler parameters (scalars): a slice of `NodeParams`."""

    latency: LatencyModel
    power: PowerModel
    speed: jax.Array
    max_num_seqs: jax.Array
    max_num_batched_tokens: jax.Array
    block_size: jax.Array
    kv_blocks: jax.Array
    max_batch_size: jax.Array
    max_queue_delay: jax.Array


class Shape(NamedTuple):
    """What one iteration computes (the arguments of `step_time`)."""

    prefill_tokens: jax.Array  # [] prompt (or recompute) tokens
    decode_seqs: jax.Array  # [] sequences decoding one token
    kv_tokens: jax.Array  # [] KV entries read by the decoding sequences
    prefill_pairs: jax.Array  # [] attention (query, key) pairs of the prefill chunks


class Admission(NamedTuple):
    """Prefix-cache accounting of one plan's admissions (zeros without prefix caching)."""

    saved: jax.Array  # [] tokens served from the cache (every admission)
    first_hit: jax.Array  # [] of which at first admissions
    first_prompt: jax.Array  # [] prompt tokens of first admissions


class Plan(NamedTuple):
    """The outcome of planning one iteration on one node."""

    slots: Slots  # with `sched` set, admissions and preemptions applied
    cache: PrefixCache  # hits pinned, computed chunks cached, evictions done
    shape: Shape
    duration: jax.Array  # [] float, seconds (0 when nothing was scheduled)
    started: jax.Array  # [] bool, whether anything was scheduled
    preempted: jax.Array  # [S] bool, slots preempted by this plan
    admitted: jax.Array  # [S] bool, slots admitted by this plan
    batch_rows: jax.Array  # [] int32, rows of the batch in flight after this plan (dynamic)
    batch_prompt: jax.Array  # [] int32, its padded prompt length (dynamic)
    stats: Admission
    at: jax.Array | None = None  # [S, B] int32 table positions of the pinned chunks (prefix caching)


def _greedy(need_sorted: jax.Array, budget: jax.Array) -> jax.Array:
    """Tokens given in order from a shared budget: each takes min(need, what is left)."""
    before = jnp.cumsum(need_sorted) - need_sorted
    return jnp.clip(budget - before, 0, need_sorted)


def _duration(shape: Shape, cfg: NodeConfig) -> jax.Array:
    return cfg.speed * step_time(
        cfg.latency, shape.prefill_tokens, shape.decode_seqs, shape.kv_tokens, shape.prefill_pairs
    )


def private_blocks(slots: Slots, chunks: Chunks | None, block_size: jax.Array) -> jax.Array:
    """[S] KV blocks each running request holds outside the prefix cache."""
    pend = 0 if chunks is None else pc.chunk_end(chunks.end, slots.pin)
    held = ceil_div(jnp.maximum(slots.computed - pend, 0), block_size)
    return jnp.where(slots.status == RUNNING, held, 0)


def kv_blocks_used(slots: Slots, chunks: Chunks | None, block_size: jax.Array) -> jax.Array:
    """[] KV blocks held by the running requests: private blocks (pinned chunks are counted apart)."""
    return private_blocks(slots, chunks, block_size).sum()


def continuous_shape(slots: Slots) -> Shape:
    """The iteration described by `slots.sched` (docs/semantics.md, continuous step 4)."""
    t = slots.sched
    seq_len = slots.prompt + slots.generated
    decoding = (t == 1) & (slots.computed == seq_len - 1)
    prefill = (t > 0) & ~decoding
    tf = t.astype(slots.arrival.dtype)
    computed = slots.computed.astype(tf.dtype)
    return Shape(
        prefill_tokens=jnp.where(prefill, tf, 0.0).sum(),
        decode_seqs=decoding.sum().astype(tf.dtype),
        kv_tokens=jnp.where(decoding, computed, 0.0).sum(),
        prefill_pairs=jnp.where(prefill, tf * (computed + (tf + 1.0) / 2.0), 0.0).sum(),
    )


def _admit_fcfs(slots: Slots, t: jax.Array, free: jax.Array, n_run: jax.Array, cfg: NodeConfig):
    """Admission without a prefix cache: FCFS with head-of-line blocking, as prefix sums."""
    waiting = slots.status == WAITING
    seq_len = slots.prompt + slots.generated
    budget_left = cfg.max_num_batched_tokens - t.sum()
    tw = _greedy(jnp.where(waiting, seq_len, 0), budget_left)
    rank = jnp.cumsum(waiting) - waiting
    ok = (
        waiting
        & (tw > 0)
        & (jnp.cumsum(ceil_div(tw, cfg.block_size)) <= free)
        & (rank < cfg.max_num_seqs - n_run)
    )
    # Prefix rule over the queue: admitted iff every waiting request before it was admitted.
    admitted = waiting & (jnp.cumsum(waiting & ~ok) == 0)
    first = admitted & (slots.hit < 0)
    stats = Admission(
        saved=jnp.int32(0),
        first_hit=jnp.int32(0),
        first_prompt=jnp.where(first, slots.prompt, 0).sum(),
    )
    new = slots._replace(
        status=jnp.where(admitted, RUNNING, slots.status),
        sched=jnp.where(admitted, tw, slots.sched).astype(slots.sched.dtype),
        hit=jnp.where(first, 0, slots.hit),
    )
    return new, admitted, stats


class _Admitting(NamedTuple):
    slots: Slots
    cache: PrefixCache
    at: jax.Array  # [S, B] table positions of the pinned chunks
    admitted: jax.Array
    private: jax.Array  # [] private blocks of the running set
    budget: jax.Array
    n_run: jax.Array
    pos: jax.Array
    stop: jax.Array
    stats: Admission


def _admit_cached(
    slots: Slots,
    cache: PrefixCache,
    at: jax.Array,
    chunks: Chunks,
    private: jax.Array,
    budget: jax.Array,
    n_run: jax.Array,
    cfg: NodeConfig,
    max_entries: int,
    anywhere: Callable[[jax.Array], jax.Array],
):
    """Admission with a prefix cache, one waiting request at a time in queue order (vLLM V1).

    Each looks up its longest run of cached leading chunks (capped so that at least the last
    block of the sequence is computed: vllm/v1/core/kv_cache_manager.py `get_computed_blocks`),
    needs the blocks of its first chunk plus the hit chunks no running request holds (they leave
    the evictable pool), pins its hits and the chunks its first chunk completes (cached at
    scheduling time, as vLLM's `allocate_slots` caches full blocks), and evicts what it must.
    The first request that does not fit stops admission (head-of-line blocking).

    The loop runs while some node planned together (`anywhere`, `plan_continuous`) still has a
    request to consider; a node that is done passes through the rest unchanged (every change is
    masked by its request being considered), so the loop's condition is one for all nodes and a
    pass selects nothing between old and new carries.
    """
    n_slots, width = chunks.ids.shape
    pos_all = jnp.arange(n_slots)
    j = jnp.arange(width)
    bs = cfg.block_size
    last_waiting = jnp.max(jnp.where(slots.status == WAITING, pos_all, -1))

    def live(s: _Admitting) -> jax.Array:
        return ~s.stop & (s.pos <= last_waiting)

    def cond(s: _Admitting) -> jax.Array:
        return anywhere(live(s))

    def body(s: _Admitting) -> _Admitting:
        # The slot at `pos` is read and written through a one-hot mask: under the nodes' vmap an
        # indexed read or write would be a gather or a scatter, each far dearer than a select.
        p = s.pos
        here = pos_all == p
        sl, c = s.slots, s.cache

        def pick(x: jax.Array) -> jax.Array:
            on = here.reshape(here.shape + (1,) * (x.ndim - 1))
            return jnp.where(on, x, 0).sum(axis=0, dtype=x.dtype) if x.dtype != bool else (on & x).any(axis=0)

        go = live(s)
        is_wait = go & pick(sl.status == WAITING)
        mine = jax.tree.map(pick, chunks)
        ids, end, blk = mine.ids, mine.end, mine.blocks
        valid = ids >= 0
        # Every chunk of the request gets an entry (one that stays unpinned is not held: it costs
        # nothing), so one probe finds what is held and where the pins go.
        table, spot, overflow = ct.insert(c.table, ids, is_wait & valid, mine.tokens)
        c = c._replace(table=table, full=c.full | overflow)
        held_now = pc.held_at(c, spot)
        h = pc.leading_run(held_now)
        seq_len = pick(sl.prompt + sl.generated)
        cap = bs * ((seq_len - 1) // bs)
        hit_tok = jnp.minimum(pc.chunk_end(end, h), cap)
        t = jnp.clip(jnp.minimum(seq_len - hit_tok, s.budget), 0)
        done_tok = hit_tok + t
        new_pin = jnp.maximum(h, ((ids >= 0) & (end <= done_tok)).sum().astype(jnp.int32))
        own = ceil_div(jnp.maximum(done_tok - pc.chunk_end(end, new_pin), 0), bs)
        ref_now = c.table.ref[jnp.maximum(spot, 0)]
        claim = jnp.where(valid & (j < h) & (ref_now == 0), blk, 0).sum()
        fresh = jnp.where(valid & (j >= h) & (j < new_pin) & ~held_now, blk, 0).sum()
        available = cfg.kv_blocks - s.private - c.pinned
        ok = is_wait & (t > 0) & (own + fresh + claim <= available) & (s.n_run < cfg.max_num_seqs)
        pins = ok & valid & (j < new_pin)
        c2 = pc.pin_at(c, mine, spot, pins)
        private2 = s.private + jnp.where(ok, own, 0)
        c2 = pc.evict(c2, jnp.where(ok, private2 + c2.cached - cfg.kv_blocks, 0), bs, max_entries)
        first = ok & (pick(sl.hit) < 0)
        take, fill = here & ok, here & first
        new = sl._replace(
            status=jnp.where(take, RUNNING, sl.status),
            computed=jnp.where(take, hit_tok, sl.computed),
            sched=jnp.where(take, t, sl.sched),
            pin=jnp.where(take, new_pin, sl.pin),
            hit=jnp.where(fill, hit_tok, sl.hit),
        )
        stats = Admission(
            saved=s.stats.saved + jnp.where(ok, hit_tok, 0),
            first_hit=s.stats.first_hit + jnp.where(first, hit_tok, 0),
            first_prompt=s.stats.first_prompt + jnp.where(first, pick(sl.prompt), 0),
        )
        return _Admitting(
            slots=new,
            cache=c2,
            at=jnp.where(here[:, None] & pins[None, :], spot[None, :], s.at),
            admitted=s.admitted | take,
            private=private2,
            budget=s.budget - jnp.where(ok, t, 0),
            n_run=s.n_run + ok,
            pos=jnp.where(go, p + 1, p),
            stop=s.stop | (is_wait & ~ok),
            stats=stats,
        )

    first_waiting = jnp.argmax(slots.status == WAITING)
    zero = jnp.int32(0)
    init = _Admitting(
        slots=slots,
        cache=cache,
        at=at,
        admitted=jnp.zeros(n_slots, bool),
        private=private,
        budget=budget,
        n_run=n_run,
        pos=first_waiting.astype(jnp.int32),
        stop=jnp.bool_(False),
        stats=Admission(zero, zero, zero),
    )
    out = jax.lax.while_loop(cond, body, init)
    return out.slots, out.cache, out.at, out.admitted, out.stats


def plan_continuous(
    slots: Slots,
    cfg: NodeConfig,
    cache: PrefixCache,
    chunks: Chunks | None,
    at: jax.Array | None = None,
    max_entries: int = 0,
    nodes_axis: str | None = None,
) -> Plan:
    """Plan the next continuous-batching iteration of one node (docs/semantics.md, steps 1-4).

    `chunks` is None without prefix caching (that code is then not traced); with it, `at` ([S, B])
    holds the table positions of the pinned chunks (`prefix_cache.locate`; the plan returns them
    updated) and `max_entries` the chunks a node may hold (`EnvConfig.cache_entries`).

    The prefix cache's per-pair work (first pinners, releases of preempted requests, pins of the
    chunks running requests complete) runs under a `lax.cond` taken only when some node has such
    pairs; skipped, it would change nothing. `nodes_axis` names the `vmap` axis of the nodes
    planned together, so the condition is one for all of them (a condition that differed per node
    would turn the `cond` into a select that runs both branches).
    """

    def anywhere(x: jax.Array) -> jax.Array:
        """[] bool: `x` ([] bool) holds on some node planned together."""
        return x if nodes_axis is None else jax.lax.psum(x.astype(jnp.int32), nodes_axis) > 0

    n_slots = slots.status.shape[0]
    pos = jnp.arange(n_slots)
    running = slots.status == RUNNING
    seq_len = slots.prompt + slots.generated
    bs = cfg.block_size
    cached = chunks is not None

    # 1. Running requests (table order = admission order) share the budget greedily.
    t = _greedy(jnp.where(running, seq_len - slots.computed, 0), cfg.max_num_batched_tokens)

    # 2. KV blocks: preempt the most recently admitted until the rest fit.
    pend = pc.chunk_end(chunks.end, slots.pin) if cached else 0
    private = private_blocks(slots, chunks, bs)
    extra = jnp.where(running, ceil_div(jnp.maximum(slots.computed + t - pend, 0), bs) - private, 0)
    if cached:
        held_blocks, pinned = pc.usage(cache)
    else:
        held_blocks = pinned = jnp.int32(0)
    empty = cfg.kv_blocks - private.sum() - held_blocks
    available = empty + held_blocks - pinned  # free blocks plus evictable cached chunks
    # Preempting the running requests at positions >= p frees their private blocks and the chunks
    # only they pin (a chunk's first pinner is at >= p).
    freed = private.sum() - (jnp.cumsum(private) - private)
    short = extra.sum() > available  # some running request must be preempted
    if cached:
        width = chunks.ids.shape[1]
        j = jnp.arange(width)[None, :]

        def pinned_freed(cache: PrefixCache) -> tuple[PrefixCache, jax.Array]:
            pairs = running[:, None] & (j < slots.pin[:, None]) & (chunks.ids >= 0)
            cache, first = pc.first_pinners(cache, at, pairs)  # each pinned chunk once
            slot_of = jnp.where(first, jnp.broadcast_to(pos[:, None], first.shape), n_slots)
            by_pos = jnp.zeros(n_slots + 1, jnp.int32).at[slot_of].add(jnp.where(first, chunks.blocks, 0))
            return cache, (jnp.cumsum(by_pos[::-1])[::-1])[:n_slots]

        # (only read when blocks are short; first_pinners' stamps are scratch on pinned chunks)
        cache, by_chunks = jax.lax.cond(
            anywhere(short), pinned_freed, lambda c: (c, jnp.zeros(n_slots, jnp.int32)), cache
        )
        freed = freed + by_chunks
    keep_extra = jnp.cumsum(extra) - extra
    fits = keep_extra <= available + freed
    keep = jnp.where(short, jnp.max(jnp.where(fits, pos, 0)), n_slots)
    preempted = running & (pos >= keep)
    kept = running & ~preempted
    n_pre = preempted.sum()
    t = jnp.where(preempted, 0, t)
    slots = slots._replace(
        status=jnp.where(preempted, WAITING, slots.status),
        computed=jnp.where(preempted, 0, slots.computed),
        sched=t.astype(slots.sched.dtype),
        preempted=slots.preempted + preempted,
    )
    if cached:
        # Preempted requests release their chunks, newest request first, last chunk first.
        def release_preempted(cache: PrefixCache) -> PrefixCache:
            rel = preempted[:, None] & (j < slots.pin[:, None]) & (chunks.ids >= 0)
            rank, span = pc.release_rank(rel, slots.pin, newest_first=True)
            return pc.release(cache, chunks, at, rel, rank, span)

        cache = jax.lax.cond(anywhere(n_pre > 0), release_preempted, lambda c: c, cache)
        # Chunks the running requests complete in this iteration are cached now (vLLM caches full
        # blocks when it allocates them), then evictions make room for their growth.
        new_pin = jnp.maximum(slots.pin, pc.covered(chunks, slots.computed + t))
        new_pin = jnp.where(kept, new_pin, 0)
        ins = kept[:, None] & (j >= slots.pin[:, None]) & (j < new_pin[:, None]) & (chunks.ids >= 0)

        def pin_completed(cache: PrefixCache, at: jax.Array) -> tuple[PrefixCache, jax.Array]:
            cache, spot = pc.add_refs(cache, chunks, ins)
            return cache, jnp.where(ins, spot, at)

        cache, at = jax.lax.cond(anywhere(ins.any()), pin_completed, lambda c, a: (c, a), cache, at)
        slots = slots._replace(pin=jnp.where(running, new_pin, slots.pin))
        grown = jnp.where(
            kept, ceil_div(jnp.maximum(slots.computed + t - pc.chunk_end(chunks.end, new_pin), 0), bs), 0
        ).sum()
        cache = pc.evict(cache, grown + cache.cached - cfg.kv_blocks, bs, max_entries)
        # 3. Admission, one by one, only when nothing was preempted.
        # (int32 carries: under x64 the sums would be int64 and scatter into int32 slots.)
        budget_left = jnp.where(n_pre == 0, cfg.max_num_batched_tokens - t.sum(), 0).astype(jnp.int32)
        n_kept = kept.sum().astype(jnp.int32)
        slots, cache, at, admitted, stats = _admit_cached(
            slots, cache, at, chunks, grown.astype(jnp.int32), budget_left, n_kept, cfg, max_entries, anywhere
        )
    else:
        free_after = empty + jnp.where(preempted, private, 0).sum() - jnp.where(kept, extra, 0).sum()
        admitted_slots, admitted, stats = _admit_fcfs(slots, t, free_after, kept.sum(), cfg)
        take = n_pre == 0
        slots = jax.tree.map(lambda a, b: jnp.where(take, a, b), admitted_slots, slots)
        admitted = admitted & take
        stats = jax.tree.map(lambda a: jnp.where(take, a, 0), stats)
    shape = continuous_shape(slots)
    zero = jnp.int32(0)
    return Plan(
        slots,
        cache,
        shape,
        _duration(shape, cfg),
        slots.sched.sum() > 0,
        preempted,
        admitted,
        zero,
        zero,
        stats,
        at,
    )


def dynamic_can_start(slots: Slots, batch_rows: jax.Array, cfg: NodeConfig, now: jax.Array) -> jax.Array:
    """Earliest time >= now at which an idle dynamic-batching node launches (inf if never)."""
    waiting = slots.status == WAITING
    n_wait = waiting.sum()
    oldest = jnp.min(jnp.where(waiting, slots.arrival, jnp.inf))
    launch = jnp.where(n_wait >= cfg.max_batch_size, now, jnp.maximum(now, oldest + cfg.max_queue_delay))
    return jnp.where(batch_rows > 0, now, jnp.where(n_wait > 0, launch, jnp.inf))


def plan_dynamic(
    slots: Slots, batch_rows: jax.Array, batch_prompt: jax.Array, cfg: NodeConfig, padding: bool
):
    """Plan the next iteration of a dynamic-batching node: a new batch's prefill, or a decode.

    With `padding`, a new batch of b requests prefills b x (its longest prompt) tokens, and each
    decode iteration computes all b rows over the padded context, finished members included,
    until the batch's longest output is done. Without, only the real tokens and the unfinished
    members count.
    """
    running = slots.status == RUNNING
    waiting = slots.status == WAITING
    fdt = slots.arrival.dtype
    is_open = batch_rows > 0
    joins = waiting & (jnp.cumsum(waiting) <= cfg.max_batch_size) & ~is_open
    members = running | joins
    status = jnp.where(joins, RUNNING, slots.status)
    seq_len = slots.prompt + slots.generated
    sched = jnp.where(members, seq_len - slots.computed, 0).astype(slots.sched.dtype)
    rows = jnp.where(is_open, batch_rows, joins.sum())
    longest = jnp.where(is_open, batch_prompt, jnp.max(jnp.where(joins, slots.prompt, 0)))
    p = slots.prompt.astype(fdt)
    if padding:
        pf, rf = longest.astype(fdt), rows.astype(fdt)
        gen = jnp.max(jnp.where(running, slots.generated, 0)).astype(fdt)
        one = longest <= 1  # a one-token prompt is classified as decoding (continuous step 4)
        prefill = Shape(
            prefill_tokens=jnp.where(one, 0.0, rf * pf),
            decode_seqs=jnp.where(one, rf, 0.0),
            kv_tokens=jnp.asarray(0.0, fdt),
            prefill_pairs=jnp.where(one, 0.0, rf * pf * (pf + 1.0) / 2.0),
        )
        decode = Shape(
            prefill_tokens=jnp.asarray(0.0, fdt),
            decode_seqs=rf,
            kv_tokens=rf * (pf + gen - 1.0),
            prefill_pairs=jnp.asarray(0.0, fdt),
        )
    else:
        big = joins & (slots.prompt > 1)
        prefill = Shape(
            prefill_tokens=jnp.where(big, p, 0.0).sum(),
            decode_seqs=(joins & ~big).sum().astype(fdt),
            kv_tokens=jnp.asarray(0.0, fdt),
            prefill_pairs=jnp.where(big, p * (p + 1.0) / 2.0, 0.0).sum(),
        )
        decode = Shape(
            prefill_tokens=jnp.asarray(0.0, fdt),
            decode_seqs=running.sum().astype(fdt),
            kv_tokens=jnp.where(running, (slots.prompt + slots.generated - 1).astype(fdt), 0.0).sum(),
            prefill_pairs=jnp.asarray(0.0, fdt),
        )
    shape = jax.tree.map(lambda a, b: jnp.where(is_open, a, b), decode, prefill)
    new = slots._replace(status=status, sched=sched)
    first = joins & (slots.hit < 0)
    zero = jnp.int32(0)
    stats = Admission(zero, zero, jnp.where(first, slots.prompt, 0).sum())
    new = new._replace(hit=jnp.where(first, 0, new.hit))
    started = members.any()
    return Plan(
        new,
        None,
        shape,
        jnp.where(started, _duration(shape, cfg), 0.0),
        started,
        jnp.zeros_like(running),
        joins,
        jnp.where(started, rows, 0).astype(jnp.int32),
        jnp.where(started, longest, 0).astype(jnp.int32),
        stats,
    )


# Cap on a run's length, so integer conversions stay in range when the horizon is infinite.
_MAX_RUN = 2**20


class Run(NamedTuple):
    """A stretch of identical decode iterations folded into one event."""

    repeat: jax.Array  # [] int32 iterations (1: no folding)
    duration: jax.Array  # [] float, seconds of all of them
    growth: jax.Array  # [] float, duration added per iteration (KV grows by one token per row)
    energy: jax.Array  # [] float, joules of all of them


def decode_run(
    plan: Plan,
    cfg: NodeConfig,
    room: jax.Array,
    free_blocks: jax.Array,
    mode: str,
    chunks: Chunks | None,
) -> Run:
    """Fold a stretch of identical decode iterations into one event.

    When the planned iteration only decodes (no prefill, no admission, no preemption), the
    iterations after it compute the same rows, each over one more KV token per row, until the
    batch changes: a request finishes (the run ends with the finishing iteration; with padding
    the rows stay, but the finished member leaves the node, which the latency accrual counts), a
    KV block runs short (continuous), a prefix chunk would be completed (prefix caching: the plan
    of that iteration pins it, and a duplicate of a cached chunk frees blocks), or the next
    arrival comes. Step time is affine in `kv_tokens` at a fixed batch (burstgym.latency), so m
    iterations take `m d0 + b m (m - 1) / 2` and the node can jump to their end in one event;
    every iteration still happens, with the same duration up to rounding (`finish_iteration`).
    `mode` is "continuous", "padded" or "unpadded". `room` is the time left before the next
    arrival; `free_blocks` the blocks free after this plan.
    """
    new = plan.slots
    running = new.status == RUNNING
    seq_len = new.prompt + new.generated
    decoding = (new.sched == 1) & (new.computed == seq_len - 1)
    steady = (
        plan.started
        & (decoding == running).all()
        & ~plan.preempted.any()
        & ~plan.admitted.any()
        & ~(running & (new.generated == 0)).any()
        & (plan.shape.prefill_tokens == 0)
    )
    m_batch = jnp.min(jnp.where(running, new.output - new.generated, _MAX_RUN))
    rows = plan.shape.decode_seqs
    if mode == "continuous":
        # Over m iterations each sequence needs at most m // block_size + 1 new blocks.
        n = jnp.maximum(running.sum(), 1)
        m_kv = (free_blocks // n) * cfg.block_size
    else:
        m_kv = jnp.int32(_MAX_RUN)
    if chunks is not None:
        # The run must not complete a chunk (iterations 2..m): each is pinned by its iteration's plan.
        nxt = jnp.minimum(new.pin, chunks.ids.shape[1] - 1)
        nxt_id = jnp.take_along_axis(chunks.ids, nxt[:, None], axis=1)[:, 0]
        nxt_end = jnp.take_along_axis(chunks.end, nxt[:, None], axis=1)[:, 0]
        ahead = running & (new.pin < chunks.ids.shape[1]) & (nxt_id >= 0)
        m_kv = jnp.minimum(m_kv, jnp.min(jnp.where(ahead, nxt_end - new.computed - 1, _MAX_RUN)))
    d0 = plan.duration
    kv0 = plan.shape.kv_tokens
    b = jnp.maximum(cfg.speed * step_time(cfg.latency, 0.0, rows, kv0 + rows, 0.0) - d0, 0.0)

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
    m = jnp.minimum(jnp.minimum(m_batch, m_kv), m_time).astype(jnp.int32)
    use = steady & (d0 > 0) & (m >= 2)
    m = jnp.where(use, m, 1)
    mf = m.astype(d0.dtype)
    duration = jnp.where(use, total(m), d0)
    shape = plan.shape
    tokens = mf * (shape.prefill_tokens + rows)
    kv = mf * kv0 + rows * mf * (mf - 1.0) / 2.0
    energy = energy_of(cfg, duration, tokens, kv, shape.prefill_pairs, mf)
    return Run(m, duration, jnp.where(use, b, 0.0), jnp.where(plan.started, energy, 0.0))


def energy_of(cfg: NodeConfig, duration, tokens, kv_tokens, pairs, iterations) -> jax.Array:
    """Joules of `iterations` iterations of this node (burstgym.latency.power.energy_j)."""
    return energy_j(cfg.power, duration, tokens, kv_tokens, pairs, iterations)


class IterationResult(NamedTuple):
    """The effect of an iteration (or a run) ending on one node."""

    slots: Slots
    finished: jax.Array  # [S] bool, slots whose last output token came (now DONE)


def finish_iteration(
    slots: Slots, repeat: jax.Array, start: jax.Array, d0: jax.Array, growth: jax.Array, frontend: jax.Array
) -> IterationResult:
    """Apply the scheduled tokens: KV grows, a sequence that reaches its length emits a token.

    `repeat` = m > 1 ends a run of identical decode iterations (`decode_run`) that began at
    `start`: a decoding sequence emits min(m, tokens it still owes) tokens, and one that finishes
    at the k-th iteration of the run finishes at `start + k d0 + growth k (k - 1) / 2`. The client
    gets each token `frontend` seconds after it is emitted (`LatencyModel.frontend_s`).
    """
    seq_len = slots.prompt + slots.generated
    scheduled = slots.sched > 0
    emits = scheduled & (slots.computed + slots.sched == seq_len)
    k = jnp.where(emits, jnp.minimum(repeat, slots.output - slots.generated), 1)
    computed = slots.computed + jnp.where(scheduled, slots.sched + k - 1, 0)
    generated = slots.generated + jnp.where(emits, k, 0)
    kf = k.astype(d0.dtype)
    at = start + kf * d0 + growth * kf * (kf - 1.0) / 2.0
    first = emits & (slots.generated == 0)
    finished = emits & (generated >= slots.output)
    new = slots._replace(
        computed=computed,
        generated=generated,
        sched=jnp.zeros_like(slots.sched),
        status=jnp.where(finished, DONE, slots.status),
        ttft=jnp.where(first, at + frontend - slots.arrival, slots.ttft),
        e2e=jnp.where(finished, at + frontend - slots.arrival, slots.e2e),
    )
    return IterationResult(new, finished)


def release_finished(
    cache: PrefixCache, slots: Slots, finished: jax.Array, chunks: Chunks, at: jax.Array
) -> tuple[PrefixCache, Slots]:
    """Finished requests release their chunks (in admission order, each last chunk first); `at`
    holds the chunks' table positions."""
    width = chunks.ids.shape[1]
    j = jnp.arange(width)[None, :]
    rel = finished[:, None] & (j < slots.pin[:, None]) & (chunks.ids >= 0)
    rank, span = pc.release_rank(rel, slots.pin, newest_first=False)
    cache = pc.release(cache, chunks, at, rel, rank, span)
    return cache, slots._replace(pin=jnp.where(finished, 0, slots.pin))


def empty_slots(n_nodes: int, n_slots: int, fdt) -> Slots:
    """A table of free slots."""
    return Slots.full((n_nodes, n_slots), fdt)


def compact(slots: Slots) -> Slots:
    """Move the occupied (waiting or running) slots to the front, keeping their order: one scatter
    of whole slots per packed array."""
    keep = occupied(slots)
    target = jnp.where(keep, jnp.cumsum(keep) - 1, keep.shape[0])
    free = Slots.full(keep.shape, slots.floats.dtype)
    return jax.tree.map(lambda empty, x: empty.at[:, target].set(x, mode="drop"), free, slots)


def occupied(slots: Slots) -> jax.Array:
    """[..., S] bool: slots holding a waiting or running request."""
    return (slots.status == WAITING) | (slots.status == RUNNING)
