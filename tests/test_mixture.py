"""The training distribution (`burstgym.mixture`), its vector env and the grouped teacher."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from burstgym import mixture, scenarios


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**32 - 1))
def test_draws_stay_in_the_documented_ranges_and_are_valid_settings(seed):
    for g in mixture.draw(seed, 3):
        assert set(g) <= set(mixture.DRAWN)
        assert 0.3 <= g["load"] <= 1.0 and 1.0 <= g["burst_ratio"] <= 16.0
        assert 1.0 <= g["burst_on"] <= 4.0 and 2.0 <= g["burst_off"] <= 10.0
        assert 64.0 <= g["prompt_median"] <= 1024.0 and 32.0 <= g["output_median"] <= 512.0
        assert g["prefix_share"] == 0.0 or 0.3 <= g["prefix_share"] <= 1.0
        if g["prefix_share"]:
            assert 8 <= g["prefix_groups"] <= 512 and 0.6 <= g["prefix_zipf"] <= 1.4
            assert 256.0 <= g["prefix_median"] <= 4096.0
        assert all(0.5 <= v <= 1.5 for v in g.get("speed", [1.0])) and len(g.get("speed", [0] * 4)) == 4
        assert 0.0 <= g.get("signal_interval", 0.0) <= 1.0
        scenarios.settings_for(mixture.BASE, **g)  # valid overrides of the base scenario


def test_draws_are_reproducible_and_differ_between_seeds():
    assert mixture.draw(3, 4) == mixture.draw(3, 4)
    assert mixture.draw(3, 4) != mixture.draw(4, 4)
    assert mixture.draw(3, 2) == mixture.draw(3, 4)[:2]  # more groups extend, never reshuffle
    with pytest.raises(ValueError, match="at least one group"):
        mixture.draw(0, 0)


def test_the_distribution_covers_its_regimes():
    groups = mixture.draw(0, 400)
    share = np.array([g["prefix_share"] for g in groups])
    assert 0.15 < np.mean(share == 0) < 0.35  # a quarter without shared prefixes
    assert 0.35 < np.mean(["speed" in g for g in groups]) < 0.65  # half heterogeneous
    assert 0.2 < np.mean(["signal_interval" in g for g in groups]) < 0.45  # a third stale
    loads = np.array([g["load"] for g in groups])
    assert loads.min() < 0.35 and loads.max() > 0.95


# Both vector-env tests build the same groups and batch shapes in one worker, so the second reuses
# the first's compiled steps.
GROUPS = [
    {"prefix_share": 0.0, "load": 0.5},
    {"prefix_share": 1.0, "prefix_groups": 8, "load": 0.8, "speed": [0.5, 1.0, 1.0, 1.5]},
]


@pytest.mark.xdist_group("mixture-env")
def test_mixture_vec_env_steps_each_group_as_its_own_vec_env():
    """Group g's clusters take consecutive places and step exactly as a JaxVecEnv of that group
    (seeded with the spawned seed) would, the groups stepped from two threads at once; views
    come per group, since their shapes differ."""
    from agents.sb3_vec_env import JaxVecEnv, MixtureVecEnv

    groups = GROUPS
    env = MixtureVecEnv(5, groups, "bursty", seed=7, threads=2, episode_length=12)
    assert env.sizes == [3, 2] and env.num_envs == 5
    seeds = MixtureVecEnv._spawn(7, 2)
    alone = [
        JaxVecEnv(n, "bursty", seed=s, episode_length=12, **g)
        for n, s, g in zip([3, 2], seeds, groups, strict=True)
    ]
    obs = env.reset()
    np.testing.assert_array_equal(obs, np.concatenate([e.reset() for e in alone]))
    rng = np.random.default_rng(0)
    for _ in range(30):
        actions = rng.integers(0, env.n_nodes, size=5)
        got = env.step(actions)
        want = [e.step(actions[sl]) for e, sl in zip(alone, [slice(0, 3), slice(3, 5)], strict=True)]
        np.testing.assert_array_equal(got[0], np.concatenate([w[0] for w in want]))
        np.testing.assert_array_equal(got[1], np.concatenate([w[1] for w in want]))
        np.testing.assert_array_equal(got[2], np.concatenate([w[2] for w in want]))
        assert len(got[3]) == 5
    np.testing.assert_array_equal(env.action_masks(), np.concatenate([e.action_masks() for e in alone]))
    views = env.router_views()
    assert len(views) == 2 and views[0].running.shape == (3, env.n_nodes)
    with pytest.raises(ValueError, match=r"n_envs \(1\) must be at least the mixture's groups \(2\)"):
        MixtureVecEnv(1, groups, "bursty", episode_length=12)
    with pytest.raises(ValueError, match="threads must be at least 1, got 0"):
        MixtureVecEnv(5, groups, "bursty", threads=0, episode_length=12)


@pytest.mark.xdist_group("mixture-env")
def test_grouped_router_acts_as_each_groups_router():
    from agents.routers import BatchedRouter, GroupedRouter
    from agents.sb3_vec_env import MixtureVecEnv
    from agents.warm_start import teacher

    env = MixtureVecEnv(5, GROUPS, "bursty", seed=1, episode_length=12)
    parts = [BatchedRouter(teacher("marginal-cost", e.venv.cfg, e.venv.params), 4) for e in env.subs]
    grouped = GroupedRouter(parts, env.sizes)
    singles = [BatchedRouter(teacher("marginal-cost", e.venv.cfg, e.venv.params), 4) for e in env.subs]
    obs = env.reset()
    grouped.reset(5)
    singles[0].reset(3, np.arange(0, 3))
    singles[1].reset(2, np.arange(3, 5))
    for _ in range(20):
        views, mask = env.router_views(), env.action_masks()
        actions = grouped(obs, mask, views)
        want = np.concatenate(
            [
                r(None, mask[sl], v)
                for r, sl, v in zip(singles, [slice(0, 3), slice(3, 5)], views, strict=True)
            ]
        )
        np.testing.assert_array_equal(actions, want)
        obs, *_ = env.step(actions)
    with pytest.raises(ValueError, match="a batch of 4 environments for groups of 5"):
        grouped.reset(4)
