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


def test_node_scoring_policy_uses_sb3_initialisation(vec_env):
    """Orthogonal weights, zero biases; gain 0.01 on the actor's output (the scorer's last layer),
    1 on the value head, sqrt(2) on hidden layers: near-uniform initial routing."""
    import torch

    from agents.learners import make_model

    policy = make_model(
        "ppo", vec_env, "bursty", seed=0, tensorboard_log=None, overrides={"n_steps": 16}
    ).policy
    head = policy.actor_head.weight.detach()
    assert head.shape[0] == 1 and float(head.norm()) == pytest.approx(0.01, rel=1e-4)
    value_head = policy.mlp_extractor.layers["value_out"]
    assert float(value_head.weight.detach().norm()) == pytest.approx(1.0, rel=1e-4)
    hidden = [m for m in policy.mlp_extractor.modules() if isinstance(m, torch.nn.Linear)]
    hidden = [m for m in hidden if m is not policy.actor_head and m is not value_head]
    assert len(hidden) == 4
    for layer in hidden:
        w = layer.weight.detach().double()
        gram = w @ w.T if w.shape[0] <= w.shape[1] else w.T @ w  # orthogonal rows or columns
        assert torch.allclose(gram, 2 * torch.eye(gram.shape[0], dtype=torch.float64), atol=1e-4)
        assert float(layer.bias.detach().abs().max()) == 0.0
    with torch.no_grad():
        probs = policy.get_distribution(torch.as_tensor(vec_env.reset())).distribution.probs
    assert float((probs - 0.25).abs().max()) < 0.02


def test_staggered_first_episodes_end_at_different_steps():
    from agents.sb3_vec_env import JaxVecEnv

    env = JaxVecEnv(8, "bursty", seed=0, episode_length=16, stagger=True)
    env.reset()
    first_end, lengths = {}, []
    for k in range(1, 33):
        _, _, done, infos = env.step(np.zeros(8, np.int64))
        for i in np.flatnonzero(done):
            if i in first_end:
                lengths.append(infos[i]["episode"]["l"])
            else:
                first_end[i] = k
    env.close()
    assert len(first_end) == 8 and len(set(first_end.values())) > 1  # first episodes end apart
    assert all(1 <= k <= 16 for k in first_end.values())
    assert lengths and all(n == 16 for n in lengths)  # later episodes have the full length


def test_returns_bootstrap_where_rollouts_stop():
    from agents.warm_start import returns

    rewards = np.array([[1.0], [2.0], [3.0]])
    dones = np.array([[False], [True], [False]])
    g = returns(rewards, dones, np.zeros((3, 1)), np.array([10.0]), 0.5)
    # step 2 continues into the unfinished episode (bootstrap 10); step 1 ends the episode
    assert np.asarray(g)[:, 0].tolist() == [1 + 0.5 * 2, 2.0, 3 + 0.5 * 10]
    truncated = returns(rewards, dones, np.array([[0.0], [4.0], [0.0]]), np.array([0.0]), 0.5)
    assert truncated[1, 0] == 2 + 0.5 * 4  # a truncated end bootstraps from its terminal value


def test_behaviour_cloning_pretrains_the_critic():
    from agents.learners import behaviour_clone, make_model, normalize_env
    from agents.routers import make_router
    from agents.sb3_vec_env import JaxVecEnv

    env = normalize_env(
        JaxVecEnv(8, "bursty", seed=0, episode_length=16, stagger=True), {"norm_reward": False}
    )
    model = make_model("ppo", env, "bursty", seed=0, tensorboard_log=None, overrides={"n_steps": 16})
    out = behaviour_clone(model, env, make_router("jsq", 4), 1024, epochs=40, batch_size=128)
    env.close()
    assert out["samples"] == 1024 and 0.0 <= out["agreement"] <= 1.0
    assert np.isfinite(out["value_explained_variance"])
    assert out["value_explained_variance"] > out["value_explained_variance_initial"]


