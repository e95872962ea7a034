"""Per-node prefix cache with the semantics of vLLM's automatic prefix caching (docs/semantics.md).

A request's sequence is cut into chunks with ids (`burstgym.workload`): equal ids mean equal
tokens and an equal prefix before them, as vLLM's chained block hashes do
(vllm v0.11.0, vllm/v1/core/kv_cache_utils.py `hash_block_tokens`). On one node:

- a chunk is *pinned* while running requests hold it (its entry's `ref` counts them, as vLLM's
  block `ref_cnt`); a chunk no running request holds stays cached until evicted;
- releases are stamped in order (a finished request's chunks last-first, as vLLM returns a
  request's blocks to the tail of its free queue in reverse order, vllm/v1/core/block_pool.py
  `free_blocks`), and eviction takes the least recently released chunk first: the free queue's
  head (`chunk_table.evict_oldest`, which raises a watermark instead of sorting);
- cached and pinned chunks share the node's KV blocks with the requests' private blocks, and
  together never exceed them; and the node holds at most `EnvConfig.cache_entries` chunks: past
  that, least recently released chunks are evicted too (docs/semantics.md, "Prefix cache").

Storage: the chunks a node holds live in a `chunk_table.ChunkTable` of fixed size
(`positions(cfg)`), keyed by chunk id, each entry with its tokens. Its size follows the entries a
node can hold, never the episode's length or the trace's distinct ids (`entry_bound`).

The node's totals (blocks cached, blocks pinned, tokens cached, chunks held) are updated by each
change from the chunks it touches, so lookups, pins and releases touch only their chunks. When
one change touches a chunk through several (request, chunk) pairs (requests sharing a prefix),
the totals count it once: the pairs stamp the entry (`chunk_table.latest`) and the pair whose
stamp stayed counts (a pinned chunk's stamp means nothing until its release stamps it anew).

Functions act on one node (a table of H positions, pairs [S, B]); the scheduler calls them, the
cluster vmaps them over nodes.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from burstgym import chunk_table as ct
from burstgym.types import NO_REQUEST, EnvConfig, PrefixCache
from burstgym.workload import Requests


class Chunks(NamedTuple):
    """The prefix chunks of the requests in one node's slots; all fields [S, B]."""

    ids: jax.Array  # int32 chunk id, -1 where the request has no chunk j (or the slot is empty)
    end: jax.Array  # int32 token end of chunk j within the request's sequence
    blocks: jax.Array  # int32 KV blocks chunk j occupies (0 where no chunk)
    tokens: jax.Array  # int32 tokens of chunk j (0 where no chunk)


def ceil_div(a: jax.Array, b: jax.Array) -> jax.Array:
    """Integer ceiling of a / b (b > 0)."""
    return (a + b - 1) // b


def entry_bound(kv_blocks: int, block_size: int, chunk_tokens: int, max_num_seqs: int, whole: bool) -> int:
    """Chunks a node can hold at once, the size of its cache (`EnvConfig.cache_entries`).

    Held chunks occupy KV blocks (pinned and cached chunks together never exceed the node's
    blocks), a whole chunk `chunk_tokens / block_size` of them, so a node holds at most
    `kv_blocks // (chunk_tokens / block_size)` whole chunks: with `whole` chunks only (generated
    prompts cut at whole chunks) the entry limit can never bind before the KV blocks do. A trace's
    last chunk of a prompt may be shorter (one block at least); a running request pins at most one
    such chunk, so the bound adds `max_num_seqs` and the chunks pinned never exceed it; cached
    short chunks beyond it are evicted least recently released first (docs/semantics.md).
    """
    whole_chunks = kv_blocks // max(chunk_tokens // block_size, 1)
    return max(whole_chunks + (0 if whole else max_num_seqs), 1)


def positions(cfg: EnvConfig) -> int:
    """Positions of each node's table for `cfg.cache_entries` chunks (`chunk_table.positions_for`)."""
    return ct.positions_for(cfg.cache_entries)


def empty_cache(n_positions: int) -> PrefixCache:
    """One node's empty cache over a table of `n_positions` positions."""
    z = jnp.int32(0)
    return PrefixCache(
        table=ct.empty(n_positions, jnp.int32(0)),
        cached=z,
        pinned=z,
        cached_tokens=z,
        entries=z,
        full=jnp.bool_(False),
    )


def tidy(cache: PrefixCache) -> PrefixCache:
    """The caches (any leading axes: nodes, clusters) with their tables rebuilt when any of them
    has more than `chunk_table.MAX_LOAD` of its positions used: one `lax.cond` between steps,
    outside the per-node code, so that probes stay short (`chunk_table.rebuild`)."""
    t = cache.table
    rebuild = ct.rebuild
    for _ in range(t.key.ndim - 1):
        rebuild = jax.vmap(rebuild)
    table = jax.lax.cond(ct.needs_rebuild(t).any(), rebuild, lambda x: x, t)
    return cache._replace(table=table)


