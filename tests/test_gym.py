"""The Gymnasium face: env checkers, the native vector env with same-step auto-reset, input errors,
and the action mask. Every environment here shares one scenario configuration (one compile)."""

from __future__ import annotations

import gymnasium as gym
import numpy as np
import pytest
from gymnasium.utils.env_checker import check_env as gym_check_env
from stable_baselines3.common.env_checker import check_env as sb3_check_env

import burstgym  # noqa: F401  (registers BurstBalance-v0)
from burstgym import scenarios

# bursty, 4 nodes, short episodes; 2 running / 2 waiting per node so that queues fill up.
GYM = dict(scenario="bursty", n_nodes=4, episode_length=24, max_num_seqs=2, queue_capacity=2, load=1.5)


def test_env_checkers() -> None:
    """Gymnasium's and Stable-Baselines3's env checkers accept the single-cluster env."""
    env = gym.make("BurstBalance-v0", **GYM)
    gym_check_env(env.unwrapped, skip_render_check=True)
    sb3_check_env(env.unwrapped, warn=True)
    env.close()


@pytest.mark.parametrize(("end", "terminates"), [("drain", True), ("cut", False)])
def test_episode_ends_with_metrics(end: str, terminates: bool) -> None:
    """An episode lasts episode_length steps; the last carries the serving metrics and is a
    termination when it drains, a truncation when it is cut; stepping on raises."""
    env = gym.make("BurstBalance-v0", **GYM, end=end)
    obs, info = env.reset(seed=0)
    assert env.observation_space.contains(obs)
    for k in range(GYM["episode_length"]):
        obs, reward, terminated, truncated, info = env.step(k % GYM["n_nodes"])
        last = k == GYM["episode_length"] - 1
        assert np.isfinite(reward)
        assert (terminated, truncated) == ((last and terminates), (last and not terminates))
    m = info["metrics"]
    assert m["requests"] == GYM["episode_length"]
    if terminates:
        assert m["served"] + m["drops"] == m["requests"]
    with pytest.raises(RuntimeError, match="episode has ended"):
        env.step(0)


def test_render_modes() -> None:
    """ "ansi" gives a text table of the nodes, "rgb_array" an RGB frame; others are refused."""
    text = gym.make("BurstBalance-v0", **GYM, render_mode="ansi")
    text.reset(seed=0)
    text.step(0)
    table = text.render()
    assert table.count("node ") == GYM["n_nodes"] and "running=" in table
    frames = gym.make("BurstBalance-v0", **GYM, render_mode="rgb_array")
    frames.reset(seed=0)
    frame = frames.render()
    assert frame.dtype == np.uint8 and frame.ndim == 3 and frame.shape[2] == 3 and frame.std() > 0
    with pytest.raises(ValueError, match="render_mode 'svg'"):
        gym.make("BurstBalance-v0", **GYM, render_mode="svg")


def test_record_video_writes_an_episode(tmp_path) -> None:
    """Gymnasium's RecordVideo records the rgb_array frames of an episode to an .mp4."""
    pytest.importorskip("moviepy", reason="RecordVideo needs moviepy (pip install -e '.[dev]')")
    env = gym.make("BurstBalance-v0", scenario="prefix", episode_length=8, render_mode="rgb_array")
    env = gym.wrappers.RecordVideo(
        env, str(tmp_path / "video"), episode_trigger=lambda k: True, disable_logger=True
    )
    env.reset(seed=0)
    done = False
    while not done:
        _, _, terminated, truncated, _ = env.step(env.action_space.sample())
        done = terminated or truncated
    env.close()
    (video,) = (tmp_path / "video").glob("*.mp4")
    assert video.stat().st_size > 1000
    text = gym.make("BurstBalance-v0", scenario="prefix", episode_length=8, render_mode="ansi")
    text.reset(seed=0)
    assert "cache=" in text.render() and "hit=" in text.render()


def test_slot_overflow_is_raised_not_dropped() -> None:
    """A node asked to hold more requests than its slot table raises instead of losing one."""
    env = gym.make("BurstBalance-v0", **{**GYM, "queue_capacity": 50, "slots": 4}).unwrapped
    env.reset(seed=0)
    with pytest.raises(RuntimeError, match="slot table overflowed"):
        for _ in range(GYM["episode_length"]):
            env.step(0)


def test_vector_env_same_step_autoreset() -> None:
    """The native vector env steps 8 clusters and resets finished ones in the same step, handing
    back the last observation and the episode's metrics in final_obs / final_info."""
    envs = gym.make_vec("BurstBalance-v0", num_envs=8, vectorization_mode="vector_entry_point", **GYM)
    assert envs.metadata["autoreset_mode"] == gym.vector.AutoresetMode.SAME_STEP
    obs, info = envs.reset(seed=1)
    assert obs.shape == (8, *envs.single_observation_space.shape) and envs.observation_space.contains(obs)
    rng = np.random.default_rng(0)
    for k in range(GYM["episode_length"]):
        obs, reward, terminated, truncated, info = envs.step(rng.integers(0, GYM["n_nodes"], 8))
        assert reward.shape == (8,) and np.isfinite(reward).all() and not truncated.any()
        assert envs.observation_space.contains(obs)
        last = k == GYM["episode_length"] - 1
        assert terminated.all() == last and terminated.any() == last
        assert ("final_obs" in info) == last
    assert info["_final_info"].all() and info["_final_obs"].all()
    m = info["final_info"]["metrics"]
    np.testing.assert_array_equal(m["requests"], GYM["episode_length"])
    np.testing.assert_array_equal(m["served"] + m["drops"], m["requests"])
    assert m["load_share"].shape == (8, GYM["n_nodes"])
    # the returned observation is the first of the next episode, not the final one
    assert not np.array_equal(obs, info["final_obs"])
    states = envs.unwrapped.states
    np.testing.assert_array_equal(np.asarray(states.step), 0)
    obs, reward, terminated, truncated, info = envs.step(np.zeros(8, np.int64))
    assert not terminated.any() and "final_obs" not in info
    np.testing.assert_array_equal(np.asarray(envs.unwrapped.states.step), 1)
    envs.close()


