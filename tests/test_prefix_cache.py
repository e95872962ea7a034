"""The per-node prefix cache (burstgym.prefix_cache, docs/semantics.md "Prefix cache"): LRU
eviction order by hand, pinned chunks never evicted, and every request's hit on one big node
equal to the closed form (its longest run of leading chunks that an earlier request carried,
capped so the last block is computed) for synthetic shared prefixes and the Mooncake trace."""

from __future__ import annotations

import os
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
from conftest import rollout

from burstgym import prefix_cache as pc
from burstgym import scenarios
from burstgym.types import PrefixCache

SHARED_DATA = Path(
    os.environ.get("BURSTGYM_SHARED_DATA", Path(__file__).resolve().parents[1].parent / "shared" / "data")
)
MOONCAKE = SHARED_DATA / "traces" / "mooncake_synthetic_trace.jsonl"
BLOCKS = jnp.array([2, 2, 2, 2], jnp.int32)  # four chunks of two KV blocks each


def _empty(u: int = 4) -> PrefixCache:
    z = jnp.zeros((), jnp.int32)
    return PrefixCache(jnp.zeros(u, jnp.int32), jnp.zeros(u, jnp.int32), z, z)


def _release(cache: PrefixCache, ids: list[int]) -> PrefixCache:
    """Release `ids` in one event, the last listed being the most recently used."""
    a = jnp.asarray(ids, jnp.int32)[None, :]
    return pc.release(cache, a, jnp.ones_like(a, bool), jnp.arange(a.size)[None, :])


def test_lru_eviction_order() -> None:
    """Chunks released earlier are evicted first; within one event, by release order; eviction
    stops as soon as the deficit is covered."""
    c = _empty()
    ids = jnp.arange(4, dtype=jnp.int32)
    c = pc.add_refs(c, ids, jnp.ones(4, bool))
    c = _release(c, [1])  # first event: chunk 1
    c = _release(c, [3, 0])  # second event: 3, then 0 (most recent)
    np.testing.assert_array_equal(pc.present(c), [True, True, True, True])  # 2 is pinned
    assert [int(x) for x in pc.usage(c, BLOCKS)] == [8, 2]
    c = pc.evict(c, jnp.int32(3), BLOCKS)  # needs two chunks: 1, then 3
    np.testing.assert_array_equal(pc.present(c), [True, False, True, False])
    c = pc.evict(c, jnp.int32(100), BLOCKS)  # everything evictable goes; the pinned chunk stays
    np.testing.assert_array_equal(pc.present(c), [False, False, True, False])
    assert [int(x) for x in pc.usage(c, BLOCKS)] == [2, 2]


def test_a_hit_re_pins_and_a_shared_chunk_is_released_once_free() -> None:
    """A chunk two requests pin is released (evictable) only when both have let go."""
    c = pc.add_refs(_empty(), jnp.array([0, 0], jnp.int32), jnp.ones(2, bool))
    c = _release(c, [0])
    c = pc.evict(c, jnp.int32(100), BLOCKS)
    assert bool(pc.present(c)[0])  # still pinned by the other request
    c = _release(c, [0])
    c = pc.evict(c, jnp.int32(1), BLOCKS)
    assert not bool(pc.present(c)[0])


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
        name, n_nodes=1, episode_length=e, load=0.3, kv_capacity_tokens=50_000_000,
        max_num_batched_tokens=200_000, **settings,
    )
    _, st0, st, tr = rollout(cfg, params, 0, np.zeros(e, np.int64))
    assert (tr["error"] == 0).all() and not np.asarray(st.log.dropped).any()
    req = st0.requests
    ids = np.asarray(req.chunk_ids)[:e]
    sizes = np.asarray(req.chunk_tokens)
    end = np.cumsum(np.where(ids >= 0, sizes[np.maximum(ids, 0)], 0), axis=1)
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
