"""Heuristic and production routers on hand-built router views: each rule's decision on cases
that tell it apart, masks respected, ties rotated, bad names refused."""

from __future__ import annotations

import numpy as np
import pytest

from agents.routers import ROUTERS, make_router
from burstgym.observation import RouterView
from burstgym.types import BUSY, IDLE

N = 4
MAY_IGNORE_MASK = {"round-robin", "random", "weighted-skew"}


def view(b: int = 1, n: int = N, **fields) -> RouterView:
    """A batched view of `b` clusters of `n` idle, empty nodes, with `fields` overridden
    (per-node fields as [b, n] lists or arrays, scalars as [b])."""
    z = np.zeros((b, n))
    base = dict(
        running=z, waiting=z, kv_util=z, kv_used=z, prefill_tokens=z, window_age=z,
        phase=np.full((b, n), IDLE), hit_tokens=z, cached_tokens=z, cache_used=z,
        capacity=np.ones((b, n)), accepts=np.ones((b, n), bool), block_size=np.full((b, n), 16),
        prompt=np.full(b, 1000.0), prefix_key=np.full(b, -1), step=np.zeros(b, np.int32),
        since_last=np.zeros(b), rate=np.ones(b), time_to_go=np.ones(b),
    )
    for k, v in fields.items():
        base[k] = np.broadcast_to(np.asarray(v, dtype=np.asarray(base[k]).dtype), np.shape(base[k])).copy()
    return RouterView(**base)


def pick(name: str, v: RouterView, mask=None, n: int = N) -> np.ndarray:
    router = make_router(name, n)
    router.reset(v.running.shape[0])
    return router(None, mask, v)


@pytest.mark.parametrize("name", list(ROUTERS))
def test_every_router_returns_valid_actions_and_respects_the_mask(name):
    rng = np.random.default_rng(0)
    router = make_router(name, N, seed=1)
    router.reset(32)
    for _ in range(5):
        mask = rng.random((32, N)) < 0.6
        mask[~mask.any(axis=1), 0] = True
        v = view(
            32, running=rng.integers(0, 100, (32, N)), waiting=rng.integers(0, 10, (32, N)),
            kv_util=rng.random((32, N)), prefill_tokens=rng.integers(0, 9000, (32, N)),
            hit_tokens=rng.integers(0, 1000, (32, N)), cached_tokens=rng.integers(0, 10**5, (32, N)),
            prefix_key=rng.integers(-1, 50, 32),
        )
        a = router(None, mask, v)
        assert a.shape == (32,) and a.dtype == np.int64 and ((a >= 0) & (a < N)).all()
        if name not in MAY_IGNORE_MASK:
            assert mask[np.arange(32), a].all()


def test_unknown_router_is_refused():
    with pytest.raises(ValueError, match="unknown router 'nope'.*round-robin"):
        make_router("nope", N)


def test_round_robin_cycles_and_ties_rotate():
    router = make_router("round-robin", N)
    router.reset(3)
    picks = np.stack([router(None, None, view(3)) for _ in range(8)])
    np.testing.assert_array_equal(picks[:, 0], [0, 1, 2, 3, 0, 1, 2, 3])
    jsq = make_router("jsq", N)
    jsq.reset(1)
    assert sorted(int(jsq(None, None, view())[0]) for _ in range(4)) == [0, 1, 2, 3]


def test_load_heuristics():
    assert pick("jsq", view(running=[[5, 1, 3, 9]], waiting=[[0, 2, 0, 0]]))[0] == 1
    assert pick("least-tokens", view(prefill_tokens=[[500, 900, 100, 300]]))[0] == 2
    assert pick("least-kv", view(kv_util=[[0.5, 0.4, 0.05, 0.3]]))[0] == 2
    two = make_router("power-of-two", 2)
    two.reset(16)
    assert (two(None, None, view(16, n=2, running=[[9, 1]])) == 1).all()


def test_weighted_skew_gives_node_zero_ten_percent_more():
    router = make_router("weighted-skew", N)
    router.reset(1)
    picks = np.concatenate([router(None, None, view()) for _ in range(41 * 10)])
    counts = np.bincount(picks, minlength=N)
    assert counts[0] == 110 and (counts[1:] == 100).all()


def test_pack_load_packs_under_the_cap_else_spreads():
    v = view(2, running=[[5, 7, 9, 1], [5, 7, 9, 1]], kv_util=[[0.5, 0.5, 0.95, 0.1], [0.95] * 4])
    np.testing.assert_array_equal(pick("pack-load", v), [1, 3])


def test_soonest_batch_joins_the_oldest_forming_batch():
    v = view(2, waiting=[[2, 3, 0, 1], [0, 0, 0, 0]], window_age=[[0.01, 0.02, 0, 0.04], [0] * 4],
             phase=[[IDLE, IDLE, IDLE, BUSY], [IDLE] * 4], running=[[0, 0, 0, 0], [3, 1, 2, 2]])
    np.testing.assert_array_equal(pick("soonest-batch", v), [1, 1])


