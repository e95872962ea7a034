"""Per-node prefix cache with the semantics of vLLM's automatic prefix caching (docs/semantics.md).

A request's sequence is cut into chunks with ids (`burstgym.workload`): equal ids mean equal
tokens and an equal prefix before them, as vLLM's chained block hashes do
(vllm v0.11.0, vllm/v1/core/kv_cache_utils.py `hash_block_tokens`). On one node:

- a chunk is *pinned* while running requests hold it (`ref` counts them, as vLLM's block
  `ref_cnt`); a chunk no running request holds stays cached until evicted;
- releases are stamped in order (a finished request's chunks last-first, as vLLM returns a
  request's blocks to the tail of its free queue in reverse order, vllm/v1/core/block_pool.py
  `free_blocks`), and eviction takes the least recently released chunk first: the free queue's
  head. Since evictions always take the oldest stamps, the evicted set is "stamp <= watermark",
  and evicting is raising one integer: no sorting, no per-chunk flags;
- cached and pinned chunks share the node's KV blocks with the requests' private blocks, and
  together never exceed them.

The node's totals (blocks cached, blocks pinned, tokens cached) are updated by each change from
the chunks it touches, so looking up, pinning and releasing need no pass over the U chunks of
the episode; eviction scans them once per evicted release stamp. When one change touches a chunk
through several (request, chunk) pairs (requests sharing a prefix), the totals count it once: the
pairs scatter-max this change's ranks into the chunks' stamps (a pinned chunk's stamp means
nothing until its release stamps it anew) and the pair whose rank stayed counts.

Functions act on one node (arrays [U] and [S, B]); the scheduler calls them, the cluster vmaps.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from burstgym.types import NO_REQUEST, PrefixCache
from burstgym.workload import Requests

_NEVER = jnp.iinfo(jnp.int32).max


class Chunks(NamedTuple):
    """The prefix chunks of the requests in one node's slots; all fields [S, B]."""

    ids: jax.Array  # int32 chunk id, -1 where the request has no chunk j (or the slot is empty)
    end: jax.Array  # int32 token end of chunk j within the request's sequence
    blocks: jax.Array  # int32 KV blocks chunk j occupies (0 where no chunk)
    tokens: jax.Array  # int32 tokens of chunk j (0 where no chunk)


def ceil_div(a: jax.Array, b: jax.Array) -> jax.Array:
    """Integer ceiling of a / b (b > 0)."""
    return (a + b - 1) // b


def slot_chunks(requests: Requests, req: jax.Array, chunk_tokens: int, cache: PrefixCache) -> Chunks:
    """The chunks of the requests held in slots `req` ([S]), NO_REQUEST slots having none (their
    sizes read from the node's cache, which holds every chunk id's)."""
    n = requests.prompt.shape[0]
    held = req != NO_REQUEST
    row = jnp.clip(req, 0, n - 1)
    ids = jnp.where(held[:, None], requests.chunk_ids[row], -1)
    start = jnp.arange(ids.shape[1], dtype=jnp.int32)[None, :] * chunk_tokens
    end = jnp.minimum(start + chunk_tokens, requests.id_tokens[row][:, None])
    ids = jnp.where(end > start, ids, -1)
    safe = jnp.maximum(ids, 0)
    blocks, tokens = (jnp.where(ids >= 0, x[safe], 0) for x in (cache.blocks, cache.tokens))
    return Chunks(ids, end, blocks, tokens)


def empty_cache(requests: Requests, block_size: jax.Array) -> PrefixCache:
    """An empty cache over the chunk ids of `requests`, on a node with this block size."""
    tokens = requests.chunk_tokens.astype(jnp.int32)
    zero, z = jnp.zeros(tokens.shape, jnp.int32), jnp.int32(0)
    return PrefixCache(
        ref=zero,
        stamp=zero,
        blocks=ceil_div(tokens, block_size).astype(jnp.int32),
        tokens=tokens,
        watermark=z,
        counter=z,
        cached=z,
        pinned=z,
        cached_tokens=z,
    )


def present(cache: PrefixCache) -> jax.Array:
    """[U] bool: chunks the node holds (pinned, or released after its watermark); scans every chunk."""
    return (cache.ref > 0) | (cache.stamp > cache.watermark)


def present_at(cache: PrefixCache, ids: jax.Array) -> jax.Array:
    """[...] bool: whether the node holds each chunk of `ids` (-1: no chunk, never held)."""
    safe = jnp.maximum(ids, 0)
    return (ids >= 0) & ((cache.ref[safe] > 0) | (cache.stamp[safe] > cache.watermark))


def usage(cache: PrefixCache) -> tuple[jax.Array, jax.Array]:
    """(blocks of every chunk the node holds, blocks of the pinned ones), as kept by every change."""
    return cache.cached, cache.pinned


