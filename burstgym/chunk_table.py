"""A fixed-capacity table of chunk ids with reference counts, LRU stamps and a payload.

One table per node (functions act on one table; callers vmap them over nodes). It is the store
behind the engine's per-node prefix cache (`burstgym.prefix_cache`) and fits any per-node index
of block or chunk ids that must not grow with the trace: its size is fixed when it is made, from
how many entries can be present at once, never from how many distinct ids a trace holds.

Entries. A position holds an id (`key`, a non-negative int32; `EMPTY` where no id was put since
the table was made or rebuilt), its pins (`ref`, as a block's reference count in vLLM's block
pool), its stamp and a payload (a pytree of per-entry arrays, e.g. the chunk's tokens). An entry
is *present* while it is pinned (`ref > 0`) or while its stamp is above the table's `watermark`:

- stamps are handed out in increasing order (`counter` is the last one), so "least recently
  released / used first" is "smallest stamp first", and evicting the oldest entry is raising the
  watermark to its stamp (`evict_oldest`): no sorting and no per-entry flags;
- an entry that is not present keeps its id until a new id reuses its position; a lookup may find
  it, and `present` says it is gone.

Layout: open addressing with linear probing over `H` positions (a power of two) from a
multiplicative hash of the id (Knuth, TAOCP vol. 3, 6.4). A lookup probes from the id's home
position until it meets the id or an `EMPTY` position; an insertion puts a new id on the first
position along that path whose entry is not present (or `EMPTY`). Positions holding an id that
is no longer present count as used until a rebuild drops them: `insert` rebuilds the table (every
present entry, and the ids it was asked to insert, hashed again into fresh positions) when more
than `MAX_LOAD` of the positions are used, so probe paths stay short and always end at an `EMPTY`
position. Entries move only in a rebuild: positions read before an `insert` must be looked up
again after it; `pin`, `unpin`, `latest` and `evict_oldest` never move an entry.

Sizing: `positions_for(capacity)` gives `H` for at most `capacity` present entries after every
complete change, plus as many just inserted before the caller evicts (2 x capacity at most), at
a load below `MAX_LOAD`. A table never drops an entry on its own: `insert` reports the ids it
could not place (`overflow`), which with `positions_for` sizing and present entries within
`capacity` cannot happen.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

EMPTY = -1  # key of a position that holds no id
MAX_LOAD = 5 / 8  # fraction of used positions above which `insert` rebuilds the table
_NEVER = jnp.iinfo(jnp.int32).max
_GOLDEN = 0x9E3779B1  # 2^32 / golden ratio: Fibonacci hashing's multiplier


class ChunkTable(NamedTuple):
    """One node's table of ids over `H` positions (every per-entry field [H])."""

    key: jax.Array  # [H] int32, the id at each position, EMPTY where none
    ref: jax.Array  # [H] int32, pins (holders) of the entry
    stamp: jax.Array  # [H] int32, order of the entry's last release or use (0: never)
    payload: Any  # pytree of [H, ...] arrays, per-entry data (set when an id is inserted)
    watermark: jax.Array  # [] int32, unpinned entries stamped at or below it are not present
    counter: jax.Array  # [] int32, the last stamp handed out
    used: jax.Array  # [] int32, positions holding an id (present or not)


def positions_for(capacity: int) -> int:
    """Positions of a table for up to `capacity` present entries (2 x capacity while a change
    inserts before evicting) at a load below `MAX_LOAD`: the power of two >= 4 x capacity."""
    if capacity < 1:
        raise ValueError(f"a chunk table needs a capacity >= 1, got {capacity}")
    return 1 << max(3, (4 * capacity - 1).bit_length())


def empty(positions: int, payload: Any = ()) -> ChunkTable:
    """An empty table of `positions` positions (a power of two, `positions_for`); `payload` is a
    pytree of per-entry prototypes (e.g. `jnp.int32(0)`) whose arrays get a leading [H] axis."""
    if positions < 2 or positions & (positions - 1):
        raise ValueError(f"a chunk table's positions must be a power of two >= 2, got {positions}")
    zero = jnp.zeros(positions, jnp.int32)
    z = jnp.int32(0)
    data = jax.tree.map(lambda p: jnp.zeros((positions,) + jnp.shape(p), jnp.asarray(p).dtype), payload)
    return ChunkTable(jnp.full(positions, EMPTY, jnp.int32), zero, zero, data, z, z, z)


def home(ids: jax.Array, positions: int) -> jax.Array:
    """[...] int32 home position of each id: the top bits of id x 2^32/phi (Fibonacci hashing)."""
    bits = positions.bit_length() - 1
    h = ids.astype(jnp.uint32) * jnp.uint32(_GOLDEN)
    return (h >> jnp.uint32(32 - bits)).astype(jnp.int32)


