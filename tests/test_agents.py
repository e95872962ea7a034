"""The SB3 VecEnv adapter on the JAX core, and the learners on it (routers: test_routers.py)."""

from __future__ import annotations

import numpy as np
import pytest


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
        assert info["TimeLimit.truncated"] is False  # a drained end is a termination
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


def test_cut_episodes_are_truncations_for_sb3():
    """With end="cut" the adapter marks the end as a time-limit truncation (SB3 bootstraps)."""
    from agents.sb3_vec_env import JaxVecEnv

    env = JaxVecEnv(2, "bursty", seed=0, episode_length=8, end="cut")
    env.reset()
    for _ in range(8):
        _, _, done, infos = env.step(np.zeros(2, np.int64))
    assert done.all() and all(info["TimeLimit.truncated"] is True for info in infos)
    env.close()