def test_unknown_scenario_lists_valid_ones() -> None:
    with pytest.raises(ValueError, match="unknown scenario 'nope'") as e:
        gym.make("BurstBalance-v0", scenario="nope")
    for name in scenarios.SCENARIOS:
        assert name in str(e.value)


@pytest.mark.parametrize(
    ("setting", "field"),
    [
        ({"n_nodez": 4}, "n_nodez"),
        ({"load": -1.0}, "load"),
        ({"n_nodes": 0}, "n_nodes"),
        ({"scheduler": "static"}, "scheduler"),
        ({"queue_capacity": 2.5}, "queue_capacity"),
        ({"burst_ratio": 0.5}, "burst_ratio"),
        ({"arrival_cv": 0.0}, "arrival_cv"),
        ({"slot_widths": (32, 0)}, "slot_widths"),
        ({"slot_widths": 64}, "slot_widths"),
    ],
)
def test_bad_setting_names_the_field(setting, field) -> None:
    """Unknown or invalid settings are refused with the setting named."""
    with pytest.raises(ValueError, match=f"'{field}'"):
        gym.make("BurstBalance-v0", scenario="bursty", **setting)


def test_burstiness_settings_shape_the_arrivals() -> None:
    """`burst_ratio` and `arrival_cv` reach the arrival process; load keeps the same mean rate."""
    from burstgym import scenarios

    mild, _ = scenarios.make("bursty", burst_ratio=2.0)
    heavy, _ = scenarios.make("bursty", burst_ratio=32.0)
    assert (mild.workload.arrivals.burst_ratio, heavy.workload.arrivals.burst_ratio) == (2.0, 32.0)
    assert mild.workload.mean_rate == pytest.approx(heavy.workload.mean_rate)
    gamma, _ = scenarios.make("energy", arrival_cv=5.0)
    assert gamma.workload.arrivals.cv == 5.0


@pytest.mark.parametrize("action", [4, -1, 1.0, np.array([0, 1]), "0"])
def test_single_env_refuses_bad_action(action) -> None:
    """Actions that are not a node index in [0, n_nodes) raise instead of being clipped."""
    env = gym.make("BurstBalance-v0", **GYM).unwrapped
    env.reset(seed=0)
    with pytest.raises(ValueError, match="not a node index"):
        env.step(action)


@pytest.mark.parametrize("actions", [[0, 1, 2, 3, 4, 0, 0, 0], [0, 0, -1, 0, 0, 0, 0, 0], [0] * 7, [0.5] * 8])
def test_vector_env_refuses_bad_actions(actions) -> None:
    envs = gym.make_vec("BurstBalance-v0", num_envs=8, vectorization_mode="vector_entry_point", **GYM)
    envs.reset(seed=0)
    with pytest.raises(ValueError, match="actions"):
        envs.step(np.asarray(actions))


def test_malformed_trace_names_file_and_line(tmp_path) -> None:
    """A trace row that is not a number is reported with the file, line and column."""
    f = tmp_path / "azure.csv"
    f.write_text(
        "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.68,10,5\n2023-11-16 18:15:47.00,ten,5\n"
    )
    with pytest.raises(ValueError, match=r"azure\.csv: line 3: column 'ContextTokens'"):
        gym.make("BurstBalance-v0", scenario="trace", trace=str(f))


def test_empty_trace_names_file(tmp_path) -> None:
    """An empty file (line 1 has no header) and a header without rows are refused, naming the file."""
    empty = tmp_path / "empty.csv"
    empty.write_text("")
    with pytest.raises(ValueError, match=r"empty\.csv: line 1"):
        gym.make("BurstBalance-v0", scenario="trace", trace=str(empty))
    header = tmp_path / "header.csv"
    header.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n")
    with pytest.raises(ValueError, match=r"header\.csv: .*no requests"):
        gym.make("BurstBalance-v0", scenario="trace", trace=str(header))


def test_action_mask_marks_full_queues() -> None:
    """info["action_mask"] is False exactly for nodes whose queue is full (all True if all are),
    and a request sent to a masked node is dropped."""
    env = gym.make("BurstBalance-v0", **GYM).unwrapped
    _, info = env.reset(seed=3)
    qc = GYM["queue_capacity"]
    seen_full = seen_drop = False
    for k in range(GYM["episode_length"] - 1):
        mask = info["action_mask"]
        waiting = (np.asarray(env._state.slots.status) == 1).sum(axis=1)
        want = waiting < qc
        np.testing.assert_array_equal(mask, want if want.any() else np.ones_like(want))
        action = 0 if k % 3 else 1  # mostly node 0, so its queue fills
        _, _, _, _, info = env.step(action)
        assert info["dropped"] == (not want[action])
        seen_full |= not want[0]
        seen_drop |= info["dropped"]
    assert seen_full and seen_drop