def slot_chunks(requests: Requests, req: jax.Array, chunk_tokens: int, block_size: jax.Array) -> Chunks:
    """The chunks of the requests held in slots `req` ([S]), NO_REQUEST slots having none."""
    n = requests.prompt.shape[0]
    held = req != NO_REQUEST
    row = jnp.clip(req, 0, n - 1)
    ids = jnp.where(held[:, None], requests.chunk_ids[row], -1)
    start = jnp.arange(ids.shape[1], dtype=jnp.int32)[None, :] * chunk_tokens
    end = jnp.minimum(start + chunk_tokens, requests.id_tokens[row][:, None])
    ids = jnp.where(end > start, ids, -1)
    tokens = jnp.where(ids >= 0, end - start, 0).astype(jnp.int32)
    # Every chunk holds `chunk_tokens` tokens but a request's last, which may hold fewer: one
    # division per node and one per slot instead of one per (slot, chunk) pair (integer division
    # has no vector instruction on CPUs; docs/performance.md, "Where the time of a step goes").
    full = ceil_div(chunk_tokens, block_size)
    last = ceil_div(jnp.where(tokens < chunk_tokens, tokens, 0).max(axis=-1), block_size)
    blocks = jnp.where(tokens == chunk_tokens, full, last[:, None])
    return Chunks(ids, end, jnp.where(tokens > 0, blocks, 0).astype(jnp.int32), tokens)


def locate(cache: PrefixCache, ids: jax.Array) -> jax.Array:
    """[...] table positions of the chunks `ids` (-1: none, or not in the table). A held chunk's
    position stays valid until `tidy` rebuilds the table (between steps); one that is not held
    may be given to another chunk by `add_refs`."""
    return ct.lookup(cache.table, ids)


def held_at(cache: PrefixCache, pos: jax.Array) -> jax.Array:
    """[...] bool: whether the node holds the chunk at each table position (-1: no)."""
    return ct.present_at(cache.table, pos)


def present_at(cache: PrefixCache, ids: jax.Array) -> jax.Array:
    """[...] bool: whether the node holds each chunk of `ids` (-1: no chunk, never held)."""
    return held_at(cache, locate(cache, ids))


def usage(cache: PrefixCache) -> tuple[jax.Array, jax.Array]:
    """(blocks of every chunk the node holds, blocks of the pinned ones), as kept by every change."""
    return cache.cached, cache.pinned


def scan_usage(cache: PrefixCache, block_size: jax.Array) -> jax.Array:
    """[4] (blocks held, blocks pinned, tokens held, chunks held) recounted from the table: what the
    kept totals `cached`, `pinned`, `cached_tokens` and `entries` must equal (the tests check it
    at every step)."""
    t = cache.table
    held = ct.present(t)
    blocks = ceil_div(t.payload, block_size)
    pinned = held & (t.ref > 0)
    return jnp.stack([_total(held, blocks), _total(pinned, blocks), _total(held, t.payload), held.sum()])


def leading_run(hit: jax.Array) -> jax.Array:
    """[...] length of the leading run of True in `hit` ([..., B])."""
    stop = jnp.concatenate([~hit, jnp.ones(hit.shape[:-1] + (1,), bool)], axis=-1)
    return jnp.argmax(stop, axis=-1).astype(jnp.int32)


def chunk_end(chunks_end: jax.Array, count: jax.Array) -> jax.Array:
    """Token end of the first `count` chunks (0 when count is 0); `chunks_end` is [..., B]."""
    idx = jnp.maximum(count - 1, 0)[..., None]
    return jnp.where(count > 0, jnp.take_along_axis(chunks_end, idx, axis=-1)[..., 0], 0)


def covered(chunks: Chunks, tokens: jax.Array) -> jax.Array:
    """[S] chunks wholly inside the first `tokens` tokens of each slot's sequence."""
    return ((chunks.ids >= 0) & (chunks.end <= tokens[:, None])).sum(axis=1).astype(jnp.int32)


def _total(mask: jax.Array, x: jax.Array) -> jax.Array:
    """int32 sum of `x` where `mask` (int32 under x64 too, as the totals it updates)."""
    return jnp.where(mask, x, 0).sum(dtype=jnp.int32)


def first_pinners(cache: PrefixCache, pos: jax.Array, pinned: jax.Array) -> tuple[PrefixCache, jax.Array]:
    """For each chunk pinned through the pairs `pos[pinned]` ([S, B], slots in table order), its
    pair in the earliest slot: True at exactly one pair per chunk.

    The stamp of a pinned chunk means nothing until the chunk is released (which stamps it anew),
    so it serves as the scratch that picks the pairs."""
    n_slots, width = pos.shape
    rank = (n_slots - 1 - jnp.arange(n_slots))[:, None] * width + jnp.arange(width)[None, :]
    table, first = ct.latest(cache.table, pos, pinned, rank, span=0)
    return cache._replace(table=table), first