def test_pooled_normalisation_keeps_differences_between_nodes():
    from agents.learners import NodePooledRunningMeanStd
    from burstgym.observation import GLOBAL_FEATURES, NODE_FEATURES

    n, f = 3, len(NODE_FEATURES)
    rng = np.random.default_rng(0)
    obs = rng.random((64, n * f + len(GLOBAL_FEATURES)))
    obs[:, [f - 1, 2 * f - 1, 3 * f - 1]] = [0.5, 1.0, 1.5]  # a per-node constant (capacity-like)
    rms = NodePooledRunningMeanStd(n)
    rms.update(obs)
    nodes = obs[:, : n * f].reshape(-1, f)
    assert np.allclose(rms.mean[:f], nodes.mean(axis=0), atol=1e-3)
    assert np.array_equal(rms.mean[:f], rms.mean[f : 2 * f]) and np.array_equal(
        rms.var[:f], rms.var[2 * f : 3 * f]
    )
    scaled = (obs[0] - rms.mean) / np.sqrt(rms.var + 1e-8)
    assert scaled[f - 1] < scaled[2 * f - 1] < scaled[3 * f - 1]  # still ordered, not all 0


def test_pooled_statistics_pickled_in_the_earlier_layout_load_and_update():
    """vecnormalize.pkl files of 2026-12-03 hold the pooled statistics as RunningMeanStd `node` and
    `glob`; unpickled (--allow-pickle), they normalise and update as the current ones do."""
    import pickle

    from stable_baselines3.common.running_mean_std import RunningMeanStd

    from agents.learners import NodePooledRunningMeanStd
    from burstgym.observation import obs_size

    n = 3
    obs = np.random.default_rng(0).random((64, obs_size(n)))
    now = NodePooledRunningMeanStd(n)
    now.update(obs)
    old = NodePooledRunningMeanStd(n)
    old.__dict__ = {k: v for k, v in now.__dict__.items() if k != "stats"}
    for name, moments in zip(("node", "glob"), now.stats, strict=True):
        rms = RunningMeanStd(shape=moments.mean.shape)
        rms.mean, rms.var, rms.count = moments.mean, moments.var, float(moments.count)
        old.__dict__[name] = rms
    loaded = pickle.loads(pickle.dumps(old))
    np.testing.assert_array_equal(loaded.mean, now.mean)
    loaded.update(obs)
    now.update(obs)
    np.testing.assert_allclose(loaded.var, now.var)


def test_saved_model_and_statistics_act_as_in_training(tmp_path):
    """A model trained on normalised observations, saved with its VecNormalize statistics and
    loaded as a router, takes the actions the training loop's policy takes."""
    from agents.learners import (
        NodeVecNormalize,
        PolicyRouter,
        load_router,
        make_model,
        normalize_env,
        save_normalization,
    )
    from agents.sb3_vec_env import JaxVecEnv

    env = normalize_env(
        JaxVecEnv(4, "bursty", seed=0, episode_length=16, stagger=True), {"norm_reward": False}
    )
    assert isinstance(env, NodeVecNormalize)
    model = make_model("ppo", env, "bursty", seed=0, tensorboard_log=None, overrides={"n_steps": 16})
    model.learn(128)
    raw = np.concatenate(
        [env.get_original_obs(), np.random.default_rng(1).random((4, env.observation_space.shape[0]))]
    )
    raw = raw.astype(np.float32)
    in_training, _ = model.predict(env.normalize_obs(raw), deterministic=True)
    assert np.array_equal(PolicyRouter(model, normalize=env)(raw), in_training)
    model.save(tmp_path / "model.zip")
    save_normalization(env, tmp_path / "vecnormalize.json")
    _run_config(tmp_path, n_steps=16)
    env.close()
    router = load_router(tmp_path / "model.zip", "ppo", require_normalization=True)
    assert np.array_equal(router(raw), in_training)
    assert np.allclose(router.observe(raw), env.normalize_obs(raw), atol=1e-6)
    import pickle

    pickle.loads(pickle.dumps(router.obs_rms))  # the router's statistics travel (Ray tasks)


def test_missing_statistics_are_refused(tmp_path, vec_env):
    from agents.learners import load_router, make_model

    model = make_model("ppo", vec_env, "bursty", seed=0, tensorboard_log=None, overrides={"n_steps": 16})
    model.save(tmp_path / "model.zip")
    _run_config(tmp_path, n_steps=16)
    assert load_router(tmp_path / "model.zip", "ppo").obs_rms is None
    with pytest.raises(FileNotFoundError, match="vecnormalize.json"):
        load_router(tmp_path / "model.zip", "ppo", require_normalization=True)


