"""Memory of the JAX rollout: the vmapped group size fitted to a memory budget from the compiled
program's own analysis (`burstgym.rollout.fit_chunk`), a cluster's state, whose prefix cache
does not grow with the episode, and the routers' states, returned only when asked."""

from __future__ import annotations

from types import SimpleNamespace

import jax
import numpy as np
import pytest

from agents.predicted_latency import warm_samples
from agents.routers import make_rule
from burstgym import scenarios
from burstgym.env import BurstBalance
from burstgym.rollout import fit_chunk, rollout


def _fake_compiler(resident: int, per_cluster: int):
    """`compile_at` whose program needs `resident + k * per_cluster` bytes, recording each k."""
    asked: list[int] = []

    def compile_at(k: int):
        asked.append(k)
        stats = SimpleNamespace(
            argument_size_in_bytes=resident,
            output_size_in_bytes=k * per_cluster // 2,
            temp_size_in_bytes=k * per_cluster - k * per_cluster // 2,
            alias_size_in_bytes=0,
        )
        return SimpleNamespace(memory_analysis=lambda: stats), 1.0

    return compile_at, asked


def test_fit_chunk_takes_all_at_once_when_it_fits() -> None:
    compile_at, asked = _fake_compiler(resident=1000, per_cluster=10)
    k, _, seconds = fit_chunk(64, compile_at, budget=1000 + 64 * 10, resident=1000)
    assert (k, asked, seconds) == (64, [64], 1.0)


def test_fit_chunk_shrinks_to_the_largest_divisor_that_fits() -> None:
    """The first analysis predicts the size (need linear in k): 64 clusters at 100 bytes each over
    1,000 resident, budget 3,500: 25 would fit, the largest divisor of 64 below it is 16."""
    compile_at, asked = _fake_compiler(resident=1000, per_cluster=100)
    k, compiled, seconds = fit_chunk(64, compile_at, budget=3500, resident=1000)
    assert k == 16 and asked == [64, 16] and seconds == 2.0
    assert compiled.memory_analysis().temp_size_in_bytes + 1000 + 800 <= 3500


def test_fit_chunk_at_most_halves_and_stops_at_one() -> None:
    """A prediction that overshoots (need not linear in k beyond what is resident) moves at most
    to half the last size; when nothing fits, the answer is 1."""
    compile_at, asked = _fake_compiler(resident=5000, per_cluster=10)
    k, _, _ = fit_chunk(64, compile_at, budget=5200, resident=10)  # 5,000 fixed, told 10
    assert k == 16 and asked == [64, 32, 16]
    compile_at, asked = _fake_compiler(resident=10**6, per_cluster=1)
    k, _, seconds = fit_chunk(12, compile_at, budget=100, resident=10)
    assert k == 1 and asked == [12, 1] and seconds == 2.0


def _state_bytes(**settings) -> tuple[int, int]:
    """(bytes of a `prefix` cluster's prefix cache, bytes of its whole state) after reset, from
    shapes alone (nothing runs)."""
    cfg, params = scenarios.make("prefix", **settings)
    _, state = jax.eval_shape(lambda k: BurstBalance(cfg).reset(k, params), jax.random.key(0))
    size = lambda tree: sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))  # noqa: E731
    return size(state.cache), size(state)


def test_a_clusters_prefix_cache_does_not_grow_with_the_episode_or_its_prefixes() -> None:
    """The cache is a table sized from the nodes' KV blocks: the same bytes for 128 or 4,096
    arrivals and for 4 or 256 distinct shared prefixes; the rest of the state (the episode's
    request stream and log, one row per arrival, and slot tables capped by the running set and
    queue) grows at most in proportion to the episode."""
    cache, total = zip(*(_state_bytes(episode_length=e) for e in (128, 1024, 4096)), strict=True)
    assert cache[0] == cache[1] == cache[2]
    assert (total[2] - cache[2]) <= 4 * (total[1] - cache[1]) <= 32 * (total[0] - cache[0])
    few, many = _state_bytes(prefix_groups=4)[0], _state_bytes(prefix_groups=256)[0]
    assert few == many == cache[0]


def test_router_states_are_returned_only_when_asked() -> None:
    """Every cluster carries the state of every router in the call (a prefix-aware rule's own
    index is megabytes), so the episode outputs them only with `keep_router_state`: without it the
    compiled episode's memory does not hold them, and the episodes are the same."""
    cfg, params = scenarios.make("steady", episode_length=8)
    rules = [make_rule("round-robin"), make_rule("sglang-cache-aware")]
    plain = rollout(cfg, params, rules, [0, 1], threads=1)
    kept = rollout(cfg, params, rules, [0, 1], threads=1, keep_router_state=True)
    assert plain.router_state is None
    assert len(kept.router_state) == len(rules)
    leaves = jax.tree.leaves(kept.router_state)
    assert all(x.shape[0] == 4 for x in leaves)
    np.testing.assert_array_equal(plain.objective, kept.objective)
    np.testing.assert_array_equal(plain.node, kept.node)
    held = sum(x.nbytes for x in leaves)
    assert held > 4 * 2**20  # the two sglang-cache-aware clusters' indexes alone
    assert plain.memory_bytes <= kept.memory_bytes - held


def test_warm_samples_refuses_a_batch_without_router_states() -> None:
    cfg, params = scenarios.make("steady", episode_length=8)
    batch = rollout(cfg, params, [make_rule("round-robin")], [0], threads=1)
    with pytest.raises(ValueError, match="keep_router_state=True"):
        warm_samples(cfg, params, batch, [0])
