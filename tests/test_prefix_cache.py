"""The per-node prefix cache (burstgym.prefix_cache, docs/semantics.md "Prefix cache"): LRU
eviction order by hand, pinned chunks never evicted, and every request's hit on one big node
equal to the closed form (its longest run of leading chunks that an earlier request carried,
capped so the last block is computed) for synthetic shared prefixes and the Mooncake trace."""

from __future__ import annotations

import os
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import TIGHT_SHARED_PREFIX, rollout

from burstgym import chunk_table as ct
from burstgym import prefix_cache as pc
from burstgym import scenarios
from burstgym.types import PrefixCache

SHARED_DATA = Path(
    os.environ.get("BURSTGYM_SHARED_DATA", Path(__file__).resolve().parents[1].parent / "shared" / "data")
)
MOONCAKE = SHARED_DATA / "traces" / "mooncake_synthetic_trace.jsonl"


BS = jnp.int32(16)


def _empty(entries: int = 8) -> PrefixCache:
    """A node's empty cache for `entries` chunks (chunks of 32 tokens are two KV blocks of 16)."""
    return pc.empty_cache(ct.positions_for(entries))


def _chunks(ids: list) -> pc.Chunks:
    """Pairs naming the chunks `ids` (a list, or a list of lists for several requests)."""
    a = jnp.asarray(ids, jnp.int32)
    return pc.Chunks(ids=a, end=jnp.zeros_like(a), blocks=jnp.full_like(a, 2), tokens=jnp.full_like(a, 32))


def _usage(c: PrefixCache) -> list[int]:
    """(blocks held, blocks pinned) as kept, after checking them, the tokens and the chunks held
    against a recount."""
    kept = [int(c.cached), int(c.pinned), int(c.cached_tokens), int(c.entries)]
    assert kept == [int(x) for x in pc.scan_usage(c, BS)]
    return kept[:2]


def _present(c: PrefixCache, n: int = 4) -> list[bool]:
    return np.asarray(pc.present_at(c, jnp.arange(n, dtype=jnp.int32))).tolist()


def _release(cache: PrefixCache, ids: list[int]) -> PrefixCache:
    """Release `ids` in one event, the last listed being the most recently used."""
    ch = _chunks([ids])
    at = pc.locate(cache, ch.ids)
    return pc.release(cache, ch, at, jnp.ones(ch.ids.shape, bool), jnp.arange(ch.ids.size)[None, :], len(ids))


def test_lru_eviction_order() -> None:
    """Chunks released earlier are evicted first; within one event, by release order; eviction
    stops as soon as the deficit is covered."""
    c = _empty()
    c = pc.add_refs(c, _chunks([0, 1, 2, 3]), jnp.ones(4, bool))[0]
    c = _release(c, [1])  # first event: chunk 1
    c = _release(c, [3, 0])  # second event: 3, then 0 (most recent)
    assert _present(c) == [True, True, True, True]  # 2 is pinned
    assert _usage(c) == [8, 2]
    c = pc.evict(c, jnp.int32(3), BS, 8)  # needs two chunks: 1, then 3
    assert _present(c) == [True, False, True, False]
    assert _usage(c) == [4, 2]
    c = pc.evict(c, jnp.int32(100), BS, 8)  # everything evictable goes; the pinned chunk stays
    assert _present(c) == [False, False, True, False]
    assert _usage(c) == [2, 2]


def test_a_hit_re_pins_and_a_shared_chunk_is_released_once_free() -> None:
    """A chunk two requests pin is released (evictable) only when both have let go; pinned by
    both in one change, it counts once in the node's totals."""
    c = pc.add_refs(_empty(), _chunks([0, 0]), jnp.ones(2, bool))[0]
    assert _usage(c) == [2, 2]
    c = _release(c, [0])
    c = pc.evict(c, jnp.int32(100), BS, 8)
    assert _present(c)[0] and _usage(c) == [2, 2]  # still pinned by the other request
    c = _release(c, [0])
    assert _usage(c) == [2, 0]
    c = pc.evict(c, jnp.int32(1), BS, 8)
    assert not _present(c)[0] and _usage(c) == [0, 0]
    c = pc.add_refs(c, _chunks([[0, 1], [0, 2]]), jnp.ones((2, 2), bool))[0]  # a shared hit
    assert _usage(c) == [6, 6]
    c = _release(c, [0, 1, 0, 2])  # both requests let go in one event: chunk 0 freed once
    assert _usage(c) == [6, 0]


