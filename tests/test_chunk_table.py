"""The fixed-capacity table of chunk ids (burstgym.chunk_table): lookups and insertions through
collisions, equal ids in one insertion, LRU eviction by stamps, rebuilds that keep what is
present, overflow reported rather than an entry lost, and random sequences of changes against a
plain dict."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from burstgym import chunk_table as ct

# Jitted once per table size: the tests call them many times.
_insert = jax.jit(ct.insert)
_lookup = jax.jit(ct.lookup)
_latest = jax.jit(ct.latest)
_evict = jax.jit(ct.evict_oldest)


def _colliding(n: int, positions: int) -> list[int]:
    """`n` ids that share one home position in a table of `positions`."""
    ids = np.arange(100_000, dtype=np.int32)
    homes = np.asarray(ct.home(jnp.asarray(ids), positions))
    return [int(i) for i in ids[homes == homes[0]][:n]]


def test_positions_for_a_capacity() -> None:
    assert ct.positions_for(1) == 8
    assert ct.positions_for(1797) == 8192
    with pytest.raises(ValueError, match="capacity >= 1"):
        ct.positions_for(0)
    with pytest.raises(ValueError, match="power of two"):
        ct.empty(12)


def test_insert_and_lookup_through_collisions_with_payload() -> None:
    """Ids sharing a home position are chained and all found; equal ids in one insertion share
    an entry; a new entry is not present until pinned or stamped; its payload is kept."""
    t = ct.empty(16, jnp.int32(0))
    ids = _colliding(3, 16)
    batch = jnp.asarray([ids[0], ids[1], ids[0], ids[2], -1], jnp.int32)
    t, pos, overflow = _insert(t, batch, jnp.ones(5, bool), batch * 10)
    pos = np.asarray(pos)
    assert not bool(overflow)
    assert pos[0] == pos[2] and len({pos[0], pos[1], pos[3]}) == 3 and pos[4] == -1
    np.testing.assert_array_equal(np.asarray(_lookup(t, batch)), pos)
    assert int(t.used) == 3
    np.testing.assert_array_equal(np.asarray(t.payload)[pos[:4]], np.asarray(batch[:4]) * 10)
    assert not np.asarray(ct.present(t)).any()
    t = ct.pin(t, jnp.asarray(pos[:1]), jnp.ones(1, bool))
    assert np.asarray(ct.present_at(t, jnp.asarray(pos))).tolist() == [True, False, True, False, False]
    assert int(_lookup(t, jnp.asarray([_colliding(4, 16)[3]], jnp.int32))[0]) == -1


def test_lru_eviction_order_by_stamps() -> None:
    """Released entries go oldest stamp first (within one event, lowest rank first); pinned
    entries are never evicted; an evicted entry's position is reused by a new id."""
    t = ct.empty(16, ())
    ids = jnp.asarray([5, 6, 7, 8], jnp.int32)
    t, pos, _ = _insert(t, ids, jnp.ones(4, bool), ())
    t = ct.pin(t, pos, jnp.ones(4, bool))
    t = ct.unpin(t, pos, jnp.asarray([True, True, False, True]))
    t, won = _latest(t, pos, jnp.asarray([True, True, False, False]), jnp.asarray([1, 0, 2, 3]))
    assert np.asarray(won).tolist() == [True, True, False, False]
    t, _ = _latest(t, pos, jnp.asarray([False, False, False, True]), jnp.arange(4))
    order = []
    for _ in range(4):
        t, gone = _evict(t)
        order.append(np.flatnonzero(np.asarray(gone)).tolist())
    p = np.asarray(pos)
    assert order == [[p[1]], [p[0]], [p[3]], []]  # id 7 is pinned: never evicted
    assert np.asarray(ct.present(t))[p].tolist() == [False, False, True, False]
    t, again, _ = _insert(t, jnp.asarray([5], jnp.int32), jnp.ones(1, bool), ())
    assert int(again[0]) == p[0] and not bool(ct.present_at(t, again)[0])


def test_rebuild_keeps_present_entries_and_frees_the_rest() -> None:
    """Inserting past the load limit rebuilds: present entries and the new ids stay, with their
    pins, stamps and payload; positions of ids no longer present are freed."""
    t = ct.empty(16, jnp.int32(0))
    for k in range(12):
        i = jnp.asarray([k], jnp.int32)
        t, pos, overflow = _insert(t, i, jnp.ones(1, bool), i + 100)
        assert not bool(overflow)
        t, _ = _latest(t, pos, jnp.ones(1, bool), jnp.zeros(1, jnp.int32))
        if k % 2 == 0:
            t, _ = _evict(t)  # keeps at most about half of them present
        assert int(t.used) <= ct.MAX_LOAD * 16
    held = [k for k in range(12) if bool(ct.present_at(t, _lookup(t, jnp.asarray([k], jnp.int32)))[0])]
    assert held == list(range(6, 12))
    pos = _lookup(t, jnp.asarray(held, jnp.int32))
    np.testing.assert_array_equal(np.asarray(t.payload)[np.asarray(pos)], np.asarray(held) + 100)


