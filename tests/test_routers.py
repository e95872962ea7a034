"""Every router on hand-built router views, through the batched NumPy face derived from its JAX
rule (`agents.routers.make_router`): each rule's decision on cases that tell it apart, masks
respected, ties broken as the rule's source breaks them, bad names and parameters refused, and the
registry (names, families, one module per router)."""

from __future__ import annotations

import numpy as np
import pytest

from agents.routers import ROUTERS, BatchedRouter, make_router, make_rule
from agents.routers.base import Affinity
from burstgym.observation import RouterView
from burstgym.routing import FAMILIES, Router, takes_part
from burstgym.types import BUSY, IDLE

N = 4
MAY_IGNORE_MASK = {"round-robin", "random", "weighted-skew"}


def view(b: int = 1, n: int = N, **fields) -> RouterView:
    """A batched view of `b` clusters of `n` idle, empty nodes, with `fields` overridden
    (per-node fields as [b, n] lists or arrays, scalars as [b])."""
    z = np.zeros((b, n))
    base = dict(
        running=z, waiting=z, kv_util=z, kv_used=z, prefill_tokens=z, prompt_tokens=z, window_age=z,
        phase=np.full((b, n), IDLE), hit_tokens=z, cached_tokens=z, cache_used=z,
        capacity=np.ones((b, n)), prefill_rate=np.full((b, n), 10_000.0),
        kv_tokens=np.full((b, n), 460_080.0), accepts=np.ones((b, n), bool),
        block_size=np.full((b, n), 16), prompt=np.full(b, 1000.0), prefix_key=np.full(b, -1),
        chunk_ids=np.full((b, 0), -1, np.int32), chunk_end=np.zeros((b, 0), np.int32),
        step=np.ones(b, np.int32), since_last=np.zeros(b), rate=np.ones(b), time_to_go=np.ones(b),
        clock=np.zeros(b),
    )  # fmt: skip
    for k, v in fields.items():
        if k in ("chunk_ids", "chunk_end"):  # [b, B]: as many chunks as given
            base[k] = np.asarray(v, np.int32)
            continue
        base[k] = np.broadcast_to(np.asarray(v, dtype=np.asarray(base[k]).dtype), np.shape(base[k])).copy()
    return RouterView(**base)


def pick(name: str, v: RouterView, mask=None, n: int = N, **params) -> np.ndarray:
    """The router's actions on `v`; a prefix-aware rule reads the view's cache (`hit_tokens`,
    `cached_tokens`) unless told otherwise: these cases give each node's match directly (the
    routers' own indexes are tested at the end)."""
    if issubclass(ROUTERS[name], Affinity):
        params.setdefault("cache_view", "engine")
    router = make_router(name, n, **params)
    router.reset(v.running.shape[0])
    return router(None, mask, v)


def frequencies(name: str, v: RouterView, draws: int = 4000, **params) -> np.ndarray:
    """How often each node is picked for the same view over `draws` clusters."""
    b = draws
    big = RouterView(*(np.repeat(np.asarray(x), b, axis=0) for x in v))
    return np.bincount(pick(name, big, **params), minlength=N) / b


def test_registry_names_families_and_protocol():
    assert len(ROUTERS) >= 20 and list(ROUTERS)[0] == "round-robin"
    for name, cls in ROUTERS.items():
        rule = make_rule(name)
        assert rule.name == name and cls.family in FAMILIES
        assert isinstance(rule, Router)
        assert hash(rule) == hash(make_rule(name))  # a static argument of jit
    families = {cls.family for cls in ROUTERS.values()}
    assert {"balancing", "batching", "affinity"} <= families
    assert not takes_part(make_rule("soonest-batch"), "continuous") and takes_part(
        make_rule("jsq"), "dynamic"
    )