def test_entry_limit_evicts_least_recently_released_and_flags_a_pinned_overflow() -> None:
    """Past `max_entries` chunks, the least recently released go first even with blocks to
    spare; with every chunk pinned the cache is `full` (the core's ERROR_CACHE_FULL)."""
    c = pc.add_refs(_empty(), _chunks([0, 1, 2]), jnp.ones(3, bool))[0]
    c = _release(c, [2, 0, 1])
    c = pc.evict(c, jnp.int32(0), BS, 2)  # no blocks needed, one chunk too many: 2 goes
    assert _present(c) == [True, True, False, False] and not bool(c.full)
    c = pc.add_refs(c, _chunks([0, 1, 3]), jnp.ones(3, bool))[0]
    c = pc.evict(c, jnp.int32(0), BS, 2)
    assert _present(c) == [True, True, False, True] and bool(c.full)
    assert _usage(c) == [6, 6]


def test_memory_does_not_grow_with_the_ids_of_an_episode() -> None:
    """The table's size follows the chunks a node can hold: a thousand distinct ids pass through
    a cache of eight entries without a rebuild losing a held chunk."""

    @jax.jit  # one compiled cycle (eagerly, each call would compile its loops anew)
    def cycle(c: PrefixCache, ids: jax.Array) -> PrefixCache:
        c = pc.add_refs(c, _chunks(ids), jnp.ones(4, bool))[0]
        return pc.evict(_release(c, ids), jnp.int32(0), BS, 8)

    c = _empty()
    for k in range(0, 1000, 4):
        c = cycle(c, jnp.arange(k, k + 4, dtype=jnp.int32))
        assert int(c.entries) == min(k + 4, 8) and not bool(c.full)
    assert np.asarray(pc.present_at(c, jnp.arange(992, 1000, dtype=jnp.int32))).all()
    assert c.table.key.shape == (32,)
    _usage(c)