def scan_usage(cache: PrefixCache) -> jax.Array:
    """[3] (blocks held, blocks pinned, tokens held) recounted from the chunks: what the kept totals
    `cached`, `pinned` and `cached_tokens` must equal (the tests check it at every step)."""
    held = present(cache)
    pinned = cache.ref > 0
    return jnp.stack([_total(held, cache.blocks), _total(pinned, cache.blocks), _total(held, cache.tokens)])


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


def _latest(cache: PrefixCache, ids: jax.Array, mask: jax.Array, rank: jax.Array):
    """Write `counter + 1 + rank` into the stamps of the chunks `ids[mask]` (scatter-max) and say
    which pair's value stayed: for each chunk, its pair of highest `rank` (distinct values in
    [0, ids.size)). Every stamp written before is at most `counter`, so only this change's pairs
    compete. Returns (stamps, winners, counter after this change)."""
    u = cache.ref.shape[0]
    value = cache.counter + 1 + rank.astype(jnp.int32)
    stamp = cache.stamp.at[jnp.where(mask, ids, u)].max(value, mode="drop")
    won = mask & (stamp[jnp.maximum(ids, 0)] == value)
    return stamp, won, cache.counter + jnp.where(mask.any(), jnp.int32(ids.size), 0)


def first_pinners(cache: PrefixCache, ids: jax.Array, pinned: jax.Array) -> tuple[PrefixCache, jax.Array]:
    """For each chunk pinned through the pairs `ids[pinned]` ([S, B], slots in table order), its
    pair in the earliest slot: True at exactly one pair per chunk.

    The stamp of a pinned chunk means nothing until the chunk is released (which stamps it anew),
    so it serves as the scratch that picks the pairs."""
    n_slots, width = ids.shape
    rank = (n_slots - 1 - jnp.arange(n_slots))[:, None] * width + jnp.arange(width)[None, :]
    stamp, first, counter = _latest(cache, ids, pinned & (ids >= 0), rank)
    return cache._replace(stamp=stamp, counter=counter), first


def add_refs(cache: PrefixCache, chunks: Chunks, mask: jax.Array) -> PrefixCache:
    """Pin the chunks `chunks.ids[mask]` once each pair (a hit, or a chunk a request has computed).

    The node's totals count each newly pinned chunk once however many pairs pin it; its stamp,
    meaningless while it is pinned, is the scratch that picks one pair (`_latest`).
    """
    ids = chunks.ids
    mask = mask & (ids >= 0)
    u = cache.ref.shape[0]
    was_pinned = cache.ref[jnp.maximum(ids, 0)] > 0
    was_held = present_at(cache, ids)
    ref = cache.ref.at[jnp.where(mask, ids, u)].add(1, mode="drop")
    newly = mask & ~was_pinned
    stamp, once, counter = _latest(cache, ids, newly, jnp.arange(ids.size).reshape(ids.shape))
    fresh = once & ~was_held
    return cache._replace(
        ref=ref,
        stamp=stamp,
        counter=counter,
        pinned=cache.pinned + _total(once, chunks.blocks),
        cached=cache.cached + _total(fresh, chunks.blocks),
        cached_tokens=cache.cached_tokens + _total(fresh, chunks.tokens),
    )


def release(cache: PrefixCache, chunks: Chunks, mask: jax.Array, order: jax.Array) -> PrefixCache:
    """Unpin the pairs `chunks.ids[mask]`; a chunk no longer pinned gets a stamp by `order`.

    `order` ([S, B], distinct values in [0, S * B)) ranks the releases of this event: the chunk
    freed by the latest-ranked release is the most recently used. Stamps of later events are
    larger than every stamp of earlier ones.
    """
    ids = chunks.ids
    mask = mask & (ids >= 0)
    u = cache.ref.shape[0]
    ref = cache.ref.at[jnp.where(mask, ids, u)].add(-1, mode="drop")
    freed = mask & (ref[jnp.maximum(ids, 0)] == 0)
    stamp, last, counter = _latest(cache, ids, freed, order)  # each freed chunk's latest release
    return cache._replace(
        ref=ref,
        stamp=stamp,
        counter=counter,
        pinned=cache.pinned - _total(last, chunks.blocks),
    )


def evict(cache: PrefixCache, deficit: jax.Array) -> PrefixCache:
    """Evict least recently released chunks until `deficit` blocks are free (or none is left)."""

    def cond(carry: tuple[PrefixCache, jax.Array]) -> jax.Array:
        c, need = carry
        return (need > 0) & (c.cached > c.pinned)  # some released chunk is still held

    def body(carry: tuple[PrefixCache, jax.Array]) -> tuple[PrefixCache, jax.Array]:
        c, need = carry
        candidate = (c.ref == 0) & (c.stamp > c.watermark)
        oldest = jnp.min(jnp.where(candidate, c.stamp, _NEVER))
        gone = candidate & (c.stamp == oldest)
        freed = _total(gone, c.blocks)
        tokens = c.cached_tokens - _total(gone, c.tokens)
        c = c._replace(watermark=oldest, cached=c.cached - freed, cached_tokens=tokens)
        return c, need - freed

    return jax.lax.while_loop(cond, body, (cache, deficit))[0]
