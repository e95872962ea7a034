"""A router's own prefix index: what it routed, not what the engines hold.

Real prefix-aware routers do not see the engines' caches. SGLang's and vllm-router's cache-aware
policies keep an approximate radix tree of the prompts they routed, inserted when they route (a
request in flight counts at once) and evicted by size; llm-d's approximate prefix producer and
AIBrix's prefix indexer hash blocks of the prompts they routed into LRU indexes; the vLLM
production stack keeps a trie that is never evicted. Dynamo and llm-d's precise profile follow the
engines' KV events, which is the engines' own cache (`RouterView.hit_tokens`).

`RouterIndex` restates those indexes over burstgym's prefix chunks (`RouterView.chunk_ids`:
equal ids mean an equal prefix), on `burstgym.chunk_table` tables of fixed capacity, one per node
or one shared by all nodes with a bit per node (AIBrix's block -> pods map):
- matching: a node holds the leading run of the request's chunks present in its index (shared:
  with the node's bit set), `chunk_end` of the last one in tokens;
- recording: when the rule routes a request to a node, every chunk of its prompt is inserted there
  (or the node's bit set) and stamped, the leading chunks newest (so a request's tail is evicted
  first, as a radix tree evicts leaves first), with the clock as the chunk's last use;
- eviction: entries older than `ttl_s`, then least recently used entries while the index holds
  more tokens than its limit (a node's KV tokens, for llm-d's autotuned LRU; a fixed budget) or
  more chunks than the table's capacity.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import jax
import jax.numpy as jnp

from burstgym import chunk_table as ct
from burstgym.observation import RouterView

_FOREVER = float("inf")


@dataclass(frozen=True)
class IndexSpec:
    """How a router's index is kept.

    :param capacity: chunks a table holds (per node; shared: in all), the table's fixed size.
    :param shared: one table for every node, with a bit per node (AIBrix).
    :param kv_limited: evict least recently used chunks while a node's index holds more tokens
        than its KV cache (llm-d's autotuned LRU capacity per endpoint).
    :param token_limit: evict least recently used chunks while the index holds more tokens.
    :param ttl_s: evict chunks not used for this many seconds.
    """

    capacity: int = 8192
    shared: bool = False
    kv_limited: bool = False
    token_limit: float = _FOREVER
    ttl_s: float = _FOREVER


class RouterIndex(NamedTuple):
    """A router's index: stacked tables ([T] leading axis, T = nodes or 1 when shared); the
    payload holds each chunk's tokens, last use (seconds) and holders (node bits, shared)."""

    tables: ct.ChunkTable


def empty(spec: IndexSpec, n_nodes: int) -> RouterIndex:
    """An empty index for `n_nodes` nodes."""
    if spec.shared and n_nodes > 31:
        raise ValueError(f"a shared index keeps a bit per node: at most 31 nodes, got {n_nodes}")
    positions = ct.positions_for(spec.capacity)
    payload = (jnp.int32(0), jnp.float32(0), jnp.int32(0))  # tokens, last use, holders
    one = ct.empty(positions, payload)
    t = 1 if spec.shared else n_nodes
    return RouterIndex(jax.tree.map(lambda x: jnp.broadcast_to(x, (t,) + x.shape), one))


def _chunk_tokens(view: RouterView) -> jax.Array:
    """[B] tokens of each prompt chunk (0 past the last)."""
    end = view.chunk_end
    prev = jnp.concatenate([jnp.zeros(1, end.dtype), end[:-1]])
    return jnp.where(view.chunk_ids >= 0, end - prev, 0)


def _is_shared(index: RouterIndex, n_nodes: int) -> bool:
    return index.tables.key.shape[0] != n_nodes


def _live(t: ct.ChunkTable, spec: IndexSpec, now: jax.Array) -> jax.Array:
    """[H] bool: entries present and used within `ttl_s`."""
    return ct.present(t) & (t.payload[1] >= now - spec.ttl_s)


def _node_bits(holders: jax.Array, n_nodes: int) -> jax.Array:
    """[N, ...] bool: node n's bit in each holders word."""
    return (
        (holders[None] >> jnp.arange(n_nodes, dtype=jnp.int32).reshape((n_nodes,) + (1,) * holders.ndim)) & 1
    ) == 1


def matched(index: RouterIndex, spec: IndexSpec, view: RouterView) -> jax.Array:
    """[N] leading prompt tokens of the arriving request each node's index holds."""
    n = view.running.shape[0]
    ids = view.chunk_ids
    if ids.shape[0] == 0:
        return jnp.zeros(n, view.prompt.dtype)
    now = jnp.asarray(view.clock, jnp.float32)

    def one(t):
        pos = ct.lookup(t, ids)
        safe = jnp.maximum(pos, 0)
        fresh = ct.present_at(t, pos) & (t.payload[1][safe] >= now - spec.ttl_s)
        return fresh, t.payload[2][safe]

    here, holders = jax.vmap(one)(index.tables)
    if _is_shared(index, n):
        held = here[0][None, :] & _node_bits(holders[0], n)
    else:
        held = here
    run = jnp.cumprod(held & (ids >= 0), axis=1).sum(axis=1)  # leading chunks held
    end = jnp.concatenate([jnp.zeros(1, jnp.int32), view.chunk_end])
    return jnp.minimum(end[run], view.prompt).astype(view.prompt.dtype)


def held_tokens(index: RouterIndex, spec: IndexSpec, view: RouterView) -> jax.Array:
    """[N] tokens each node's index holds (its "tree size")."""
    n = view.running.shape[0]
    now = jnp.asarray(view.clock, jnp.float32)
    if not _is_shared(index, n):
        count = jax.vmap(lambda t: jnp.where(_live(t, spec, now), t.payload[0], 0).sum())(index.tables)
        return count.astype(view.prompt.dtype)
    t = jax.tree.map(lambda x: x[0], index.tables)
    mine = _live(t, spec, now)[None, :] & _node_bits(t.payload[2], n)
    return jnp.where(mine, t.payload[0][None, :], 0).sum(axis=1).astype(view.prompt.dtype)


def _evict(t: ct.ChunkTable, spec: IndexSpec, limit: jax.Array, now: jax.Array) -> ct.ChunkTable:
    """Drop entries unused for `ttl_s`, then the least recently used while over `limit` tokens
    or over the table's capacity."""
    if spec.ttl_s != _FOREVER:
        old = ct.present(t) & (t.payload[1] < now - spec.ttl_s)
        t = t._replace(watermark=jnp.maximum(t.watermark, jnp.max(jnp.where(old, t.stamp, 0))))

    def over(t):
        live = ct.present(t)
        held = jnp.where(live, t.payload[0], 0).sum()
        return ((held > limit) | (live.sum() > spec.capacity)) & live.any()

    return jax.lax.while_loop(over, lambda t: ct.evict_oldest(t)[0], t)


def record(index: RouterIndex, spec: IndexSpec, view: RouterView, node: jax.Array) -> RouterIndex:
    """The index after routing the arriving request to `node`."""
    ids = view.chunk_ids
    if ids.shape[0] == 0:
        return index
    n = view.running.shape[0]
    which = 0 if _is_shared(index, n) else node
    t = jax.tree.map(lambda x: x[which], index.tables)
    valid = ids >= 0
    now = jnp.asarray(view.clock, jnp.float32)
    before = ct.present_at(t, ct.lookup(t, ids))  # an entry that was evicted keeps no holders
    payload = (
        _chunk_tokens(view).astype(jnp.int32),
        jnp.full(ids.shape, now),
        jnp.zeros(ids.shape, jnp.int32),
    )
    t, pos, _ = ct.insert(t, ids, valid, payload)
    b = ids.shape[0]
    t, _ = ct.latest(t, pos, valid, (b - 1 - jnp.arange(b)).astype(jnp.int32))  # leading chunks newest
    at = jnp.where(valid & (pos >= 0), pos, t.key.shape[0])
    safe = jnp.maximum(pos, 0)
    bits = jnp.where(before, t.payload[2][safe], 0) | jnp.left_shift(jnp.int32(1), node)
    tokens, last, holders = t.payload
    t = t._replace(payload=(tokens, last.at[at].set(now, mode="drop"), holders.at[at].set(bits, mode="drop")))
    limit = view.kv_tokens[node].astype(jnp.float32) if spec.kv_limited else jnp.float32(spec.token_limit)
    t = _evict(t, spec, limit, now)
    return RouterIndex(jax.tree.map(lambda all_, one: all_.at[which].set(one), index.tables, t))