def present(t: ChunkTable) -> jax.Array:
    """[H] bool: entries the table holds (pinned, or stamped above the watermark)."""
    return (t.key >= 0) & ((t.ref > 0) | (t.stamp > t.watermark))


def present_at(t: ChunkTable, pos: jax.Array) -> jax.Array:
    """[...] bool: whether the entry at each position (-1: none) is present."""
    safe = jnp.maximum(pos, 0)
    return (pos >= 0) & ((t.ref[safe] > 0) | (t.stamp[safe] > t.watermark))


def _probe(t: ChunkTable, ids: jax.Array, want: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(position of each wanted id or -1, first position on its path an insertion may take).

    Probing stops at the id or at an EMPTY position; the position an insertion may take is the
    first one on the path whose entry is not present (the EMPTY one that ended it at the latest).
    """
    h = t.key.shape[0]
    start = home(ids, h)
    none = jnp.full(ids.shape, -1, jnp.int32)

    def cond(c):
        r, _, _, pending = c
        return pending.any() & (r < h)

    def body(c):
        r, pos, free, pending = c
        p = (start + r) & (h - 1)
        k = t.key[p]
        hit = pending & (k == ids)
        end = pending & (k == EMPTY)
        gone = (t.ref[p] == 0) & (t.stamp[p] <= t.watermark)
        reusable = pending & (free < 0) & ~hit & ((k == EMPTY) | gone)
        return r + 1, jnp.where(hit, p, pos), jnp.where(reusable, p, free), pending & ~hit & ~end

    _, pos, free, _ = jax.lax.while_loop(cond, body, (jnp.int32(0), none, none, want & (ids >= 0)))
    return pos, free


def lookup(t: ChunkTable, ids: jax.Array) -> jax.Array:
    """[...] int32 position of each id (-1 for a negative id or one the table does not hold; a
    found entry may not be present: see `present_at`)."""
    return _probe(t, ids, ids >= 0)[0]


def _claim(
    key: jax.Array,
    ids: jax.Array,
    start: jax.Array,
    pending: jax.Array,
    taken: jax.Array,
    reusable: jax.Array,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Give each pending id (flat [Q]) a position at or after `start` on its probe path that is
    `reusable` and not `taken`; ids equal to one that wins a position share it. Rounds of
    scatter-min: the lowest-indexed claimant of a position wins it, the others move on.
    Returns (positions, -1 where none was found; the keys with the winners written; taken)."""
    h, q = key.shape[0], ids.shape[0]
    index = jnp.arange(q, dtype=jnp.int32)
    none = jnp.full(q, -1, jnp.int32)

    def cond(c):
        r, _, _, _, pending, _ = c
        return pending.any() & (r < h)

    def body(c):
        r, cand, pos, key, pending, taken = c
        ok = pending & reusable[cand] & ~taken[cand]
        winner = jnp.full(h, q, jnp.int32).at[jnp.where(ok, cand, h)].min(index, mode="drop")
        w = winner[cand]
        won = ok & ((w == index) | (ids[jnp.minimum(w, q - 1)] == ids))
        first = ok & (w == index)
        key = key.at[jnp.where(first, cand, h)].set(ids, mode="drop")
        taken = taken.at[jnp.where(first, cand, h)].set(True, mode="drop")
        pos = jnp.where(won, cand, pos)
        pending = pending & ~won
        return r + 1, jnp.where(pending, (cand + 1) & (h - 1), cand), pos, key, pending, taken

    init = (jnp.int32(0), jnp.maximum(start, 0), none, key, pending, taken)
    _, _, pos, key, _, taken = jax.lax.while_loop(cond, body, init)
    return pos, key, taken


def insert(
    t: ChunkTable, ids: jax.Array, mask: jax.Array, payload: Any = ()
) -> tuple[ChunkTable, jax.Array, jax.Array]:
    """Make sure the table holds every id `ids[mask]`; returns (table, positions, overflow).

    An id the table holds keeps its entry (present or not); a new id gets the first position on
    its probe path whose entry is not present, with no pins, stamp 0 (so not present until it is
    pinned or stamped) and its `payload` (a pytree of arrays shaped like `ids`, per id). Equal ids
    share one entry. When more than `MAX_LOAD` of the positions end up used, the table is rebuilt
    with its present entries and these ids (entries move: earlier positions are void).
    `overflow` ([] bool) is True if some id found no position (the table was full); such an id
    gets position -1.
    """
    shape = ids.shape
    flat = ids.reshape(-1)
    want = mask.reshape(-1) & (flat >= 0)
    h = t.key.shape[0]
    found, free = _probe(t, flat, want)
    missing = want & (found < 0) & (free >= 0)
    reusable = (t.key == EMPTY) | ((t.ref == 0) & (t.stamp <= t.watermark))
    taken = jnp.zeros(h, bool).at[jnp.where(found >= 0, found, h)].set(True, mode="drop")
    claimed, key, taken2 = _claim(t.key, flat, free, missing, taken, reusable)
    new = taken2 & ~taken  # positions given to new ids
    fresh_used = (new & (t.key == EMPTY)).sum(dtype=jnp.int32)
    pos = jnp.where(found >= 0, found, claimed)
    target = jnp.where(missing & (claimed >= 0), claimed, h)
    data = jax.tree.map(
        lambda old, v: old.at[target].set(jnp.reshape(v, (flat.shape[0],) + old.shape[1:]), mode="drop"),
        t.payload,
        payload,
    )
    t = t._replace(
        key=key,
        ref=jnp.where(new, 0, t.ref),
        stamp=jnp.where(new, 0, t.stamp),
        payload=data,
        used=t.used + fresh_used,
    )
    overflow = (want & (pos < 0)).any()

    def rebuilt(args):
        t, pos = args
        keep = present(t).at[jnp.where(want, pos, h)].set(True, mode="drop")
        t = rebuild(t, keep)
        return t, _probe(t, flat, want)[0]

    t, pos = jax.lax.cond(t.used > int(MAX_LOAD * h), rebuilt, lambda a: a, (t, pos))
    return t, pos.reshape(shape), overflow


def rebuild(t: ChunkTable, keep: jax.Array | None = None) -> ChunkTable:
    """The table with only the entries `keep` ([H] bool; default: the present ones), each hashed
    again from its home position into an otherwise EMPTY table (pins, stamps, payload kept)."""
    h = t.key.shape[0]
    keep = present(t) if keep is None else keep & (t.key >= 0)
    reusable = jnp.ones(h, bool)
    start = home(t.key, h)
    pos, _, _ = _claim(jnp.full(h, EMPTY, jnp.int32), t.key, start, keep, jnp.zeros(h, bool), reusable)
    target = jnp.where(keep, pos, h)

    def move(x: jax.Array, fill) -> jax.Array:
        return jnp.full_like(x, fill).at[target].set(x, mode="drop")

    return t._replace(
        key=move(t.key, EMPTY),
        ref=move(t.ref, 0),
        stamp=move(t.stamp, 0),
        payload=jax.tree.map(lambda x: move(x, 0), t.payload),
        used=keep.sum(dtype=jnp.int32),
    )


def pin(t: ChunkTable, pos: jax.Array, mask: jax.Array) -> ChunkTable:
    """Add one pin to the entry at `pos` for every masked pair (a position may appear often)."""
    h = t.key.shape[0]
    return t._replace(ref=t.ref.at[jnp.where(mask & (pos >= 0), pos, h)].add(1, mode="drop"))


def unpin(t: ChunkTable, pos: jax.Array, mask: jax.Array) -> ChunkTable:
    """Remove one pin from the entry at `pos` for every masked pair."""
    h = t.key.shape[0]
    return t._replace(ref=t.ref.at[jnp.where(mask & (pos >= 0), pos, h)].add(-1, mode="drop"))


def latest(t: ChunkTable, pos: jax.Array, mask: jax.Array, rank: jax.Array) -> tuple[ChunkTable, jax.Array]:
    """Stamp the entries `pos[mask]` in one event: each gets `counter + 1 + rank` of its
    highest-ranked pair (`rank`: distinct values in [0, pos.size)), so a later event's stamps are
    above every stamp of this one. Returns (table, [...] bool: the pair whose rank each entry kept,
    one per entry). The counter advances by pos.size when any pair is masked."""
    h = t.key.shape[0]
    mask = mask & (pos >= 0)
    value = t.counter + 1 + rank.astype(jnp.int32)
    stamp = t.stamp.at[jnp.where(mask, pos, h)].max(value, mode="drop")
    won = mask & (stamp[jnp.maximum(pos, 0)] == value)
    counter = t.counter + jnp.where(mask.any(), jnp.int32(pos.size), 0)
    return t._replace(stamp=stamp, counter=counter), won


def evict_oldest(t: ChunkTable) -> tuple[ChunkTable, jax.Array]:
    """Evict the unpinned present entry with the oldest stamp (none when there is none): the
    watermark rises to its stamp. Returns (table, [H] bool: the evicted positions)."""
    candidate = (t.key >= 0) & (t.ref == 0) & (t.stamp > t.watermark)
    oldest = jnp.min(jnp.where(candidate, t.stamp, _NEVER))
    gone = candidate & (t.stamp == oldest)
    return t._replace(watermark=jnp.where(gone.any(), oldest, t.watermark)), gone