@pytest.mark.parametrize("name", list(ROUTERS))
def test_every_router_returns_valid_actions_and_respects_the_mask(name):
    rng = np.random.default_rng(0)
    router = make_router(name, N, seed=1)
    assert isinstance(router, BatchedRouter) and router.family == ROUTERS[name].family
    router.reset(32)
    for step in range(5):
        mask = rng.random((32, N)) < 0.6
        mask[~mask.any(axis=1), 0] = True
        v = view(
            32, running=rng.integers(0, 100, (32, N)), waiting=rng.integers(0, 10, (32, N)),
            kv_util=rng.random((32, N)), prefill_tokens=rng.integers(0, 9000, (32, N)),
            prompt_tokens=rng.integers(0, 90000, (32, N)), hit_tokens=rng.integers(0, 1000, (32, N)),
            cached_tokens=rng.integers(0, 10**5, (32, N)), prefix_key=rng.integers(-1, 50, 32), step=step,
        )  # fmt: skip
        a = router(None, mask, v)
        assert a.shape == (32,) and a.dtype == np.int64 and ((a >= 0) & (a < N)).all()
        if name not in MAY_IGNORE_MASK:
            assert mask[np.arange(32), a].all()


def test_bad_names_and_parameters_are_refused():
    with pytest.raises(ValueError, match="unknown router 'nope'.*round-robin"):
        make_router("nope", N)
    with pytest.raises(ValueError, match="router 'dynamo-kv' has no parameter 'temprature'.*temperature"):
        make_rule("dynamo-kv", temprature=1.0)
    router = make_router("jsq", N)
    router.reset(2)
    with pytest.raises(ValueError, match="a batch of 1 views for a router reset for 2"):
        router(None, None, view())


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
    assert (pick("power-of-two", view(16, n=2, running=[[9, 1]]), n=2) == 1).all()
    # AIBrix least-request: fewest in flight, ties at random
    assert pick("aibrix-least-request", view(running=[[5, 1, 3, 9]], waiting=[[0, 1, 0, 0]]))[0] == 1
    freq = frequencies("aibrix-least-request", view(running=[[2, 1, 1, 1]]))
    assert freq[0] == 0 and np.all(np.abs(freq[1:] - 1 / 3) < 0.04)


def test_weighted_skew_gives_node_zero_ten_percent_more():
    router = make_router("weighted-skew", N)
    router.reset(1)
    picks = np.concatenate([router(None, None, view(step=k + 1)) for k in range(41 * 10)])
    counts = np.bincount(picks, minlength=N)
    assert counts[0] == 110 and (counts[1:] == 100).all()


def test_pack_load_packs_under_the_cap_else_spreads():
    v = view(2, running=[[5, 7, 9, 1], [5, 7, 9, 1]], kv_util=[[0.5, 0.5, 0.95, 0.1], [0.95] * 4])
    np.testing.assert_array_equal(pick("pack-load", v), [1, 3])


def test_soonest_batch_joins_the_oldest_forming_batch():
    v = view(2, waiting=[[2, 3, 0, 1], [0, 0, 0, 0]], window_age=[[0.01, 0.02, 0, 0.04], [0] * 4],
             phase=[[IDLE, IDLE, IDLE, BUSY], [IDLE] * 4], running=[[0, 0, 0, 0], [3, 1, 2, 2]])  # fmt: skip
    np.testing.assert_array_equal(pick("soonest-batch", v), [1, 1])


@pytest.mark.parametrize("name", ["sglang-cache-aware", "vllm-router"])
def test_sglang_cache_aware_sends_misses_to_the_least_loaded_worker(name):
    # balanced: the best match above 30% wins
    v = view(hit_tokens=[[0, 600, 200, 0]], running=[[10, 12, 10, 10]], cached_tokens=[[5, 9, 9, 1]])
    assert pick(name, v)[0] == 1
    # a match of at most 30% goes to the least loaded worker (smg PR #14650), not the smallest tree
    v = view(hit_tokens=[[0, 300, 0, 0]], running=[[10, 12, 60, 10]], cached_tokens=[[5, 9, 1, 3]])
    assert pick(name, v)[0] == 0  # workers 0 and 3 tie on load: the first wins (min_by_key)
    # imbalanced (100 - 20 > 64 and 100 > 1.5 x 20): least loaded, the match ignored
    v = view(hit_tokens=[[0, 900, 0, 0]], running=[[30, 100, 20, 40]])
    assert pick(name, v)[0] == 2
    # large absolute but small relative gap (220 vs 150): still balanced enough for affinity
    v = view(hit_tokens=[[0, 900, 0, 0]], running=[[150, 220, 150, 150]])
    assert pick(name, v)[0] == 1
    # the full (masked) worker still counts for imbalance: 200 - 10 > 64, 200 > 15
    v = view(running=[[10, 12, 14, 200]], hit_tokens=[[0, 0, 900, 900]])
    assert pick(name, v, np.array([[True, True, True, False]]))[0] == 0


