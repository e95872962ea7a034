"""The JAX learner (agents/jax_ppo.py): its parts against references (GAE against a plain loop,
observation statistics against the SB3 learner's, the shared network's symmetry, the CPU rollout
layout against the batch stepping together, its action draws against jax's), the KL stop,
refusals of settings it does not implement, and a tiny training run that is reproducible and whose
checkpoint routes."""

from __future__ import annotations

import dataclasses
import functools
import pickle

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from agents import model
from agents.hyperparams import load
from agents.jax_ppo import (
    JaxPolicyRouter,
    JaxPPO,
    PPOConfig,
    _categorical,
    _draw_noise,
    _scan_clusters,
    apply,
    gae,
)
from agents.learners import NodePooledRunningMeanStd, load_router
from agents.model import ObsStats
from agents.routers import make_rule
from burstgym import scenarios
from burstgym.env import BurstBalance
from burstgym.gym_env import batched_step_fn
from burstgym.observation import GLOBAL_FEATURES, NODE_FEATURES, obs_size

N = 4
TINY = dict(n_steps=8, batch_size=16, n_epochs=2, target_kl=None)
FULL = TINY["n_epochs"] * (4 * TINY["n_steps"] // TINY["batch_size"])  # minibatch steps per update


def test_gae_equals_a_plain_backward_loop():
    rng = np.random.default_rng(0)
    t, b, gamma, lam = 12, 3, 0.97, 0.9
    rewards, values = rng.normal(size=(t, b)), rng.normal(size=(t, b))
    dones, last = rng.random((t, b)) < 0.2, rng.normal(size=b)
    adv_ref, next_adv, next_v = np.zeros((t, b)), np.zeros(b), last
    for k in range(t - 1, -1, -1):
        live = 1.0 - dones[k]
        delta = rewards[k] + gamma * next_v * live - values[k]
        next_adv = delta + gamma * lam * live * next_adv
        adv_ref[k], next_v = next_adv, values[k]
    adv, ret = gae(*(jnp.asarray(x, jnp.float32) for x in (rewards, values, dones, last)), gamma, lam)
    np.testing.assert_allclose(adv, adv_ref, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(ret, adv_ref + values, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("xp, dtype, tol", [(np, np.float64, 1e-9), (jnp, jnp.float32, 1e-4)])
def test_observation_statistics_pool_nodes_and_merge_batches_exactly(xp, dtype, tol):
    """The running statistics after several batches are the mean and variance of all the data
    seen, each node feature over every node's rows; normalising uses them as VecNormalize does."""
    rng = np.random.default_rng(1)
    stats, seen = ObsStats.empty(xp, dtype), []
    for scale in (1.0, 5.0, 0.1):
        batch = rng.normal(size=(50, obs_size(N))) * scale + scale
        seen.append(batch)
        stats = stats.update(xp.asarray(batch, dtype=dtype))
    data, f = np.concatenate(seen), len(NODE_FEATURES)
    nodes = data[:, : N * f].reshape(-1, f)
    # the initial count (1e-4 of a sample at mean 0, variance 1) moves them by about 1e-6
    np.testing.assert_allclose(stats.node.mean, nodes.mean(axis=0), rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(stats.node.var, nodes.var(axis=0), rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(stats.glob.var, data[:, N * f :].var(axis=0), rtol=1e-4, atol=1e-4)
    assert float(stats.glob.count) == pytest.approx(150 + 1e-4) and float(stats.node.count) == pytest.approx(
        150 * N + 1e-4
    )
    x = rng.normal(size=(7, obs_size(N))) * 3
    mean, var = stats.mean_var(N)
    want = np.clip((x - np.asarray(mean)) / np.sqrt(np.asarray(var) + 1e-8), -10, 10)
    np.testing.assert_allclose(stats.normalize(xp.asarray(x, dtype=dtype)), want, rtol=tol, atol=tol)
    ref = NodePooledRunningMeanStd(N)  # SB3's face of the same statistics
    for batch in seen:
        ref.update(batch)
    np.testing.assert_allclose(ref.mean[:f], stats.node.mean, rtol=tol, atol=tol)
    np.testing.assert_array_equal(ref.mean[:f], ref.mean[f : 2 * f])


def test_network_scores_nodes_alike_and_runs_on_jax_and_torch_arrays():
    import torch

    params = model.init(jax.random.key(0), N, 64)
    obs = np.array(jax.random.normal(jax.random.key(1), (5, obs_size(N))))
    logits, value = model.forward(jax.tree.map(jnp.asarray, params), jnp.asarray(obs))
    assert logits.shape == (5, N) and value.shape == (5,)
    f, k = len(NODE_FEATURES), N * len(NODE_FEATURES)
    perm = np.array([2, 0, 3, 1])
    nodes = obs[:, :k].reshape(5, N, f)[:, perm].reshape(5, k)
    permuted = model.logits(params, np.concatenate([nodes, obs[:, k:]], axis=1))
    np.testing.assert_allclose(permuted, logits[:, perm], rtol=1e-5, atol=1e-6)
    assert float(jnp.abs(logits).max()) < 0.1  # action head gain 0.01: near-uniform at the start
    theirs = model.forward(jax.tree.map(torch.as_tensor, params), torch.as_tensor(obs))
    for ours, t in zip((logits, value), theirs, strict=True):
        np.testing.assert_allclose(np.asarray(ours), t.numpy(), rtol=1e-5, atol=1e-6)
    assert len(GLOBAL_FEATURES) + f == params["score_0"]["kernel"].shape[0]


@pytest.fixture(scope="module")
def tiny_setup():
    cfg, params = scenarios.make("prefix", episode_length=16)
    base = dataclasses.replace(PPOConfig.from_entry(load("ppo", "prefix")), **TINY)
    return cfg, params, base


def _learner(tiny_setup, seed: int = 0, **changes) -> JaxPPO:
    cfg, params, base = tiny_setup
    learner = JaxPPO(cfg, params, dataclasses.replace(base, **changes), n_envs=4, total_timesteps=64)
    learner.setup(seed)
    return learner


def test_training_is_reproducible_and_its_checkpoint_routes(tiny_setup, tmp_path):
    runs = []
    for run, seed in enumerate((0, 0, 1)):
        learner = _learner(tiny_setup, seed)
        bc = learner.warm_start(make_rule("jsq"), 32, epochs=2, batch_size=16)
        assert 0.0 <= bc["agreement"] <= 1.0 and bc["samples"] == 32
        # the second run collects and learns apart (as benchmarks/training.py times them)
        logs = [learner.learn(*learner.collect()) if run == 1 else learner.update() for _ in range(2)]
        assert learner.num_timesteps == 64
        assert np.isfinite(logs[-1]["train/value_loss"]) and logs[-1]["train/n_updates"] == FULL
        runs.append((jax.tree.leaves(learner.train_state.params), logs, learner))
    for a, b in zip(runs[0][0], runs[1][0], strict=True):
        np.testing.assert_array_equal(a, b)  # same seed: the same parameters, bit for bit
    np.testing.assert_equal(runs[0][1], runs[1][1])  # and the same logs (NaN equal to NaN)
    assert any(not np.array_equal(a, b) for a, b in zip(runs[0][0], runs[2][0], strict=True))
    learner = runs[0][2]
    learner.save(tmp_path / "model.msgpack")
    router = load_router(tmp_path / "model.msgpack", "jax-ppo", require_normalization=True)
    assert isinstance(router, JaxPolicyRouter) and router.observation_shape == (obs_size(N),)
    obs = np.asarray(learner.runner.obs)
    np.testing.assert_array_equal(router(obs), learner.router()(obs))
    logits, _ = apply(learner.train_state.params, learner.stats.normalize(jnp.asarray(obs)))
    np.testing.assert_array_equal(router(obs), np.argmax(np.asarray(logits), axis=1))
    again = pickle.loads(pickle.dumps(router))  # travels to Ray tasks
    np.testing.assert_array_equal(again(obs), router(obs))
    with pytest.raises(ValueError, match="do not fit"):
        router(obs[:, :-1])


def test_rollouts_in_parts_equal_one_part(tiny_setup, monkeypatch):
    """A deterministic teacher's rollout collected in two parts of the clusters (two threads, the
    CPU layout) gives the warm start the same fit and leaves the clusters and key as one call over
    every cluster (the accelerator layout) does; the next PPO update runs in either."""
    results = []
    for k in (1, 2):
        monkeypatch.setattr(JaxPPO, "parts", lambda self, k=k: k)
        learner = _learner(tiny_setup)
        bc = learner.warm_start(make_rule("jsq"), 32, epochs=2, batch_size=16)
        runner, states = learner.runner, learner.cluster_states()
        logs = learner.update()
        assert learner.runner.obs.shape == runner.obs.shape and np.isfinite(logs["train/value_loss"])
        results.append((bc, jax.tree.leaves((states, runner.obs, runner.ep_return)), runner.key))
    (bc1, run1, key1), (bc2, run2, key2) = results
    assert bc1 == bc2
    for a, b in zip(run1, run2, strict=True):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(jax.random.key_data(key1), jax.random.key_data(key2))


def test_target_kl_stops_the_update_before_the_first_minibatch_past_it(tiny_setup):
    # The first minibatch starts at the rollout's policy (KL exactly 0) and is applied; every
    # later one is past a vanishing target and the update stops there.
    # (without a target every minibatch is applied: the reproducibility test checks FULL)
    logs = _learner(tiny_setup, target_kl=1e-12).update()
    assert logs["train/n_updates"] == 1 and logs["train/stopped_early"] == 1


@pytest.mark.parametrize(
    "change, message",
    [
        ({"use_sde": True}, "does not implement use_sde"),
        ({"policy": "MlpPolicy"}, "trains agents.policies.NodeScoringPolicy only"),
        ({"normalize": {"norm_obs": True, "norm_reward": True}}, "norm_reward: false"),
        ({"learning_rate": "exp_0.1"}, "unknown schedule"),
        ({"clip_range": "lin_0.2"}, "constant clip_range"),
    ],
)
def test_settings_it_does_not_implement_are_refused_by_name(change, message):
    entry = {**load("ppo", "prefix"), **change}
    with pytest.raises(ValueError, match=message):
        PPOConfig.from_entry(entry, "agents/hyperparams.yml")


def test_a_checkpoint_that_is_not_one_is_refused(tmp_path):
    bad = tmp_path / "x.msgpack"
    bad.write_bytes(b"not msgpack")
    with pytest.raises(ValueError, match="not a jax-ppo checkpoint"):
        JaxPolicyRouter.load(bad)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        JaxPolicyRouter.load(tmp_path / "missing.msgpack")


def test_the_jax_learner_imitates_the_lookahead_bound(tiny_setup):
    """A teacher that reads the cluster's state (the bound) routes the warm start's clusters."""
    from agents.warm_start import teacher

    cfg, params, _ = tiny_setup
    learner = _learner(tiny_setup)
    bc = learner.warm_start(teacher("lookahead", cfg, params), 32, epochs=2, batch_size=16)
    assert bc["samples"] == 32 and 0.0 <= bc["agreement"] <= 1.0


@pytest.mark.default_codegen
def test_clusters_each_looping_over_their_steps_equal_the_batch_stepping_together():
    """`_scan_clusters` (the CPU layout of the learner's rollouts: a loop over the clusters of each
    one's loop over its steps) leaves the states and gives the outputs of one loop over the steps
    of the whole batch, bit for bit; actions drawn from `_draw_noise`'s noise are those
    `jax.random.categorical` draws with the same keys."""
    cfg, params = scenarios.make("bursty", episode_length=8)
    core = BurstBalance(cfg)
    obs, states = core.batched_reset(jax.random.split(jax.random.key(0), 3), params)
    key, noise = _draw_noise(jax.random.key(1), 6, (3, N))
    step = functools.partial(batched_step_fn(core), params=params)

    def body(carry, g):
        states, obs = carry
        action, logp = _categorical(g, obs[:, :N])  # scores that change with the state
        obs, states, reward, done, _ = step(states, action)
        return (states, obs), (action, logp, reward, done)

    by_cluster = jax.jit(lambda c, x: _scan_clusters(body, c, x, 6))((states, obs), noise)
    together = jax.jit(lambda c, x: jax.lax.scan(body, c, x, length=6))((states, obs), noise)
    for a, b in zip(jax.tree.leaves(by_cluster), jax.tree.leaves(together), strict=True):
        np.testing.assert_array_equal(a, b)
    assert len(set(np.asarray(by_cluster[1][0]).ravel().tolist())) > 1  # the actions vary

    logits = jax.random.normal(jax.random.key(2), (3, N))
    k = jax.random.key(1)
    for t in range(6):
        k, sub = jax.random.split(k)
        drawn = jax.random.categorical(sub, logits)
        np.testing.assert_array_equal(_categorical(noise[t], logits)[0], drawn)
    np.testing.assert_array_equal(jax.random.key_data(key), jax.random.key_data(k))