def test_a_full_table_reports_overflow_and_keeps_its_entries() -> None:
    """With every position pinned, a new id gets no position and `overflow` says so."""
    t = ct.empty(8, ())
    t = ct.rebuild(t._replace(key=jnp.arange(8, dtype=jnp.int32), ref=jnp.ones(8, jnp.int32)))
    assert int(t.used) == 8
    t2, pos, overflow = _insert(t, jnp.asarray([99], jnp.int32), jnp.ones(1, bool), ())
    assert bool(overflow) and int(pos[0]) == -1
    np.testing.assert_array_equal(np.sort(np.asarray(t2.key)), np.arange(8))


def test_vmapped_over_nodes() -> None:
    """Each node's table is separate: the same id inserted on one node is absent on the other."""
    tables = jax.vmap(lambda _: ct.empty(16, ()))(jnp.arange(2))
    ids = jnp.asarray([[3, 4], [4, 9]], jnp.int32)
    tables, pos, overflow = jax.vmap(ct.insert)(tables, ids, jnp.asarray([[True, True], [False, True]]), ())
    found = jax.vmap(ct.lookup)(tables, jnp.asarray([[4, 9], [4, 9]], jnp.int32))
    assert (np.asarray(found) >= 0).tolist() == [[True, False], [False, True]]
    assert not np.asarray(overflow).any()


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.sampled_from("ipre"), st.lists(st.integers(0, 40), max_size=6)), max_size=60))
def test_random_changes_match_a_dict(ops) -> None:
    """Random insert+pin (i), unpin+release (r), touch (p) and eviction (e) sequences on a small
    table keep exactly the entries a dict model of the same rules keeps, in the same LRU order."""
    positions = 32
    t = ct.empty(positions, jnp.int32(0))
    refs: dict[int, int] = {}
    stamps: dict[int, int] = {}  # present unpinned ids and their last release / use
    clock = 0
    width = 6
    for kind, raw in ops:
        ids = np.full(width, -1, np.int32)
        ids[: len(raw)] = raw
        mask = ids >= 0
        if kind == "i":  # insert and pin every id (bounded so the table's capacity of 8 holds)
            if len(set(refs) | set(stamps) | set(raw)) > positions // 4:
                continue
            t, pos, overflow = _insert(t, jnp.asarray(ids), jnp.asarray(mask), jnp.asarray(ids) * 3)
            assert not bool(overflow)
            t = ct.pin(t, pos, jnp.asarray(mask))
            for i in raw:
                refs[i] = refs.get(i, 0) + 1
                stamps.pop(i, None)
        elif kind in "rp":
            pos = _lookup(t, jnp.asarray(ids))
            if kind == "r":  # unpin one pin per pair while the id has any; freed ids get stamped
                ok = np.zeros(width, bool)
                for j, i in enumerate(ids):
                    if i >= 0 and refs.get(int(i), 0) > 0:
                        refs[int(i)] -= 1
                        ok[j] = True
                t = ct.unpin(t, pos, jnp.asarray(ok))
                freed = ok & np.asarray([refs.get(int(i), 1) == 0 for i in ids])
            else:  # touch present unpinned ids (a router's use)
                freed = np.asarray([int(i) in stamps for i in ids]) & mask
            t, _ = _latest(t, pos, jnp.asarray(freed), jnp.arange(width))
            for j in np.flatnonzero(freed):  # the highest-ranked pair of each id stamps it
                stamps[int(ids[j])] = clock + 1 + int(j)
            clock += width if freed.any() else 0
            refs = {i: r for i, r in refs.items() if r > 0}
        else:
            t, gone = _evict(t)
            if stamps:
                oldest = min(stamps, key=stamps.get)
                del stamps[oldest]
                assert np.asarray(t.key)[np.asarray(gone)].tolist() == [oldest]
            else:
                assert not np.asarray(gone).any()
        assert int(t.used) <= ct.MAX_LOAD * positions
        held = np.asarray(t.key)[np.asarray(ct.present(t))]
        assert sorted(held.tolist()) == sorted(set(refs) | set(stamps))
        for i in held:
            p = int(_lookup(t, jnp.asarray([i], jnp.int32))[0])
            assert int(t.payload[p]) == 3 * i and int(t.ref[p]) == refs.get(int(i), 0)
