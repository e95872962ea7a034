"""What a router sees of the cluster's load and speed, and how skew is counted: the arrival-rate
estimate starts at the scenario's rate (not near 0), each node's capacity is an observation
feature (so an equivariant policy can tell fast nodes from slow), and the skew index counts only
routing away from each node's share of the capacity."""

from __future__ import annotations

import gymnasium as gym
import numpy as np
import pytest

import burstgym  # noqa: F401  (registers BurstBalance-v0)
from burstgym.observation import GLOBAL_FEATURES, NODE_FEATURES, node_features

# Two nodes, the second's iterations twice as long; light load so that no request is refused.
HETERO = dict(scenario="steady", n_nodes=2, speed=(1.0, 2.0), episode_length=96, load=0.3)


def test_arrival_rate_estimate_starts_at_the_scenario_rate_and_tracks_it() -> None:
    """At reset the `arrival_rate` feature is the scenario's rate over the cluster's capacity (its
    load), and over a steady episode it stays near it; an estimate started at 0 reads ~0 at first."""
    env = gym.make("BurstBalance-v0", scenario="steady", n_nodes=4, episode_length=256, load=0.7)
    at = 4 * len(NODE_FEATURES) + GLOBAL_FEATURES.index("arrival_rate")
    obs, _ = env.reset(seed=3)
    p = env.unwrapped.params
    assert obs[at] == pytest.approx(float(p.arrival_rate / p.capacity_rate), rel=1e-5)
    assert obs[at] == pytest.approx(0.7, rel=1e-5)
    seen = [obs[at]]
    for k in range(255):
        obs, *_ = env.step(k % 4)
        seen.append(obs[at])
    first, second = np.mean(seen[:128]), np.mean(seen[128:])
    assert 0.5 < first < 0.9 and 0.5 < second < 0.9, (first, second)


def test_capacity_feature_tells_fast_nodes_from_slow() -> None:
    """`capacity` is each node's capacity over the cluster mean: 1 everywhere on identical nodes,
    and on a cluster whose second node runs at half speed, about 4/3 and 2/3."""
    same = gym.make("BurstBalance-v0", **{**HETERO, "speed": 1.0})
    obs, _ = same.reset(seed=0)
    col = NODE_FEATURES.index("capacity")
    np.testing.assert_allclose(node_features(obs, 2)[:, col], 1.0)
    env = gym.make("BurstBalance-v0", **HETERO)
    obs, _ = env.reset(seed=0)
    cap = np.asarray(env.unwrapped.params.nodes.capacity_rps)
    feature = node_features(obs, 2)[:, col]
    np.testing.assert_allclose(feature, cap / cap.mean(), rtol=1e-5)
    np.testing.assert_allclose(feature, [4 / 3, 2 / 3], rtol=0.05)
    obs, *_ = env.step(0)  # a static feature: routing does not move it
    np.testing.assert_allclose(node_features(obs, 2)[:, col], feature, rtol=1e-6)


def test_skew_index_counts_departures_from_capacity_shares() -> None:
    """Routing in proportion to capacity (two to the fast node for one to the slow) is not skew;
    round-robin over unequal nodes is (shares 1/2, 1/2 against 2/3, 1/3: CV of 0.75 and 1.5)."""
    env = gym.make("BurstBalance-v0", **HETERO)
    cap = np.asarray(env.unwrapped.params.nodes.capacity_rps)
    n = HETERO["episode_length"]

    def skew(actions: list[int]) -> float:
        env.reset(seed=1)
        for a in actions:
            *_, info = env.step(a)
        return float(info["metrics"]["skew_index"])

    def expected(shares: list[float]) -> float:  # CV of the shares over the capacity shares
        rel = np.array(shares) / (cap / cap.sum())
        return float(np.std(rel) / np.mean(rel))

    proportional = skew([0, 0, 1] * (n // 3))
    assert proportional == pytest.approx(expected([2 / 3, 1 / 3]), abs=1e-5)
    assert proportional < 0.05, (proportional, cap)  # exactly 0 only if the capacities are exactly 2:1
    balanced = skew([0, 1] * (n // 2))
    assert balanced == pytest.approx(expected([0.5, 0.5]), abs=1e-5)
    assert balanced > 0.3