def test_sglang_old_rule_sends_misses_to_the_smallest_tree():
    v = view(hit_tokens=[[0, 300, 0, 0]], running=[[10, 12, 60, 10]], cached_tokens=[[5, 9, 1, 3]])
    assert pick("sglang-cache-aware-v0.2.3", v)[0] == 2  # whatever its load (the hot-spot risk)
    v = view(hit_tokens=[[0, 600, 200, 0]], running=[[10, 12, 10, 10]], cached_tokens=[[5, 9, 9, 1]])
    assert pick("sglang-cache-aware-v0.2.3", v)[0] == 1


def test_dynamo_kv_cost_temperature_and_busy_thresholds():
    # node 0: 0 queued, no hit: 1000/16 + 0 + 63 = 125.5; node 1: 3200 queued, 960 hit: 202.5 + 63;
    # node 2: 100 active blocks, 800 hit: 12.5 + 100 + 63 = 175.5; node 3: 50 active, 0 hit: 175.5
    v = view(prefill_tokens=[[0, 3200, 0, 0]], hit_tokens=[[0, 960, 800, 0]], kv_used=[[0, 0, 100, 50]])
    assert pick("dynamo-kv", v)[0] == 0
    v = view(hit_tokens=[[0, 960, 800, 0]], kv_used=[[70, 0, 10, 50]])  # 195.5, 65.5, 85.5, 175.5
    assert pick("dynamo-kv", v)[0] == 1
    # ties at temperature 0 go to the smallest tree
    v = view(cached_tokens=[[9, 9, 1, 9]])
    assert pick("dynamo-kv", v)[0] == 2
    # temperature 1: softmax of -(cost - min) / range over the costs 195.5, 65.5, 85.5, 175.5
    costs = np.array([195.5, 65.5, 85.5, 175.5])
    p = np.exp(-(costs - costs.min()) / (costs.max() - costs.min()))
    v = view(hit_tokens=[[0, 960, 800, 0]], kv_used=[[70, 0, 10, 50]])
    freq = frequencies("dynamo-kv", v, temperature=1.0)
    np.testing.assert_allclose(freq, p / p.sum(), atol=0.03)
    # a node above the busy threshold is excluded; all busy: routed by cost among all
    v = view(hit_tokens=[[0, 960, 800, 0]], kv_used=[[70, 0, 10, 50]], kv_util=[[0.1, 0.95, 0.2, 0.1]])
    assert pick("dynamo-kv", v, busy_kv_fraction=0.9)[0] == 2
    v = v._replace(kv_util=np.full((1, N), 0.99))
    assert pick("dynamo-kv", v, busy_kv_fraction=0.9)[0] == 1


def test_llm_d_affinity_filter_then_token_load():
    # node 1 holds 63 of the 63 blocks: sticky; it carries more in-flight tokens but within 5 s
    v = view(hit_tokens=[[0, 1008, 0, 0]], prompt_tokens=[[0, 4000, 0, 0]])
    for name in ("llm-d", "llm-d-precise"):
        freq = frequencies(name, v)
        assert freq[1] > 0.97  # exploration skips the filter in 1% of requests (then least load)
    # the sticky node's predicted TTFT is 2.5 x 40000 / 10000 = 10 s above the others': filter off
    v = view(64, hit_tokens=[[0, 1008, 0, 0]], prompt_tokens=[[400, 40000, 0, 800]])
    assert np.all(pick("llm-d", v) == 2)
    # token load with equal loads: ties at random
    freq = frequencies("llm-d", view(prompt_tokens=[[10, 0, 0, 10]]))
    assert freq[0] == freq[3] == 0 and abs(freq[1] - 0.5) < 0.04


def test_epp_default_weighted_scores():
    # prefix 3 x (blocks held / 63), kv 2 x (1 - usage), queue 2 x (max - q) / (max - min)
    v = view(hit_tokens=[[0, 1008, 0, 0]], kv_util=[[0.0, 0.9, 0.0, 0.0]], waiting=[[0, 4, 2, 4]])
    # node 0: 0 + 2 + 2 = 4; node 1: 3 x 1 + 0.2 + 0 = 3.2; node 2: 2 + 1 = 3; node 3: 2 + 0 = 2
    assert pick("epp-default", v)[0] == 0
    v = view(hit_tokens=[[0, 1008, 0, 0]], kv_util=[[0.5, 0.5, 0.5, 0.5]])  # equal queues: all 1
    assert pick("epp-default", v)[0] == 1


