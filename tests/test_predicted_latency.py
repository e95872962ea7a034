"""predicted-latency (llm-d's rule): the Bayesian ridge, what the router observes, llm-d's filters,
scorer and picker, warm starts, and the router in the engine and through its NumPy face."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from agents.predicted_latency import (
    DEFAULT_PREDICTION_S,
    RAW,
    PredictedLatency,
    StreamedRouter,
    affinity_filter,
    default_models,
    fit_bayesian_ridge,
    latency_scores,
    predict,
    predictions,
    streamed,
    warm_samples,
    weighted_random,
)
from burstgym import scenarios
from burstgym.env import BurstBalance
from burstgym.observation import action_mask
from burstgym.rollout import rollout
from burstgym.types import RUNNING


def test_bayesian_ridge_recovers_a_linear_relation():
    """Features on very different scales, a known linear law plus small noise, and rows outside the
    sample (weight 0) holding garbage: the fit predicts the law on new inputs."""
    rng = np.random.default_rng(0)
    m, d = 400, 5
    x = rng.normal(size=(m, d)) * np.array([1.0, 100.0, 0.01, 5000.0, 3.0]) + np.array([0, 50, 1, 1e4, 0])
    beta = np.array([0.5, -0.02, 30.0, 1e-4, 0.0])
    y = 2.0 + x @ beta + rng.normal(scale=1e-3, size=m)
    weight = np.ones(m)
    weight[:40] = 0.0
    y_bad = y.copy()
    y_bad[:40] = 1e6
    model = fit_bayesian_ridge(jnp.asarray(x), jnp.asarray(y_bad), jnp.asarray(weight))
    coef = np.asarray(model.coef) / np.asarray(model.x_scale)
    np.testing.assert_allclose(coef, beta, atol=2e-3 * np.abs(beta).max(), rtol=1e-2)
    x_new = rng.normal(size=(50, d)) * np.array([1.0, 100.0, 0.01, 5000.0, 3.0]) + np.array(
        [0, 50, 1, 1e4, 0]
    )
    np.testing.assert_allclose(np.asarray(predict(model, jnp.asarray(x_new))), 2.0 + x_new @ beta, atol=0.02)


def test_bayesian_ridge_shrinks_a_pure_noise_feature_and_keeps_a_constant_one_harmless():
    rng = np.random.default_rng(1)
    x = np.stack([rng.normal(size=300), rng.normal(size=300), np.full(300, 7.0)], axis=1)
    y = 3.0 * x[:, 0] + rng.normal(scale=0.5, size=300)
    model = fit_bayesian_ridge(jnp.asarray(x), jnp.asarray(y), jnp.ones(300))
    coef = np.asarray(model.coef) / np.asarray(model.x_scale)
    assert coef[0] == pytest.approx(3.0, rel=0.05)
    assert abs(coef[1]) < 0.1 and coef[2] == 0.0


@functools.lru_cache(maxsize=2)
def _steady():
    cfg, params = scenarios.make("steady", n_nodes=2, episode_length=24, load=0.3, output_median=8.0)
    return cfg, params, BurstBalance(cfg)


def test_streams_show_first_tokens_then_finishes_never_the_future():
    """Mid-episode: a TTFT once a request's first token streamed, e2e and output length only for
    finished requests; requests not yet routed show nothing."""
    cfg, params, core = _steady()
    _, state = core.reset(jax.random.key(3), params)
    step = jax.jit(core.step_env)
    for k in range(12):
        _, state, *_ = step(state, jnp.int32(k % 2), params)
    seen = jax.device_get(streamed(state))
    log = jax.device_get(state.log)
    finished = np.isfinite(log.e2e)
    assert finished.any() and not finished.all()
    np.testing.assert_array_equal(np.isfinite(seen.e2e), finished)
    np.testing.assert_array_equal(seen.output[finished], np.asarray(state.requests.output)[:24][finished])
    assert np.all(np.isnan(seen.output[~finished]))
    running_first = np.asarray(state.slots.ttft)[(np.asarray(state.slots.status) == RUNNING)]
    running_first = running_first[np.isfinite(running_first)]
    assert np.isfinite(seen.ttft).sum() == finished.sum() + running_first.size
    assert np.all(np.isnan(seen.ttft[12:])) and np.all(np.isnan(seen.e2e[12:]))


def test_affinity_filter_keeps_sticky_nodes_unless_gated_or_exploring():
    cand = jnp.array([True, True, True, False])
    prefix = jnp.array([0.9, 0.5, 0.95, 1.0])
    ttft = jnp.array([1.0, 0.5, 2.0, 0.1])
    keep = affinity_filter(cand, prefix, ttft, 0.8, jnp.float32(0.5), 0.01, 5.0)
    np.testing.assert_array_equal(keep, [True, False, True, False])  # node 3 is not a candidate
    np.testing.assert_array_equal(
        affinity_filter(cand, prefix, ttft, 0.8, jnp.float32(0.001), 0.01, 5.0), cand
    )
    slow = jnp.array([7.0, 1.0, 9.0, 0.1])  # best sticky 7 s > best other 1 s + 5 s: the gate breaks
    np.testing.assert_array_equal(affinity_filter(cand, prefix, slow, 0.8, jnp.float32(0.5), 0.01, 5.0), cand)
    np.testing.assert_array_equal(
        affinity_filter(cand, prefix, ttft, 0.99, jnp.float32(0.5), 0.01, 5.0), cand
    )


def test_latency_scorer_without_slo_prefers_idle_then_least_predicted_latency():
    cand = jnp.array([True, True, True])
    ttft = jnp.array([0.2, 0.1, 0.4])
    tpot = jnp.array([0.02, 0.02, 0.02])
    busy = jnp.array([3.0, 2.0, 5.0])
    scores = np.asarray(latency_scores(cand, -ttft, -tpot, busy, (0.8, 0.2), True))
    assert scores.argmax() == 1 and scores.argmin() == 2  # least deficit first
    # TPOT is equal everywhere, so TTFT alone is blended: int((1 - (|h| - 0.1) / 0.3) 100) + 1
    np.testing.assert_allclose(scores, [0.67, 1.01, 0.01], atol=1e-6)
    idle = np.asarray(latency_scores(cand, -ttft, -tpot, jnp.array([0.0, 2.0, 0.0]), (0.8, 0.2), True))
    assert idle[1] == 0 and idle[0] > idle[2] > 0  # only idle nodes are scored
    # with SLOs met everywhere, "least" packs: the smallest headroom scores highest
    packed = np.asarray(latency_scores(cand, 1.0 - ttft, 0.1 - tpot, busy, (0.8, 0.2), True))
    assert packed.argmax() == 2


def test_weighted_random_picks_in_proportion_to_scores():
    scores = jnp.array([0.75, 0.25, 0.0])
    keys = jax.random.split(jax.random.key(0), 4000)
    picks = np.asarray(jax.vmap(lambda k: weighted_random(k, scores, jnp.array([True, True, True])))(keys))
    share = np.bincount(picks, minlength=3) / picks.size
    np.testing.assert_allclose(share, [0.75, 0.25, 0.0], atol=0.03)
    zero = np.asarray(
        jax.vmap(lambda k: weighted_random(k, jnp.zeros(3), jnp.array([True, False, True])))(keys)
    )
    assert set(np.unique(zero)) == {0, 2}  # uniform over the candidates when no score is positive


def test_untrained_predictor_predicts_llm_ds_default():
    first, tpot = predictions(default_models(), jnp.ones((3, len(RAW))))
    np.testing.assert_allclose(first, DEFAULT_PREDICTION_S)
    np.testing.assert_allclose(tpot, DEFAULT_PREDICTION_S)


def test_warm_samples_train_the_models_and_the_engine_and_numpy_face_route_alike():
    """Warm samples from a cold router's episodes train its models (TTFT grows with the prefill
    in flight); the warm router runs in the engine, and the step-by-step face fed the same streams
    makes the same decisions with the same random draws."""
    cfg, params, core = _steady()
    cold = PredictedLatency.for_scenario(cfg, params, cache_view="engine")
    warm_seeds = [100, 101, 102]
    warmup = rollout(cfg, params, [cold], warm_seeds, keep_router_state=True)
    samples = warm_samples(cfg, params, warmup, warm_seeds)
    assert samples.features.shape[0] == int((~warmup.dropped).sum()) and np.all(np.isfinite(samples.e2e))
    router = cold.replace(warm=samples)
    state = router.init(2)
    assert not np.allclose(np.asarray(state.models.ttft.coef), 0.0)
    loaded = np.zeros((1, len(RAW)), np.float32)
    loaded[0, RAW.index("prefill_in_flight")] = 20000.0
    first_loaded, _ = predictions(state.models, jnp.asarray(np.concatenate([np.zeros_like(loaded), loaded])))
    assert first_loaded[1] > first_loaded[0]

    seeds = [0, 1]
    batch = rollout(cfg, params, [router], seeds)
    face = StreamedRouter(router, 2)
    face.reset(2, streams=seeds)
    keys = jax.vmap(jax.random.key)(jnp.asarray(seeds, jnp.uint32))
    _, states = jax.vmap(core.reset, in_axes=(0, None))(keys, params)
    step = jax.jit(lambda s, a: core.batched_step_env(s, a, params))
    view_of, seen_of = jax.jit(jax.vmap(lambda s: core.view(s, params))), jax.jit(jax.vmap(streamed))
    nodes = []
    for _ in range(cfg.episode_length):
        view = view_of(states)
        actions = face(None, np.asarray(jax.vmap(action_mask)(view)), view, seen_of(states))
        nodes.append(actions)
        _, states, *_ = step(states, jnp.asarray(actions, jnp.int32))
    np.testing.assert_array_equal(np.stack(nodes, axis=1), batch.node)


def test_refusals():
    with pytest.raises(ValueError, match="strategy"):
        PredictedLatency(8, strategy="best")
    with pytest.raises(ValueError, match="cache_view"):
        PredictedLatency(8, cache_view="both")
    with pytest.raises(ValueError, match="episode_length"):
        PredictedLatency(0)
    router = PredictedLatency(8)
    assert router.family == "learned" and router.reads_state and router == PredictedLatency(8)