def _run_config(run_dir, **hyperparams) -> None:
    """The config.json train.py would write for a PPO model on 'bursty' (what loading rebuilds)."""
    from agents.hyperparams import load
    from agents.runs import write_config

    entry = {**load("ppo", "bursty"), **hyperparams}
    config = {"algo": "ppo", "scenario": "bursty", "settings": {"episode_length": 16}, "hyperparams": entry}
    write_config(run_dir, config)


def test_vecnormalize_paths_follow_sb3_and_rl_zoo3_names(tmp_path):
    from agents.learners import vecnormalize_path

    ck = tmp_path / "checkpoints"
    ck.mkdir()
    (ck / "rl_model_vecnormalize_64_steps.pkl").touch()
    assert vecnormalize_path(ck / "rl_model_64_steps.zip") == ck / "rl_model_vecnormalize_64_steps.pkl"
    (tmp_path / "vecnormalize.pkl").touch()
    assert vecnormalize_path(tmp_path / "model.zip") == tmp_path / "vecnormalize.pkl"
    (tmp_path / "best_model_vecnormalize.pkl").touch()
    assert vecnormalize_path(tmp_path / "best_model.zip") == tmp_path / "best_model_vecnormalize.pkl"
    zoo = tmp_path / "zoo"
    (zoo / "BurstBalance-v0").mkdir(parents=True)
    (zoo / "BurstBalance-v0" / "vecnormalize.pkl").touch()
    assert vecnormalize_path(zoo / "BurstBalance-v0.zip") == zoo / "BurstBalance-v0" / "vecnormalize.pkl"
    (tmp_path / "vecnormalize.json").touch()  # train.py's JSON statistics come first
    assert vecnormalize_path(tmp_path / "model.zip") == tmp_path / "vecnormalize.json"


def test_hyperparameter_files_in_rl_zoo3_format(tmp_path):
    from agents.hyperparams import FILES, load, model_kwargs, normalize_kwargs
    from agents.policies import MaskableNodeScoringPolicy, NodeScoringPolicy

    for algo in FILES:
        entry = load(algo, "prefix")
        assert {"n_timesteps", "n_envs", "env_kwargs", "normalize"} <= set(entry)
        assert normalize_kwargs(entry) == {"norm_obs": True, "norm_reward": False, "gamma": entry["gamma"]}
        kwargs = model_kwargs(entry)
        assert not {"n_timesteps", "n_envs", "env_kwargs", "normalize"} & set(kwargs)
    assert model_kwargs(load("ppo", "prefix"))["policy"] is NodeScoringPolicy
    assert model_kwargs(load("maskable-ppo", "prefix"))["policy"] is MaskableNodeScoringPolicy
    assert load("ppo", "prefix")["target_kl"] == 0.02
    conf = tmp_path / "ppo.yml"
    conf.write_text(
        "BurstBalance-v0:\n  policy: MlpPolicy\n  n_timesteps: 100\n  learning_rate: lin_0.001\n"
        "  policy_kwargs: 'dict(net_arch=[8])'\n  env_kwargs: {scenario: prefix, episode_length: 64}\n"
        "scenario_overrides:\n  bursty: {n_steps: 8, env_kwargs: {load: 0.5}}\n"
    )
    entry = load("ppo", "bursty", conf)
    assert entry["n_steps"] == 8 and entry["env_kwargs"] == {
        "scenario": "prefix",
        "episode_length": 64,
        "load": 0.5,
    }
    assert "n_steps" not in load("ppo", "steady", conf)
    kwargs = model_kwargs(entry)
    assert kwargs["learning_rate"](1.0) == pytest.approx(1e-3) and kwargs["learning_rate"](
        0.5
    ) == pytest.approx(5e-4)
    assert kwargs["policy_kwargs"] == {"net_arch": [8]} and normalize_kwargs(entry) is None
    conf.write_text("BurstBalance-v0:\n  frame_stack: 4\n")
    with pytest.raises(ValueError, match="frame_stack"):
        load("ppo", None, conf)