def test_aibrix_prefix():
    # balanced: the best match among pods at most mean + sample std requests (4, 5, 5, 4: 5.08)
    v = view(hit_tokens=[[0, 500, 800, 0]], running=[[4, 5, 5, 4]])
    assert pick("aibrix-prefix", v)[0] == 2
    # the best-matching pod is above mean + std (2, 3, 8, 2: 6.85 < 8): the next best
    v = view(hit_tokens=[[0, 500, 800, 0]], running=[[2, 3, 8, 2]])
    assert pick("aibrix-prefix", v)[0] == 1
    # imbalanced (12 - 3 > 8): only the pods with the fewest are candidates; node 3 matches nothing
    v = view(hit_tokens=[[0, 500, 800, 0]], running=[[10, 12, 11, 3]])
    assert pick("aibrix-prefix", v)[0] == 3
    # imbalanced with a match among the least loaded: it wins
    v = view(hit_tokens=[[0, 500, 800, 100]], running=[[10, 12, 11, 3]], waiting=[[0, 0, 0, 0]])
    assert pick("aibrix-prefix", v)[0] == 3
    # no match: fewest in flight (running + waiting)
    v = view(running=[[4, 5, 6, 4]], waiting=[[2, 1, 0, 0]])
    assert pick("aibrix-prefix", v)[0] == 3
    # loads [0, 0, 6, 7]: mean + sample std = 7.02 keeps node 3 (population std: 6.52 would not)
    v = view(running=[[0, 0, 6, 7]], hit_tokens=[[0, 0, 0, 900]])
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
    assert pick("prefix-hash", view(running=[[3, 1, 2, 2]]))[0] == 1  # no prefix: fewest requests


def test_prefix_aware_picks_among_the_longest_matches_at_random_whatever_the_load():
    freq = frequencies("prefix-aware", view(hit_tokens=[[0, 512, 512, 0]], running=[[0, 90, 90, 0]]))
    assert freq[0] == freq[3] == 0 and abs(freq[1] - 0.5) < 0.04
    freq = frequencies("prefix-aware", view(running=[[0, 90, 90, 0]]))
    assert np.all(np.abs(freq - 0.25) < 0.04)


def test_lmetric_multiplies_new_prefill_tokens_by_requests_in_flight():
    # (1000 - hit) x requests: 1000 x 2, 488 x 5, 0 x 9, 1000 x 0 -> node 2 (0) ties node 3 (0):
    # fewer new tokens wins
    v = view(hit_tokens=[[0, 512, 1000, 0]], running=[[2, 5, 9, 0]])
    assert pick("lmetric", v)[0] == 2
    v = view(hit_tokens=[[0, 512, 512, 0]], running=[[2, 3, 5, 1]])  # 2000, 1464, 2440, 1000
    assert pick("lmetric", v)[0] == 3


# ------------------------------------------------------------------ the routers' own cache index


def chunked(
    ids: list[int], prompt: float = 1000.0, step: int = 1, clock: float = 0.0, **fields
) -> RouterView:
    """One cluster's view of a request whose prompt is made of the chunk ids `ids` (250 tokens
    each), with an empty engine cache unless `fields` say otherwise."""
    b = len(ids)
    ends = np.minimum(250 * np.arange(1, b + 1), prompt)
    return view(
        1,
        prompt=[prompt],
        chunk_ids=np.asarray([ids], np.int32),
        chunk_end=np.asarray([ends], np.int32),
        step=[step],
        clock=[clock],
        **fields,
    )


class Episode:
    """A batched router stepped through requests of one cluster."""

    def __init__(self, name: str, **params):
        self.router = make_router(name, N, **params)
        self.router.reset(1)
        self.step = 0

    def __call__(self, ids: list[int], **fields) -> int:
        v = chunked(ids, step=self.step, **fields)
        self.step += 1
        return int(self.router(None, None, v)[0])


