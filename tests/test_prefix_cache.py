"""The per-node prefix cache (burstgym.prefix_cache, docs/semantics.md "Prefix cache"): LRU
eviction order by hand, pinned chunks never evicted, and every request's hit on one big node
equal to the closed form (its longest run of leading chunks that an earlier request carried,
capped so the last block is computed) for synthetic shared prefixes and the Mooncake trace."""

from __future__ import annotations

import os
from pathlib import Path
from types import SimpleNamespace

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


def _empty() -> PrefixCache:
    """A node's empty cache over four chunks of 32 tokens, two KV blocks of 16 each."""
    return pc.empty_cache(SimpleNamespace(chunk_tokens=jnp.full(4, 32, jnp.int32)), jnp.int32(16))


def _chunks(ids: list) -> pc.Chunks:
    """Pairs naming the chunks `ids` (a list, or a list of lists for several requests)."""
    a = jnp.asarray(ids, jnp.int32)
    return pc.Chunks(ids=a, end=jnp.zeros_like(a), blocks=jnp.full_like(a, 2), tokens=jnp.full_like(a, 32))


def _usage(c: PrefixCache) -> list[int]:
    """(blocks held, blocks pinned) as kept, after checking them and the tokens against a recount."""
    kept = [int(c.cached), int(c.pinned), int(c.cached_tokens)]
    assert kept == [int(x) for x in pc.scan_usage(c)]
    return kept[:2]


def _release(cache: PrefixCache, ids: list[int]) -> PrefixCache:
    """Release `ids` in one event, the last listed being the most recently used."""
    ch = _chunks([ids])
    return pc.release(cache, ch, jnp.ones(ch.ids.shape, bool), jnp.arange(ch.ids.size)[None, :])


def test_lru_eviction_order() -> None:
    """Chunks released earlier are evicted first; within one event, by release order; eviction
    stops as soon as the deficit is covered."""
    c = _empty()
    c = pc.add_refs(c, _chunks([0, 1, 2, 3]), jnp.ones(4, bool))
    c = _release(c, [1])  # first event: chunk 1
    c = _release(c, [3, 0])  # second event: 3, then 0 (most recent)
    np.testing.assert_array_equal(pc.present(c), [True, True, True, True])  # 2 is pinned
    assert _usage(c) == [8, 2]
    c = pc.evict(c, jnp.int32(3))  # needs two chunks: 1, then 3
    np.testing.assert_array_equal(pc.present(c), [True, False, True, False])
    assert _usage(c) == [4, 2]
    c = pc.evict(c, jnp.int32(100))  # everything evictable goes; the pinned chunk stays
    np.testing.assert_array_equal(pc.present(c), [False, False, True, False])
    assert _usage(c) == [2, 2]


def test_a_hit_re_pins_and_a_shared_chunk_is_released_once_free() -> None:
    """A chunk two requests pin is released (evictable) only when both have let go; pinned by
    both in one change, it counts once in the node's totals."""
    c = pc.add_refs(_empty(), _chunks([0, 0]), jnp.ones(2, bool))
    assert _usage(c) == [2, 2]
    c = _release(c, [0])
    c = pc.evict(c, jnp.int32(100))
    assert bool(pc.present(c)[0]) and _usage(c) == [2, 2]  # still pinned by the other request
    c = _release(c, [0])
    assert _usage(c) == [2, 0]
    c = pc.evict(c, jnp.int32(1))
    assert not bool(pc.present(c)[0]) and _usage(c) == [0, 0]
    c = pc.add_refs(c, _chunks([[0, 1], [0, 2]]), jnp.ones((2, 2), bool))  # a shared hit
    assert _usage(c) == [6, 6]
    c = _release(c, [0, 1, 0, 2])  # both requests let go in one event: chunk 0 freed once
    assert _usage(c) == [6, 0]


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