def add_refs(cache: PrefixCache, chunks: Chunks, mask: jax.Array) -> tuple[PrefixCache, jax.Array]:
    """Pin the chunks `chunks.ids[mask]` once each pair (a hit, or a chunk a request has computed);
    a chunk the node does not hold gets an entry. Returns (cache, [S, B] table positions of the
    pinned pairs, -1 elsewhere)."""
    mask = mask & (chunks.ids >= 0)
    table, pos, overflow = ct.insert(cache.table, chunks.ids, mask, chunks.tokens)
    cache = pin_at(cache._replace(table=table, full=cache.full | overflow), chunks, pos, mask)
    return cache, jnp.where(mask, pos, -1)


def pin_at(cache: PrefixCache, chunks: Chunks, pos: jax.Array, mask: jax.Array) -> PrefixCache:
    """Pin the pairs `mask` whose chunks are in the table at `pos` (`chunk_table.insert`). The
    node's totals count each newly pinned chunk once however many pairs pin it."""
    mask = mask & (pos >= 0)
    table = cache.table
    was_pinned = table.ref[jnp.maximum(pos, 0)] > 0
    was_held = ct.present_at(table, pos)
    table = ct.pin(table, pos, mask)
    newly = mask & ~was_pinned
    table, once = ct.latest(table, pos, newly, jnp.arange(pos.size).reshape(pos.shape), span=0)
    fresh = once & ~was_held
    return cache._replace(
        table=table,
        pinned=cache.pinned + _total(once, chunks.blocks),
        cached=cache.cached + _total(fresh, chunks.blocks),
        cached_tokens=cache.cached_tokens + _total(fresh, chunks.tokens),
        entries=cache.entries + fresh.sum(dtype=jnp.int32),
    )


def release(
    cache: PrefixCache, chunks: Chunks, pos: jax.Array, mask: jax.Array, rank: jax.Array, span: jax.Array
) -> PrefixCache:
    """Unpin the pairs `mask` (at positions `pos`); a chunk no longer pinned gets a stamp by `rank`.

    `rank` ([S, B], distinct values in [0, span) over the masked pairs) orders the releases of
    this event: the chunk freed by the latest-ranked release is the most recently used. Stamps
    of later events are larger than every stamp of earlier ones.
    """
    mask = mask & (chunks.ids >= 0)
    table = ct.unpin(cache.table, pos, mask)
    freed = mask & (table.ref[jnp.maximum(pos, 0)] == 0)
    table, last = ct.latest(table, pos, freed, rank, span=span)  # each freed chunk's latest release
    return cache._replace(table=table, pinned=cache.pinned - _total(last, chunks.blocks))


def release_rank(mask: jax.Array, pin: jax.Array, newest_first: bool) -> tuple[jax.Array, jax.Array]:
    """(rank, span) of releasing each masked slot's leading `pin` chunks, each request its last
    chunk first, requests in table order (`newest_first`: from the last slot): the order vLLM
    returns blocks to its free queue (docs/semantics.md, "Release order")."""
    width = mask.shape[1]
    count = jnp.where(mask.any(axis=1), pin, 0)
    before = jnp.cumsum(count) - count
    if newest_first:
        before = count.sum() - before - count
    j = jnp.arange(width)[None, :]
    return (before[:, None] + count[:, None] - 1 - j).astype(jnp.int32), count.sum(dtype=jnp.int32)


def evict(cache: PrefixCache, deficit: jax.Array, block_size: jax.Array, max_entries: int) -> PrefixCache:
    """Evict least recently released chunks until `deficit` blocks are free and at most
    `max_entries` chunks are held (or no released chunk is left); a node left holding more than
    `max_entries` chunks, all pinned, is `full` (an error).

    The loop carries the watermark and the totals only, reading the table: one chunk per stamp,
    so each pass evicts one chunk (stamps are distinct)."""
    t = cache.table

    class _Evicting(NamedTuple):
        watermark: jax.Array
        need: jax.Array
        cached: jax.Array
        tokens: jax.Array
        entries: jax.Array
        found: jax.Array

    def cond(c: _Evicting) -> jax.Array:
        # some released chunk is still held (a chunk occupies at least one block; `found` stops
        # the loop should the totals ever disagree with the table)
        return ((c.need > 0) | (c.entries > max_entries)) & (c.cached > cache.pinned) & c.found

    def body(c: _Evicting) -> _Evicting:
        stamp, gone = ct.oldest(t, c.watermark)
        found = gone.any()
        tokens = _total(gone, t.payload)
        freed = ceil_div(tokens, block_size)
        entries = c.entries - found.astype(jnp.int32)
        watermark = jnp.where(found, stamp, c.watermark)
        return _Evicting(watermark, c.need - freed, c.cached - freed, c.tokens - tokens, entries, found)

    init = _Evicting(t.watermark, deficit, cache.cached, cache.cached_tokens, cache.entries, jnp.bool_(True))
    c = jax.lax.while_loop(cond, body, init)
    return cache._replace(
        table=t._replace(watermark=c.watermark),
        cached=c.cached,
        cached_tokens=c.tokens,
        entries=c.entries,
        full=cache.full | (c.entries > max_entries),
    )