def test_router_view_matches_what_it_routed_at_routing_time():
    """SGLang's tree holds a prompt from the moment it routes it: a request sharing its first two
    chunks follows it even though the engine has cached nothing yet; reading the engine's cache
    instead, it goes to the least loaded node."""
    for name in ("sglang-cache-aware", "vllm-router", "prefix-aware"):
        ep = Episode(name)
        first = ep([1, 2, 3, 4], running=[[5, 5, 0, 5]])  # a miss: the least loaded, node 2
        assert first == 2
        assert ep([1, 2, 9, 10], running=[[0, 5, 6, 5]]) == 2  # 500 of 1000 tokens held there
        engine = Episode(name, cache_view="engine")
        engine([1, 2, 3, 4], running=[[5, 5, 0, 5]])
        assert engine([1, 2, 9, 10], running=[[0, 5, 6, 5]]) in (
            (0,) if name != "prefix-aware" else (0, 1, 2, 3)
        )
    assert make_rule("sglang-cache-aware", cache_view="engine").name == "sglang-cache-aware@engine"
    assert make_rule("dynamo-kv", cache_view="engine").name == "dynamo-kv"  # it reads KV events anyway
    with pytest.raises(ValueError, match="cache_view must be one of router, engine"):
        make_rule("llm-d", cache_view="tree")


def test_router_index_forgets_a_new_episode_and_tracks_tree_size():
    ep = Episode("sglang-cache-aware-v0.2.3")
    assert ep([1, 2, 3, 4], running=[[5, 5, 0, 5]]) == 0  # a miss goes to the smallest tree: all 0
    # node 0 now holds 1000 tokens: the next miss goes to node 1 (smallest tree, first of the ties)
    assert ep([7, 8, 9, 10], running=[[0, 9, 9, 9]]) == 1
    ep.step = 0  # an auto-reset: chunk ids of the new episode mean other prompts
    assert ep([1, 2, 3, 4], running=[[5, 5, 5, 5]]) == 0


def test_llm_d_index_is_an_lru_sized_to_the_node_kv_cache():
    ep = Episode("llm-d")
    loads = [[0, 0, 0, 9000]]  # node 3 carries in-flight tokens: routed elsewhere unless sticky
    node = ep([1, 2, 3, 4], prompt_tokens=loads, kv_tokens=[[2000.0] * N])
    assert ep([1, 2, 3, 4], prompt_tokens=loads, kv_tokens=[[2000.0] * N]) == node  # sticky
    # 2000 KV tokens hold 8 chunks of 250: after 2 more prompts of 4 chunks on that node, the
    # first prompt's chunks are gone and it is not sticky any more
    for ids in ([11, 12, 13, 14], [21, 22, 23, 24]):
        ep(ids, prompt_tokens=[[0 if i == node else 9000 for i in range(N)]], kv_tokens=[[2000.0] * N])
    others = [[9000 if i == node else 0 for i in range(N)]]
    freq = [ep([1, 2, 3, 4], prompt_tokens=others, kv_tokens=[[2000.0] * N]) for _ in range(1)]
    assert freq[0] != node


def test_aibrix_index_is_shared_by_every_pod_and_forgets_after_twenty_minutes():
    ep = Episode("aibrix-prefix")
    a = ep([1, 2, 3, 4], running=[[0, 1, 1, 1]])
    assert a == 0  # no match anywhere: the fewest requests
    # the same prompt prefix, node 2 least loaded but node 0 within mean + std (1.75 + 0.5): the
    # match wins
    assert ep([1, 2, 5, 6], running=[[2, 2, 1, 2]], clock=60.0) == 0
    # node 0 above mean + std (3.5 + 3.7): the fewest requests, node 2, which records chunks 1, 2
    # beside node 0's in the one shared table
    assert ep([1, 2, 7, 8], running=[[9, 2, 1, 2]], clock=61.0) == 2
    # chunks 1, 2 now match on nodes 0 and 2; node 0 too busy: node 2, not a random least loaded
    assert ep([1, 2, 11, 12], running=[[9, 2, 2, 2]], clock=62.0) == 2
    # 20 minutes after their last use the index has forgotten them: the fewest requests
    assert ep([1, 2, 5, 6], running=[[2, 2, 1, 2]], clock=62.0 + 1201.0) == 2
    # a second later nodes 0 and 2 hold the whole prompt again (node 0's bits were kept with
    # chunks 1, 2, whose use by node 2 refreshed them): equal matches, node 0 has fewer requests
    assert ep([1, 2, 5, 6], running=[[1, 2, 2, 2]], clock=62.0 + 1202.0) == 0
