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
position until it meets the id or an `EMPTY` position (or has seen all H); an insertion puts a
new id on the first position along that path whose entry is not present (or `EMPTY`). Entries
never move except in `rebuild`: a present entry's position stays valid across `insert`, `pin`,
`unpin`, `latest` and `evict_oldest` (an entry that is not present may lose its position to a
new id in `insert`).

Positions holding an id that is no longer present count as `used` until `rebuild` drops them
(hashing every present entry again into an otherwise `EMPTY` table). They only lengthen probes:
a lookup that meets no `EMPTY` position probes all H and is still exact, and an insertion finds
a position as long as fewer than H entries are present. So rebuilding is a matter of speed, and
callers do it between changes when `needs_rebuild` says more than `MAX_LOAD` of the positions
are used (`tidy`; the engine once per step, outside its per-node loops).

Sizing: `positions_for(capacity)` gives `H` for at most `capacity` present entries after every
complete change, plus as many inserted before the caller evicts (2 x capacity at most), with
room to spare. A table never drops an entry on its own: `insert` reports the ids it could not
place (`overflow`), which cannot happen while fewer than H entries are present.

Every loop here carries per-id state only and reads the [H] arrays.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

EMPTY = -1  # key of a position that holds no id
MAX_LOAD = 5 / 8  # fraction of used positions above which `needs_rebuild` says to rebuild
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
    inserts before evicting): the smallest power of two above 2 x capacity (at least 8)."""
    if capacity < 1:
        raise ValueError(f"a chunk table needs a capacity >= 1, got {capacity}")
    return 1 << max(3, (2 * capacity).bit_length())


def empty(positions: int, payload: Any = ()) -> ChunkTable:
    """An empty table of `positions` positions (a power of two, `positions_for`); `payload` is a
    pytree of per-entry prototypes (e.g. `jnp.int32(0)`) whose arrays get a leading [H] axis."""
    if positions < 1 or positions & (positions - 1):
        raise ValueError(f"a chunk table's positions must be a power of two, got {positions}")
    zero = jnp.zeros(positions, jnp.int32)
    z = jnp.int32(0)
    data = jax.tree.map(lambda p: jnp.zeros((positions,) + jnp.shape(p), jnp.asarray(p).dtype), payload)
    return ChunkTable(jnp.full(positions, EMPTY, jnp.int32), zero, zero, data, z, z, z)


def home(ids: jax.Array, positions: int) -> jax.Array:
    """[...] int32 home position of each id: the top bits of id x 2^32/phi (Fibonacci hashing)."""
    bits = positions.bit_length() - 1
    if bits == 0:
        return jnp.zeros(ids.shape, jnp.int32)
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


def _claim(t: ChunkTable, ids: jax.Array, start: jax.Array, pending: jax.Array, found: jax.Array):
    """Give each pending id (flat [Q]) a position at or after `start` on its probe path whose
    entry is not present (or EMPTY), not `found` by another id of this insertion and not won by
    another id; ids equal to one that wins a position share it. Rounds of scatter-min: the
    lowest-indexed claimant of a position wins it, the others move on. The table is only read
    here (an insertion whose ids are all held runs no round). Returns (positions, -1 where none
    was found (all H tried); how many EMPTY positions were taken)."""
    h, q = t.key.shape[0], ids.shape[0]
    index = jnp.arange(q, dtype=jnp.int32)

    def round_(c):
        r, cand, pos, pending, fresh = c
        held = jnp.where(pos >= 0, pos, found)  # positions this insertion holds already
        taken = jnp.zeros(h, bool).at[jnp.where(held >= 0, held, h)].set(True, mode="drop")
        k = t.key[cand]
        reusable = (k == EMPTY) | ((t.ref[cand] == 0) & (t.stamp[cand] <= t.watermark))
        ok = pending & reusable & ~taken[cand]
        winner = jnp.full(h, q, jnp.int32).at[jnp.where(ok, cand, h)].min(index, mode="drop")
        w = winner[cand]
        first = ok & (w == index)
        won = first | (ok & (ids[jnp.minimum(w, q - 1)] == ids))
        fresh = fresh + (first & (k == EMPTY)).sum(dtype=jnp.int32)
        pos = jnp.where(won, cand, pos)
        pending = pending & ~won
        return r + 1, jnp.where(pending, (cand + 1) & (h - 1), cand), pos, pending, fresh

    def cond(c):
        r, _, _, pending, _ = c
        return pending.any() & (r < h)

    none = jnp.full(q, -1, jnp.int32)
    init = (jnp.int32(0), jnp.maximum(start, 0), none, pending, jnp.int32(0))
    _, _, pos, _, fresh = jax.lax.while_loop(cond, round_, init)
    return pos, fresh


def insert(
    t: ChunkTable, ids: jax.Array, mask: jax.Array, payload: Any = ()
) -> tuple[ChunkTable, jax.Array, jax.Array]:
    """Make sure the table holds every id `ids[mask]`; returns (table, positions, overflow).

    An id the table holds keeps its entry (present or not); a new id gets the first position on
    its probe path whose entry is not present, with no pins, stamp 0 (so not present until it is
    pinned or stamped) and its `payload` (a pytree of arrays shaped like `ids`, per id). Equal ids
    share one entry. No entry moves. `overflow` ([] bool) is True if some id found no position
    (H entries present); such an id gets position -1.
    """
    shape = ids.shape
    flat = ids.reshape(-1)
    want = mask.reshape(-1) & (flat >= 0)
    h = t.key.shape[0]
    found, free = _probe(t, flat, want)
    missing = want & (found < 0) & (free >= 0)
    claimed, fresh = _claim(t, flat, free, missing, found)
    pos = jnp.where(found >= 0, found, claimed)
    # Equal ids write the same values to one position, so the order of the writes does not matter.
    target = jnp.where(missing & (claimed >= 0), claimed, h)
    data = jax.tree.map(
        lambda old, v: old.at[target].set(jnp.reshape(v, (flat.shape[0],) + old.shape[1:]), mode="drop"),
        t.payload,
        payload,
    )
    t = t._replace(
        key=t.key.at[target].set(flat, mode="drop"),
        ref=t.ref.at[target].set(0, mode="drop"),
        stamp=t.stamp.at[target].set(0, mode="drop"),
        payload=data,
        used=t.used + fresh,
    )
    overflow = (want & (pos < 0)).any()
    return t, pos.reshape(shape), overflow


def needs_rebuild(t: ChunkTable) -> jax.Array:
    """[] bool: more than `MAX_LOAD` of the positions are used (probes grow long)."""
    return t.used > int(MAX_LOAD * t.key.shape[-1])


def tidy(t: ChunkTable) -> ChunkTable:
    """`t` rebuilt when `needs_rebuild` says so (a `lax.cond`), else as it is."""
    return jax.lax.cond(needs_rebuild(t), rebuild, lambda x: x, t)


def rebuild(t: ChunkTable, keep: jax.Array | None = None) -> ChunkTable:
    """The table with only the entries `keep` ([H] bool; default: the present ones), each hashed
    again from its home position into an otherwise EMPTY table (pins, stamps, payload kept)."""
    h = t.key.shape[0]
    keep = present(t) if keep is None else keep & (t.key >= 0)
    fresh = ChunkTable(jnp.full(h, EMPTY, jnp.int32), t.ref, t.stamp, (), t.watermark, t.counter, t.used)
    pos, _ = _claim(fresh, t.key, home(t.key, h), keep, jnp.full(h, -1, jnp.int32))
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


def latest(
    t: ChunkTable, pos: jax.Array, mask: jax.Array, rank: jax.Array, span: jax.Array | int | None = None
) -> tuple[ChunkTable, jax.Array]:
    """Stamp the entries `pos[mask]` in one event: each gets `counter + 1 + rank` of its
    highest-ranked pair (`rank`: distinct values in [0, span) over the masked pairs), and the
    counter advances by `span` (default pos.size) when any pair is masked, so a later event's
    stamps are above every stamp of this one. Returns (table, [...] bool: the pair whose rank
    each entry kept, one per entry).

    With `span=0` the stamps are scratch marks on pinned entries (only the returned pairs
    matter): a pinned entry's stamp means nothing until it is released and stamped anew, which
    overwrites whatever it held."""
    h = t.key.shape[0]
    mask = mask & (pos >= 0)
    target = jnp.where(mask, pos, h)
    value = t.counter + 1 + rank.astype(jnp.int32)
    stamp = t.stamp.at[target].set(0, mode="drop").at[target].max(value, mode="drop")
    won = mask & (stamp[jnp.maximum(pos, 0)] == value)
    advance = pos.size if span is None else span
    counter = t.counter + jnp.where(mask.any(), jnp.asarray(advance, jnp.int32), 0)
    return t._replace(stamp=stamp, counter=counter), won


def oldest(t: ChunkTable, watermark: jax.Array) -> tuple[jax.Array, jax.Array]:
    """([] the oldest stamp of an unpinned entry present above `watermark` (int32 max: none),
    [H] bool its position), reading the table without changing it: a caller evicting several
    entries in a loop carries only the watermark."""
    candidate = (t.key >= 0) & (t.ref == 0) & (t.stamp > watermark)
    first = jnp.min(jnp.where(candidate, t.stamp, _NEVER))
    return first, candidate & (t.stamp == first)


def evict_oldest(t: ChunkTable) -> tuple[ChunkTable, jax.Array]:
    """Evict the unpinned present entry with the oldest stamp (none when there is none): the
    watermark rises to its stamp. Returns (table, [H] bool: the evicted positions)."""
    stamp, gone = oldest(t, t.watermark)
    return t._replace(watermark=jnp.where(gone.any(), stamp, t.watermark)), gone