def _closed_form_hits(ids: np.ndarray, end: np.ndarray, prompt: np.ndarray, block: int) -> np.ndarray:
    """Hit tokens of each request on a node that never evicts, routed every request in order."""
    seen: set[int] = set()
    out = np.zeros(len(ids), np.int64)
    for i, (row, ends, p) in enumerate(zip(ids, end, prompt, strict=True)):
        run = 0
        while run < row.size and row[run] >= 0 and int(row[run]) in seen:
            run += 1
        tokens = int(ends[run - 1]) if run else 0
        out[i] = min(tokens, block * ((int(p) - 1) // block))
        seen.update(int(x) for x in row[row >= 0])
    return out


def _check_closed_form(name: str, settings: dict) -> float:
    e = 200
    cfg, params = scenarios.make(
        name,
        n_nodes=1,
        episode_length=e,
        load=0.3,
        kv_capacity_tokens=50_000_000,
        max_num_batched_tokens=200_000,
        **settings,
    )
    _, st0, st, tr = rollout(cfg, params, 0, np.zeros(e, np.int64))
    assert (tr["error"] == 0).all() and not np.asarray(st.log.dropped).any()
    req = st0.requests
    ids = np.asarray(req.chunk_ids)[:e]
    start = np.arange(ids.shape[1])[None, :] * cfg.chunk_tokens
    size = np.clip(np.asarray(req.id_tokens)[:e, None] - start, 0, cfg.chunk_tokens)
    end = np.cumsum(np.where(ids >= 0, size, 0), axis=1)
    prompt = np.asarray(req.prompt)[:e]
    want = _closed_form_hits(ids, end, prompt, int(params.nodes.block_size[0]))
    np.testing.assert_array_equal(np.asarray(st.log.hit_tokens), want)
    assert int(np.asarray(st.log.preemptions).sum()) == 0
    return float(want.sum() / prompt.sum())


def test_hits_match_closed_form_shared_prefixes() -> None:
    rate = _check_closed_form("prefix", dict(prefix_groups=16))
    assert rate > 0.3  # the groups recur: most prompt tokens are hits


def test_hits_match_closed_form_mooncake() -> None:
    if not MOONCAKE.is_file():
        pytest.skip(f"shared trace data not found at {MOONCAKE} (set BURSTGYM_SHARED_DATA)")
    rate = _check_closed_form("trace", dict(trace=str(MOONCAKE)))
    assert rate > 0.0


def test_nodes_planned_together_plan_as_each_node_alone() -> None:
    """The prefix cache's per-pair work runs under one condition for all nodes planned together
    (`plan_continuous(..., nodes_axis=)`): a node with nothing to release, pin or admit must come
    out of a branch taken for another node exactly as if planned alone. Recorded states of a
    skewed, overloaded episode (3 of 4 requests to node 0, the rest to node 1, tight KV), planned
    with more blocks on node 0 and fewer on node 1 than they ran with, exercise admission on one
    node and preemption on another in the same plans; the caches are compared up to the stamps of
    pinned chunks (scratch marks that only a release gives a meaning, burstgym/prefix_cache.py)."""
    from burstgym import cluster
    from burstgym.env import BurstBalance
    from burstgym.scheduler import plan_continuous

    cfg, params = scenarios.make(
        "prefix",
        n_nodes=3,
        episode_length=96,
        load=1.5,
        **TIGHT_SHARED_PREFIX,
        slot_widths=(),
    )
    core = BurstBalance(cfg)
    _, s0 = core.reset(jax.random.key(3), params)
    actions = jnp.arange(cfg.episode_length) % 4 == 0  # 3 of 4 requests to node 0, the rest to 1

    def record(s, a):
        return core.step_env(s, a.astype(jnp.int32), params)[1], s

    states = jax.lax.scan(record, s0, actions)[1]
    ncfg = cluster.node_configs(params.nodes)
    # node 0 plans with twice its KV blocks (its queue can be admitted), node 1 with half (its
    # running requests are short of blocks), node 2 holds nothing
    ncfg = ncfg._replace(kv_blocks=ncfg.kv_blocks * jnp.array([4, 1, 2]) // 2)

    def plans(st):
        geo = cluster.geometry(st.slots, st.requests, params, cfg)
        at = jax.vmap(pc.locate)(st.cache, geo.chunks.ids)
        args = (st.slots, ncfg, st.cache, geo.chunks, at)
        together = jax.vmap(lambda *a: plan_continuous(*a, cfg.cache_entries, "nodes"), axis_name="nodes")(
            *args
        )
        alone = jax.vmap(lambda *a: plan_continuous(*a, cfg.cache_entries))(*args)
        return together, alone

    together, alone = jax.jit(lambda s: jax.lax.map(plans, s))(states)

    def comparable(plan):
        t = plan.cache.table
        stamp = jnp.where(t.ref > 0, -1, t.stamp)
        return plan._replace(cache=plan.cache._replace(table=t._replace(stamp=stamp)))

    a, b = comparable(together), comparable(alone)
    jax.tree_util.tree_map_with_path(
        lambda path, x, y: np.testing.assert_array_equal(x, y, err_msg=jax.tree_util.keystr(path)), a, b
    )
    # the recorded plans exercise every guarded branch, on some nodes and not on others
    preempted, admitted = together.preempted.any(axis=-1), together.admitted.any(axis=-1)  # [steps, N]
    assert bool((preempted[:, 1] & ~preempted[:, 0]).any()) and bool((admitted[:, 0] & ~admitted[:, 1]).any())
