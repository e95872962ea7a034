"""The front-end latency and the mixture-of-experts weight term, in both simulators.

- A node with `frontend_s` = F gives every accepted request F more TTFT and e2e than the same node
  without it, changes no schedule (same fates, same inter-token gaps), and charges F (plus the TTFT
  weight's share) to the objective when the request is routed, so the rewards still sum to the
  logged objective; the JAX core and the reference agree request by request.
- A MoE node reads the experts its tokens touch: a decode of one token reads k/E of them, a large
  pass all of them, and the core and the reference agree on an episode of such a node.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import base, rollout

from burstgym.latency import LatencyModel, load_model_config, load_profile, step_time
from burstgym.latency.profiles import compose_kernels
from burstgym.reference import nodes_from_params, simulate

FRONTEND = 0.012  # seconds


def _episode(frontend: float, moe: bool = False):
    """(reference result, JAX final state, JAX per-step trace, params) of one small overloaded
    episode, routed at random with half the traffic on node 0."""
    with jax.enable_x64(True):
        cfg, params = base("continuous", ttft_weight=0.5)
        lat = params.nodes.latency
        fields = {"frontend_s": jnp.full_like(lat.frontend_s, frontend)}
        if moe:
            fields |= {
                "expert_weights_s": jnp.full_like(lat.weights_s, 3e-3),
                "expert_fraction": jnp.full_like(lat.weights_s, 0.25),
            }
        params = jax.tree.map(
            lambda x: x.astype(float) if jnp.issubdtype(x.dtype, jnp.floating) else x,
            params._replace(nodes=params.nodes._replace(latency=lat._replace(**fields))),
        )
        rng = np.random.default_rng(3)
        e = cfg.episode_length
        actions = rng.choice(cfg.n_nodes, e, p=[0.5] + [0.5 / (cfg.n_nodes - 1)] * (cfg.n_nodes - 1))
        _, st0, st, trace = rollout(cfg, params, 5, actions.astype(np.int32), x64=True)
        req = jax.tree.map(np.asarray, st0.requests)
        ref = simulate(
            nodes_from_params(cfg, params), req.arrival[:e], req.prompt[:e], req.output[:e], actions,
            ttft_weight=float(params.ttft_weight), drop_penalty=float(params.drop_penalty),
            energy_weight=float(params.energy_weight),
        )  # fmt: skip
    return ref, jax.tree.map(np.asarray, st), trace, params


@pytest.fixture(scope="module")
def with_and_without():
    return _episode(FRONTEND), _episode(0.0)


def test_frontend_shifts_ttft_and_e2e_and_nothing_else(with_and_without) -> None:
    (ref, _, _, _), (plain, _, _, _) = with_and_without
    served = np.isfinite(plain.finish_time)
    assert served.sum() > 50 and ref.dropped.any()
    np.testing.assert_array_equal(ref.dropped, plain.dropped)
    np.testing.assert_allclose(ref.ttft[served], plain.ttft[served] + FRONTEND, rtol=1e-12)
    np.testing.assert_allclose(ref.e2e_latency[served], plain.e2e_latency[served] + FRONTEND, rtol=1e-12)
    np.testing.assert_allclose(ref.tpot[served], plain.tpot[served], rtol=1e-9)
    np.testing.assert_allclose(ref.energy_j, plain.energy_j, rtol=1e-12)
    extra = (1 + 0.5) * FRONTEND * served.sum()  # e2e + 0.5 TTFT per served request
    assert ref.objective == pytest.approx(plain.objective + extra, rel=1e-9)


@pytest.mark.parametrize("moe", [False, True])
def test_core_matches_reference(moe: bool, with_and_without) -> None:
    ref, st, trace, params = with_and_without[0] if not moe else _episode(FRONTEND, moe=True)
    finished = np.isfinite(ref.finish_time)
    np.testing.assert_array_equal(st.log.dropped, ref.dropped)
    np.testing.assert_array_equal(np.isfinite(st.log.e2e), finished)
    np.testing.assert_allclose(st.log.ttft[finished], ref.ttft[finished], rtol=1e-3, atol=1e-6)
    np.testing.assert_allclose(st.log.e2e[finished], ref.e2e_latency[finished], rtol=1e-3, atol=1e-6)
    cost = -trace["reward"] * float(params.reward_scale)
    np.testing.assert_allclose(cost, ref.step_cost, rtol=1e-3, atol=1e-6)
    # the rewards sum to the logged objective (Little's law with the front end charged at routing)
    served = finished & ~ref.dropped
    logged = np.sum(ref.e2e_latency[served] + 0.5 * ref.ttft[served])
    logged += (
        float(params.drop_penalty) * ref.dropped.sum() + float(params.energy_weight) * ref.energy_j.sum()
    )
    assert cost.sum() == pytest.approx(logged, rel=1e-6)


def test_moe_reads_the_experts_its_tokens_touch() -> None:
    mixtral = load_model_config("mixtral-8x7b")
    gpu = load_profile("h100-llama-2-70b-tp8").gpu
    k = compose_kernels(gpu, mixtral, 2, serving=False)
    assert float(k.expert_fraction) == pytest.approx(2 / 8)
    assert float(k.expert_weights_s) > 10 * float(k.weights_s)  # experts are most of the weights
    # only the weight-streaming terms: a pass is as long as reading the weights it needs
    weights_only = LatencyModel(**{f: 0.0 for f in LatencyModel._fields})._replace(
        weights_s=k.weights_s, expert_weights_s=k.expert_weights_s, expert_fraction=k.expert_fraction,
        knee_p=k.knee_p, tile_tokens=k.tile_tokens,
    )  # fmt: skip
    # one token reads 2 of 8 experts, 64 tokens all of them (1 - (3/4)^64 ~ 1)
    one = float(step_time(weights_only, 0, 1, 0))
    many = float(step_time(weights_only, 0, 64, 0))
    assert one == pytest.approx(float(k.weights_s + 0.25 * k.expert_weights_s), rel=1e-6)
    assert many == pytest.approx(float(k.weights_s + k.expert_weights_s), rel=1e-6)
    # compute counts the routed experts only: 12.9B active of 46.7B parameters (Mixtral paper)
    active = mixtral.num_layers * mixtral.layer_params() + mixtral.lm_head_params()
    total = mixtral.num_layers * mixtral.stored_layer_params() + 2 * mixtral.lm_head_params()
    assert 12.5e9 < active < 13.0e9 and 46.4e9 < total < 47.0e9
