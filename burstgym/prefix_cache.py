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
    blocks: jax.Array  # int32 KV blocks chunk j occupies


def ceil_div(a: jax.Array, b: jax.Array) -> jax.Array:
    """Integer ceiling of a / b (b > 0)."""
    return (a + b - 1) // b


def slot_chunks(requests: Requests, req: jax.Array, chunk_tokens: int, block_size: jax.Array) -> Chunks:
    """The chunks of the requests held in slots `req` ([S]), NO_REQUEST slots having none."""
    n = requests.prompt.shape[0]
    held = req != NO_REQUEST
    row = jnp.clip(req, 0, n - 1)
    ids = jnp.where(held[:, None], requests.chunk_ids[row], -1)
    start = jnp.arange(ids.shape[1], dtype=jnp.int32)[None, :] * chunk_tokens
    end = jnp.minimum(start + chunk_tokens, requests.id_tokens[row][:, None])
    ids = jnp.where(end > start, ids, -1)
    blocks = jnp.where(ids >= 0, ceil_div(end - start, block_size), 0)
    return Chunks(ids, end, blocks)


def chunk_blocks(requests: Requests, block_size: jax.Array) -> jax.Array:
    """[U] KV blocks each chunk id occupies on a node with this block size."""
    return ceil_div(requests.chunk_tokens, block_size)


def present(cache: PrefixCache) -> jax.Array:
    """[U] bool: chunks the node holds (pinned, or released after its watermark)."""
    return (cache.ref > 0) | (cache.stamp > cache.watermark)


def usage(cache: PrefixCache, blocks_u: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(blocks of every chunk the node holds, blocks of the pinned ones)."""
    return jnp.where(present(cache), blocks_u, 0).sum(), jnp.where(cache.ref > 0, blocks_u, 0).sum()


def leading_hits(held: jax.Array, ids: jax.Array) -> jax.Array:
    """[...] length of the leading run of chunks in `ids` ([..., B]) that the node holds."""
    hit = (ids >= 0) & held[jnp.maximum(ids, 0)]
    stop = jnp.concatenate([~hit, jnp.ones(hit.shape[:-1] + (1,), bool)], axis=-1)
    return jnp.argmax(stop, axis=-1).astype(jnp.int32)


def chunk_end(chunks_end: jax.Array, count: jax.Array) -> jax.Array:
    """Token end of the first `count` chunks (0 when count is 0); `chunks_end` is [..., B]."""
    idx = jnp.maximum(count - 1, 0)[..., None]
    return jnp.where(count > 0, jnp.take_along_axis(chunks_end, idx, axis=-1)[..., 0], 0)


def covered(chunks: Chunks, tokens: jax.Array) -> jax.Array:
    """[S] chunks wholly inside the first `tokens` tokens of each slot's sequence."""
    return ((chunks.ids >= 0) & (chunks.end <= tokens[:, None])).sum(axis=1).astype(jnp.int32)


def add_refs(cache: PrefixCache, ids: jax.Array, mask: jax.Array) -> PrefixCache:
    """Pin the chunks `ids[mask]` once each pair (a hit, or a chunk a request has computed)."""
    u = cache.ref.shape[0]
    return cache._replace(ref=cache.ref.at[jnp.where(mask, ids, u)].add(1, mode="drop"))


def release(cache: PrefixCache, ids: jax.Array, mask: jax.Array, order: jax.Array) -> PrefixCache:
    """Unpin the pairs `ids[mask]`; a chunk no longer pinned gets a stamp by `order`.

    `order` ([S, B], distinct values in [0, S * B)) ranks the releases of this event: the chunk
    freed by the latest-ranked release is the most recently used. Stamps of later events are
    larger than every stamp of earlier ones.
    """
    u = cache.ref.shape[0]
    target = jnp.where(mask, ids, u)
    ref = cache.ref.at[target].add(-1, mode="drop")
    last = jnp.full(u, -1, jnp.int32).at[target].max(order.astype(jnp.int32), mode="drop")
    freed = (ref == 0) & (last >= 0)
    stamp = jnp.where(freed, cache.counter + 1 + last, cache.stamp)
    return PrefixCache(ref, stamp, cache.watermark, cache.counter + jnp.int32(ids.size))


def evict(cache: PrefixCache, deficit: jax.Array, blocks_u: jax.Array) -> PrefixCache:
    """Evict least recently released chunks until `deficit` blocks are free (or none is left)."""

    def candidates(c: PrefixCache) -> jax.Array:
        return (c.ref == 0) & (c.stamp > c.watermark)

    def cond(carry: tuple[PrefixCache, jax.Array]) -> jax.Array:
        c, need = carry
        return (need > 0) & candidates(c).any()

    def body(carry: tuple[PrefixCache, jax.Array]) -> tuple[PrefixCache, jax.Array]:
        c, need = carry
        cand = candidates(c)
        oldest = jnp.min(jnp.where(cand, c.stamp, _NEVER))
        freed = jnp.where(cand & (c.stamp == oldest), blocks_u, 0).sum()
        return c._replace(watermark=oldest), need - freed

    return jax.lax.while_loop(cond, body, (cache, deficit))[0]