def test_sglang_cache_aware():
    # balanced: the best match above 30% wins
    v = view(hit_tokens=[[0, 600, 200, 0]], running=[[10, 12, 10, 10]], cached_tokens=[[5, 9, 9, 1]])
    assert pick("sglang-cache-aware", v)[0] == 1
    # a match of at most 30% goes to the smallest tree, whatever its load (the hot-spot risk)
    v = view(hit_tokens=[[0, 300, 0, 0]], running=[[10, 12, 60, 10]], cached_tokens=[[5, 9, 1, 3]])
    assert pick("sglang-cache-aware", v)[0] == 2
    # imbalanced (100 - 20 > 64 and 100 > 1.5 x 20): least loaded, the match ignored
    v = view(hit_tokens=[[0, 900, 0, 0]], running=[[30, 100, 20, 40]])
    assert pick("sglang-cache-aware", v)[0] == 2
    # large absolute but small relative gap (200 vs 150): still balanced enough for affinity
    v = view(hit_tokens=[[0, 900, 0, 0]], running=[[150, 220, 150, 150]])
    assert pick("sglang-cache-aware", v)[0] == 1


def test_dynamo_kv_cost():
    # node 0: 0 queued, no hit: 1000/16 + 0 + 63 = 125.5; node 1: 3200 queued, 960 hit: 242.5 + 63;
    # node 2: 100 active blocks, 800 hit: 12.5 + 100 + 63 = 175.5; node 3: 50 active, 0 hit: 175.5
    v = view(prefill_tokens=[[0, 3200, 0, 0]], hit_tokens=[[0, 960, 800, 0]], kv_used=[[0, 0, 100, 50]])
    assert pick("dynamo-kv", v)[0] == 0
    v = view(hit_tokens=[[0, 960, 800, 0]], kv_used=[[70, 0, 10, 50]])  # 195.5, 65.5, 85.5, 175.5
    assert pick("dynamo-kv", v)[0] == 1


def test_llm_d_weighted_scores():
    # prefix 3 x (blocks held / 63), kv 2 x (1 - usage), queue 2 x (max - q) / (max - min)
    v = view(hit_tokens=[[0, 1008, 0, 0]], kv_util=[[0.0, 0.9, 0.0, 0.0]], waiting=[[0, 4, 2, 4]])
    # node 0: 0 + 2 + 2 = 4; node 1: 3 x 1 + 0.2 + 0 = 3.2; node 2: 2 + 1 = 3; node 3: 2 + 0 = 2
    assert pick("llm-d", v)[0] == 0
    v = view(hit_tokens=[[0, 1008, 0, 0]], kv_util=[[0.5, 0.5, 0.5, 0.5]])  # equal queues: all 1
    assert pick("llm-d", v)[0] == 1


def test_aibrix_prefix():
    # balanced: the best match among pods at most mean + std running
    v = view(hit_tokens=[[0, 500, 800, 0]], running=[[4, 5, 5, 4]])  # mean + std = 5
    assert pick("aibrix-prefix", v)[0] == 2
    # the best-matching pod is above mean + std: the next best among the rest
    v = view(hit_tokens=[[0, 500, 800, 0]], running=[[2, 3, 8, 2]])
    assert pick("aibrix-prefix", v)[0] == 1
    # imbalanced (max - min > 8): fewest running, match ignored
    v = view(hit_tokens=[[0, 500, 800, 0]], running=[[10, 12, 20, 3]])
    assert pick("aibrix-prefix", v)[0] == 3
    # no match: fewest requests
    v = view(running=[[4, 5, 6, 4]], waiting=[[2, 1, 0, 0]])
    assert pick("aibrix-prefix", v)[0] == 3


def test_prefix_hash_is_sticky_and_walks_past_full_nodes():
    keys = np.arange(40)
    v = view(40, prefix_key=keys)
    first = pick("prefix-hash", v)
    busy = view(40, prefix_key=keys, running=np.ones((40, N)))
    np.testing.assert_array_equal(pick("prefix-hash", busy), first)  # load does not move a key
    assert len(set(first.tolist())) == N  # the ring spreads keys over every node
    mask = np.ones((40, N), bool)
    mask[np.arange(40), first] = False
    moved = pick("prefix-hash", v, mask)
    assert (moved != first).all() and mask[np.arange(40), moved].all()
    # no prefix: fewest requests
    assert pick("prefix-hash", view(running=[[3, 1, 2, 2]]))[0] == 1


def test_secondary_keys_are_exact_tie_breaks_in_float32():
    def f32(v: RouterView) -> RouterView:
        return RouterView(*(x.astype(np.float32) if x.dtype == np.float64 else x for x in v))

    # one KV block less (of 28755) beats 40 fewer requests: KV usage first, requests only on ties
    v = f32(view(kv_used=[[1000, 1001, 9000, 9000]], kv_util=[[1000 / 28755, 1001 / 28755, 0.3, 0.3]],
                 running=[[40, 0, 0, 0]]))
    assert pick("least-kv", v)[0] == 0
    # equal prompt backlogs too large for an additive epsilon in float32: fewer requests wins
    v = f32(view(prefill_tokens=[[70000, 70000, 90000, 90000]], running=[[3, 1, 0, 0]]))
    assert pick("least-tokens", v)[0] == 1


def test_sglang_sees_imbalance_on_every_worker_and_aibrix_uses_the_sample_std():
    # the full (masked) worker still counts for imbalance, as in SGLang: 200 - 10 > 64, 200 > 15
    mask = np.array([[True, True, True, False]])
    v = view(running=[[10, 12, 14, 200]], hit_tokens=[[0, 0, 900, 900]])
    assert pick("sglang-cache-aware", v, mask)[0] == 0
    # loads [0, 0, 6, 7]: mean + sample std = 7.02 keeps node 3 (population std: 6.52 would not)
    v = view(running=[[0, 0, 6, 7]], hit_tokens=[[0, 0, 0, 900]])
    assert pick("aibrix-prefix", v)[0] == 3
