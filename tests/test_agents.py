"""Heuristic routers on crafted observations, and the SB3 VecEnv adapter on the JAX core."""

from __future__ import annotations

import numpy as np
import pytest

from agents.heuristics import (
    IDLE,
    KV_UTIL,
    ROUTERS,
    RUNNING,
    WAITING,
    WINDOW_AGE,
    ClusterLimits,
    make_router,
)
from burstgym.observation import GLOBAL_FEATURES, NODE_FEATURES

LIMITS = ClusterLimits(n_nodes=4, running_limit=64, queue_capacity=64)


def make_obs(feats: np.ndarray) -> np.ndarray:
    """Observations [B, obs_size] from per-node features [B, N, F] (global features zero)."""
    b = feats.shape[0]
    return np.concatenate([feats.reshape(b, -1), np.zeros((b, len(GLOBAL_FEATURES)))], axis=1)


def feats_with(column: int, values: list[list[float]]) -> np.ndarray:
    f = np.zeros((len(values), 4, len(NODE_FEATURES)))
    f[..., column] = values
    f[..., IDLE] = 1.0
    return f


@pytest.mark.parametrize("name", list(ROUTERS))
def test_every_router_returns_valid_actions_and_respects_the_mask(name):
    rng = np.random.default_rng(0)
    router = make_router(name, LIMITS, seed=1)
    router.reset(32)
    mask = np.ones((32, 4), dtype=bool)
    mask[:, 2] = False
    for _ in range(50):
        obs = make_obs(rng.uniform(0, 1, (32, 4, len(NODE_FEATURES))))
        a = router(obs, mask)
        assert a.shape == (32,) and a.dtype == np.int64
        assert ((a >= 0) & (a < 4)).all()
        if name not in ("round-robin", "random", "weighted-skew"):
            assert (a != 2).all()


def test_unknown_router_is_refused():
    with pytest.raises(ValueError, match="unknown router 'nope'"):
        make_router("nope", LIMITS)


def test_round_robin_cycles_per_environment():
    router = make_router("round-robin", LIMITS)
    router.reset(3)
    obs = make_obs(np.zeros((3, 4, len(NODE_FEATURES))))
    picks = np.stack([router(obs) for _ in range(8)])
    assert (picks == (np.arange(8) % 4)[:, None]).all()


def test_jsq_picks_the_emptiest_node():
    f = feats_with(RUNNING, [[0.5, 0.1, 0.3, 0.9], [0.2, 0.2, 0.0, 0.2]])
    f[1, 2, WAITING] = 0.5  # node 2 has 32 waiting: the most loaded in env 1
    a = make_router("jsq", LIMITS)(make_obs(f))
    assert a[0] == 1
    assert a[1] in (0, 1, 3)


def test_jsq_breaks_ties_by_rotation_not_always_node_zero():
    router = make_router("jsq", LIMITS)
    router.reset(1)
    obs = make_obs(np.zeros((1, 4, len(NODE_FEATURES))))
    assert sorted(int(router(obs)[0]) for _ in range(4)) == [0, 1, 2, 3]


def test_least_kv_picks_lowest_kv_utilisation():
    a = make_router("least-kv", LIMITS)(make_obs(feats_with(KV_UTIL, [[0.5, 0.4, 0.05, 0.3]])))
    assert a[0] == 2


def test_power_of_two_never_picks_the_busier_of_two_nodes():
    limits = ClusterLimits(2, 64, 64)
    router = make_router("power-of-two", limits)
    router.reset(100)
    f = np.zeros((100, 2, len(NODE_FEATURES)))
    f[:, 0, RUNNING] = 0.8
    assert (router(make_obs(f)) == 1).all()


def test_weighted_skew_gives_node_zero_ten_percent_more():
    router = make_router("weighted-skew", LIMITS)
    router.reset(2)
    obs = make_obs(np.zeros((2, 4, len(NODE_FEATURES))))
    picks = np.stack([router(obs) for _ in range(41 * 10)])
    counts = np.bincount(picks[:, 0], minlength=4)
    assert counts.tolist() == [110, 100, 100, 100]


def test_pack_load_packs_the_busiest_node_under_the_cap_else_spreads():
    f = feats_with(RUNNING, [[0.5, 0.7, 0.95, 0.1], [0.95, 0.95, 0.95, 0.92]])
    f[0, 1, KV_UTIL] = 0.5
    a = make_router("pack-load", LIMITS)(make_obs(f))
    assert a[0] == 1  # node 2 is busier but over the running cap
    assert a[1] == 3  # every node over the cap: the least loaded


def test_soonest_batch_joins_the_oldest_forming_batch():
    limits = ClusterLimits(4, 16, 64)
    f = feats_with(WAITING, [[2 / 64, 3 / 64, 0.0, 1 / 64], [0.0, 0.0, 0.0, 0.0]])
    f[0, :, WINDOW_AGE] = [0.2, 0.1, 0.0, 0.9]
    f[1, :, RUNNING] = [0.5, 0.25, 0.75, 1.0]
    a = make_router("soonest-batch", limits)(make_obs(f))
    assert a[0] == 3  # its window expires first
    assert a[1] == 1  # no forming batch: the least loaded node


def test_cluster_limits_follow_the_scheduler():
    assert ClusterLimits.of("bursty-dynamic") == ClusterLimits(4, 16, 64)
    assert ClusterLimits.of("bursty") == ClusterLimits(4, 64, 64)


@pytest.fixture(scope="module")
def vec_env():
    from agents.sb3_vec_env import JaxVecEnv

    env = JaxVecEnv(4, "bursty", seed=0, episode_length=16)
    yield env
    env.close()


def test_vec_env_reports_terminal_observation_and_episode_stats(vec_env):
    obs = vec_env.reset()
    assert obs.shape == (4, vec_env.observation_space.shape[0]) and obs.flags.writeable
    total = np.zeros(4)
    for k in range(16):
        obs, reward, done, infos = vec_env.step(np.full(4, k % 4))
        total += reward
        assert len(infos) == 4
    assert done.all()
    for i, info in enumerate(infos):
        assert info["terminal_observation"].shape == obs.shape[1:]
        assert info["episode"]["l"] == 16
        assert info["episode"]["r"] == pytest.approx(total[i], rel=1e-4)
        assert info["TimeLimit.truncated"] is False
        assert {"e2e_p99", "ttft_p50", "slo_attainment", "drops", "skew_index"} <= set(info["metrics"])
        assert len(info["metrics"]["load_share"]) == 4
    assert vec_env.action_masks().shape == (4, 4)
    assert len(vec_env.env_method("action_masks")) == 4
    assert vec_env.get_attr("render_mode") == [None] * 4
    assert vec_env.env_is_wrapped(object) == [False] * 4
    vec_env.seed(3)
    first = vec_env.reset()
    vec_env.seed(3)
    assert np.array_equal(vec_env.reset(), first)


@pytest.mark.parametrize("algo", ["ppo", "maskable-ppo", "dqn"])
def test_learners_train_a_few_hundred_steps(vec_env, algo):
    from agents.learners import PolicyRouter, make_model

    model = make_model(
        algo,
        vec_env,
        "bursty",
        seed=0,
        tensorboard_log=None,
        overrides={"n_steps": 16} if "ppo" in algo else {"learning_starts": 32},
    )
    model.learn(256)
    assert model.num_timesteps >= 256
    obs = vec_env.reset()
    a = PolicyRouter(model)(obs, vec_env.action_masks())
    assert a.shape == (4,) and ((a >= 0) & (a < 4)).all()
