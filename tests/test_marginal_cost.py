"""marginal-cost: its predictions against the simulator, and the router in both faces.

A lone request on an idle node is predicted exactly (its own output length given as the mean):
prefill in one iteration, then `output - 1` decode iterations whose step time is affine in the KV
read. On a loaded node the prediction is a model (the other requests' lengths are unknown, the
batch changes), held to the error measured at this version (docs/headroom.md).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from agents.marginal_cost import MarginalCost
from agents.rollout import Rollout
from agents.routers import BatchedRouter
from burstgym import scenarios
from burstgym.env import BurstBalance
from burstgym.prediction import estimate, length_stats
from burstgym.routing import FAMILIES
from burstgym.types import ASLEEP, LengthStats

# A front end of 11.3 ms (the vllm-serve engine's, docs/latency.md) and a mixture-of-experts node
# (experts' weights read 3 ms, a token routed to a quarter of them).
FRONT_END_MOE = (("frontend_s", 0.0113), ("expert_weights_s", 3e-3), ("expert_fraction", 0.25))


@functools.lru_cache(maxsize=8)
def _one_node(scenario: str, episode_length: int, load: float, latency: tuple = ()):
    cfg, params = scenarios.make(scenario, n_nodes=1, episode_length=episode_length, load=load)
    lat = params.nodes.latency
    lat = lat._replace(**{k: jnp.full_like(lat.weights_s, v) for k, v in latency})
    params = params._replace(nodes=params.nodes._replace(latency=lat))
    core = BurstBalance(cfg)
    router = MarginalCost.for_scenario(cfg, params)
    est = jax.jit(lambda view, lengths: router.replace(lengths=lengths).estimate(view))
    return cfg, params, core, router, jax.jit(core.step_env), jax.jit(core.view), est


def _predicted_and_simulated(scenario: str, episode_length: int, load: float, seed: int, latency=()):
    """Per request of one episode on one node: predicted (TTFT, e2e) given its own output length as
    the mean, and the simulated ones (`latency`: fields of the node's LatencyModel to set)."""
    cfg, params, core, router, step, view, est = _one_node(scenario, episode_length, load, latency)
    _, state = core.reset(jax.random.key(seed), params)
    output = np.asarray(state.requests.output)
    predicted = []
    for k in range(episode_length):
        lengths = router.lengths._replace(mean_output=np.float32(output[k]))
        e = est(view(state, params), lengths)
        predicted.append((float(e.ttft[0]), float(e.e2e[0])))
        _, state, *_ = step(state, jnp.int32(0), params)
    simulated = np.stack([np.asarray(state.log.ttft), np.asarray(state.log.e2e)], axis=1)
    return np.asarray(predicted), simulated, np.asarray(state.requests.prompt)


@pytest.mark.parametrize("latency", [(), FRONT_END_MOE], ids=["dense", "front-end-moe"])
@pytest.mark.parametrize("scenario", ["steady", "bursty-dynamic"])
def test_a_lone_request_is_predicted_exactly(scenario, latency):
    """Continuous batching: one prefill iteration, then decode; batching window: the window, then
    the batch of one (padded to its own prompt). With a front end, both TTFT and e2e include it; on
    a mixture-of-experts node, every iteration reads the experts its tokens touch."""
    for seed in (0, 1, 2):
        predicted, simulated, prompt = _predicted_and_simulated(scenario, 1, 0.5, seed, latency)
        assert prompt[0] > 1  # a one-token prompt is a decode step (not this case)
        np.testing.assert_allclose(predicted, simulated, rtol=2e-5)


def test_loaded_node_predictions_stay_within_the_measured_error():
    """One node at load 0.9 (steady, 64 requests): e2e within 25% on average (measured 18.3% over
    two seeds), TTFT within 30% at the median (measured 18.9%)."""
    ttft_err, e2e_err = [], []
    for seed in (0, 1):
        predicted, simulated, _ = _predicted_and_simulated("steady", 64, 0.9, seed)
        rel = np.abs(predicted - simulated) / simulated
        ttft_err.append(rel[:, 0])
        e2e_err.append(rel[:, 1])
    assert np.mean(np.concatenate(e2e_err)) < 0.25
    assert np.median(np.concatenate(ttft_err)) < 0.30


def _view(**fields):
    """A one-cluster RouterView of 2 nodes with every load signal zero, then `fields`."""
    cfg, params = scenarios.make("steady", n_nodes=2, episode_length=8)
    _, state = BurstBalance(cfg).reset(jax.random.key(0), params)
    view = BurstBalance(cfg).view(state, params)
    return (
        cfg,
        params,
        view._replace(**{k: jnp.asarray(v, getattr(view, k).dtype) for k, v in fields.items()}),
    )


def test_cost_grows_with_queued_prefill_and_batch_and_falls_with_cache_hits():
    cfg, params, view = _view(prompt=2048.0)
    router = MarginalCost.for_scenario(cfg, params)
    base = router.estimate(view)
    assert np.allclose(base.cost[0], base.cost[1]) and np.all(np.asarray(base.delay) == 0)
    queued = router.estimate(view._replace(prefill_tokens=jnp.asarray([20000.0, 0.0])))
    assert queued.ttft[0] > queued.ttft[1] and queued.cost[0] > queued.cost[1]
    busy = router.estimate(
        view._replace(running=jnp.asarray([50.0, 0.0]), kv_used=jnp.asarray([4000.0, 0.0]))
    )
    assert busy.e2e[0] > busy.e2e[1] and busy.delay[0] > 0 and busy.delay[1] == 0
    hit = router.estimate(view._replace(hit_tokens=jnp.asarray([1536.0, 0.0])))
    assert hit.ttft[0] < hit.ttft[1] and hit.cost[0] < hit.cost[1]


def test_a_sleeping_node_costs_its_wake_up_and_the_energy_of_staying_awake():
    _, _, view = _view(phase=[ASLEEP, 0])
    cfg, params = scenarios.make("energy", n_nodes=2, episode_length=8)
    router = MarginalCost.for_scenario(cfg, params)
    e = router.estimate(view)
    wake = float(params.nodes.wake_delay[0])
    assert float(e.ttft[0] - e.ttft[1]) == pytest.approx(wake, rel=1e-5)
    assert e.energy[0] > 0 and e.energy[1] == 0
    assert float(e.cost[0] - e.cost[1]) > wake  # the energy term on top of the latency


def test_a_full_queue_costs_the_drop_penalty():
    cfg, params, view = _view(accepts=[False, True])
    e = MarginalCost.for_scenario(cfg, params).estimate(view)
    assert float(e.cost[0] - e.cost[1]) == pytest.approx(float(params.drop_penalty), rel=1e-4)


def test_length_stats_give_the_expected_longest_of_a_batch():
    cfg, _ = scenarios.make("bursty-dynamic", episode_length=8)
    stats = length_stats(cfg.workload, 16)
    longest = np.asarray(stats.longest_output)
    assert longest[0] == pytest.approx(cfg.workload.mean_output, rel=0.05)  # the longest of one: the mean
    assert np.all(np.diff(longest) > 0)  # grows with the batch


def test_estimate_refuses_an_unknown_scheduler():
    cfg, params, view = _view()
    router = MarginalCost.for_scenario(cfg, params)
    with pytest.raises(ValueError, match="scheduler"):
        estimate(view, router.nodes, LengthStats(*router.lengths), router.weights, scheduler="static")


def test_router_protocol_and_hash_by_content():
    cfg, params = scenarios.make("steady", n_nodes=2, episode_length=8)
    a, b = MarginalCost.for_scenario(cfg, params), MarginalCost.for_scenario(cfg, params)
    assert a == b and hash(a) == hash(b) and a.family in FAMILIES
    cfg2, params2 = scenarios.make("steady", n_nodes=2, episode_length=8, output_median=512.0)
    assert MarginalCost.for_scenario(cfg2, params2) != a


@pytest.mark.default_codegen
def test_engine_and_step_by_step_face_route_alike():
    """The rollout engine and the batched NumPy face (`BatchedRouter`, jit(vmap(act))) give the
    same episodes."""
    rollout = Rollout("bursty", n_nodes=2, episode_length=24)
    router = MarginalCost.for_scenario(rollout.cfg, rollout.params)
    seeds = [0, 1]
    engine = rollout.run([router], seeds, engine="jax")["marginal-cost"]
    stepped = rollout.run([BatchedRouter(router, 2)], seeds, engine="numpy")["marginal-cost"]
    np.testing.assert_array_equal(engine.cost, stepped.cost)
    np.testing.assert_array_equal(engine.e2e, stepped.e2e)
