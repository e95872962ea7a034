"""Power that depends on the work: energy_j's form (affine, capped), its bounds, how busy power
follows the work, a hand-computed iteration, JAX tracing, and the fit to measured power."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from burstgym.latency import (
    GPUEnergy,
    PowerModel,
    compose_kernels,
    compose_power_model,
    energy_j,
    list_profiles,
    load_profile,
    step_time,
)
from burstgym.latency.power import busy_power_w, check_power_model, flat_power_model
from burstgym.latency.sources import data_dir

ROOT = data_dir()
needs_data = pytest.mark.skipif(
    not (ROOT / "splitwise").is_dir(),
    reason="Splitwise power data absent (../shared/data/calibration or $BURSTGYM_SHARED_DATA)",
)
REPORTED_A100_POWER_MAPE = 0.038  # in-sample, 20 runs (docs/latency.md)
REPORTED_A100_POWER_LOO = 0.043  # leave one run out

PM = PowerModel(
    idle_w=60.0, tdp_w=700.0, static_w=200.0, iteration_j=2.0, token_j=0.01, kv_token_j=1e-5, pair_j=1e-7
)


def test_energy_is_affine_then_capped() -> None:
    args = np.array([0.05, 512.0, 4096.0, 1e5, 1.0])  # duration, tokens, kv, pairs, iterations
    coef = np.array([PM.static_w, PM.token_j, PM.kv_token_j, PM.pair_j, PM.iteration_j])
    e = float(energy_j(PM, *args))
    assert e == pytest.approx(float(coef @ args))
    # Sum of n identical iterations = one call with everything times n (closed form of a decode run).
    n = 37.0
    assert float(energy_j(PM, *(args * n))) == pytest.approx(n * e)
    # A busy iteration cannot exceed the board limit.
    heavy = args.copy()
    heavy[1] = 1e6
    assert float(energy_j(PM, *heavy)) == pytest.approx(PM.tdp_w * heavy[0])


def test_hand_computed_iteration_on_a_shipped_profile() -> None:
    """Energy of one decode iteration of 16 sequences x 1000 context tokens, by hand."""
    p = load_profile("h100-llama-3-8b-tp1")
    duration = float(p.step_time(decode_seqs=16, kv_tokens=16_000))
    pm = p.power
    by_hand = (
        pm.static_w * duration + pm.iteration_j * 1 + pm.token_j * 16 + pm.kv_token_j * 16_000 + pm.pair_j * 0
    )
    assert float(energy_j(pm, duration, 16, 16_000, 0, 1)) == pytest.approx(by_hand, rel=1e-6)
    # The coefficients are the energy roofline: static power, and roof power x the kernels' seconds.
    e = p.energy
    kernels = compose_kernels(p.gpu, p.model, p.tp, serving=False)
    p_mem, p_comp = e.joule_per_byte * p.gpu.mem_bw, e.joule_per_flop * p.gpu.flops
    assert pm.static_w == pytest.approx(e.static_w)
    assert pm.iteration_j == pytest.approx(p_mem * float(kernels.weights_s))
    assert pm.kv_token_j == pytest.approx(p_mem * float(kernels.kv_token_s))
    assert pm.pair_j == pytest.approx(p_comp * float(kernels.prefill_pair_s))
    # Weights and GEMMs are charged per byte and per FLOP: 2 x parameters FLOPs per token.
    flops = 2 * p.model.num_layers * p.model.layer_params(1)
    assert pm.token_j >= e.joule_per_flop * flops * 0.999
    assert pm.iteration_j == pytest.approx(e.joule_per_byte * p.model.streamed_weight_bytes(1), rel=1e-9)


def test_busy_power_between_idle_and_tdp_for_every_profile() -> None:
    for name in list_profiles():
        p = load_profile(name)
        check_power_model(p.power, name)
        assert p.idle_power_w == pytest.approx(float(p.power.idle_w))
        assert p.busy_power_w == pytest.approx(float(p.power.tdp_w))  # busy = the board limit
        b = np.array([1.0, 8, 64, 256])
        for watts in (
            p.iteration_power_w(decode_seqs=b, kv_tokens=b * 2048),
            p.iteration_power_w(prefill_tokens=np.array([1.0, 64, 512, 4096, 16384])),
            p.iteration_power_w(prefill_tokens=512, decode_seqs=b, kv_tokens=b * 100),
        ):
            w = np.asarray(watts)
            assert np.all(w >= float(p.power.idle_w)) and np.all(w <= float(p.power.tdp_w) + 1e-6), name


def test_decode_draws_less_than_prefill_and_more_with_more_work() -> None:
    for name in list_profiles():
        p = load_profile(name)
        decode1 = float(p.iteration_power_w(decode_seqs=1, kv_tokens=512))
        decode64 = float(p.iteration_power_w(decode_seqs=64, kv_tokens=64 * 512))
        prefill = float(p.iteration_power_w(prefill_tokens=4096))
        assert decode1 < decode64 < prefill, name
        assert prefill > 0.9 * float(p.power.tdp_w), name  # compute-bound work runs near the limit


def _monotone(watts: np.ndarray, rel: float) -> bool:
    w = np.asarray(watts, np.float64)
    return bool(np.all(np.maximum.accumulate(w) - w <= rel * w))


def test_busy_power_is_monotone_in_the_work() -> None:
    """Along context length exactly; along decode batch and prompt length in whole GEMM tiles, where
    step time and energy see the same compute, within 1% for decode and 1.5% for prefill (the
    knee of the roofline: memory and compute power overlap there, then the compute-bound draw of
    element-wise and all-reduce traffic sits below the cap). Between tile multiples step time charges
    a whole tile of compute that energy_j, affine in the token count, does not (docs/latency.md)."""
    with jax.enable_x64(True):
        for name in list_profiles():
            p = load_profile(name)
            tile = float(p.latency.tile_tokens)
            ctx = np.arange(0.0, 32768.0, 16.0)
            assert _monotone(p.iteration_power_w(decode_seqs=8, kv_tokens=8 * ctx), 0.0), name
            b = np.arange(tile, 513.0, tile)
            for c in (128.0, 1024.0, 8192.0):
                assert _monotone(p.iteration_power_w(decode_seqs=b, kv_tokens=b * c), 0.01), (name, c)
            t = np.arange(tile, 16385.0, tile)
            assert _monotone(p.iteration_power_w(prefill_tokens=t), 0.015), name


def test_energy_jits_vmaps_and_differentiates() -> None:
    pms = [load_profile(n).power for n in ("h100-llama-3-8b-tp1", "a100-llama-3-8b-tp1")]
    stacked = jax.tree.map(lambda *xs: jnp.asarray(xs), *pms)
    f = jax.jit(jax.vmap(energy_j, in_axes=(0, None, None, None, None, None)))
    out = f(stacked, 0.01, 16.0, 16.0 * 1024, 0.0, 1.0)
    assert out.shape == (2,) and bool(jnp.all(out > 0))
    grad = jax.grad(lambda kv: energy_j(pms[0], 0.01, 16.0, kv, 0.0, 1.0))(1024.0)
    assert float(grad) == pytest.approx(float(pms[0].kv_token_j))
    assert float(busy_power_w(pms[0], 0.0, 0.0, 0.0, 0.0, 0)) == pytest.approx(float(pms[0].static_w))


def test_flat_model_for_profiles_without_an_energy_fit() -> None:
    p = load_profile("h100-llama-3-8b-tp1")
    legacy = dataclasses.replace(p, power=None, energy=None)
    legacy = type(p)(**{**legacy.__dict__, "power": None})
    assert legacy.power == flat_power_model(p.idle_power_w, p.busy_power_w)
    assert float(legacy.iteration_power_w(decode_seqs=1, kv_tokens=100)) == pytest.approx(p.busy_power_w)


def test_bad_power_coefficients_are_refused() -> None:
    with pytest.raises(ValueError, match="idle_w <= static_w <= tdp_w"):
        check_power_model(PM._replace(static_w=800.0), "x")
    with pytest.raises(ValueError, match="power.token_j"):
        check_power_model(PM._replace(token_j=-1.0), "x")


def test_compose_power_model_scales_with_tp() -> None:
    p = load_profile("h100-llama-2-70b-tp8")
    e = GPUEnergy("g", 70.0, 700.0, 200.0, 1e-10, 5e-13)
    k1 = compose_kernels(p.gpu, p.model, 1, serving=False)
    k8 = compose_kernels(p.gpu, p.model, 8, serving=False)
    rates = (p.gpu.mem_bw, p.gpu.flops)
    one, eight = compose_power_model(e, k1, 1, rates), compose_power_model(e, k8, 8, rates)
    assert eight.idle_w == 8 * one.idle_w and eight.tdp_w == 8 * one.tdp_w
    # The node streams the same weights in total, split over the ranks.
    assert eight.iteration_j == pytest.approx(one.iteration_j, rel=1e-9)
    assert float(step_time(k8, 0, 1, 100)) < float(step_time(k1, 0, 1, 100))


@needs_data
def test_a100_energy_fit_matches_measured_average_power() -> None:
    from burstgym.latency import validate

    gpu = validate.shipped_gpus()["a100"]
    energy, report = validate.fit_splitwise_energy(ROOT, gpu)
    assert report["runs"] == 20 and len(report["excluded"]) == 2  # the two 8192-token prompts
    assert report["power_mape"] <= REPORTED_A100_POWER_MAPE
    assert report["power_mape_leave_one_out"] <= REPORTED_A100_POWER_LOO
    assert energy.idle_w <= energy.static_w < energy.tdp_w
    # Compute-bound work draws the board limit (Splitwise's peak power readings).
    assert energy.static_w + energy.joule_per_flop * gpu.flops == pytest.approx(energy.tdp_w)
    shipped = load_profile("a100-llama-3-8b-tp1").energy
    assert shipped.static_w == pytest.approx(energy.static_w, rel=1e-3)


def test_power_setting_flat_draws_the_board_limit_whenever_busy() -> None:
    """Scenario setting power="flat": a node draws its TDP while an iteration runs and its idle power
    otherwise, whatever the work; the same episode under the roofline (the default) has the same
    latencies (power does not touch timing) and draws less. Unknown power models are refused."""
    from conftest import BASE, base, rollout

    from burstgym import scenarios

    actions = np.arange(BASE["episode_length"]) % BASE["n_nodes"]
    cfg, flat = base(power="flat")
    _, roofline = base()
    _, _, st_flat, _ = rollout(cfg, flat, 0, actions)
    _, _, st_roof, _ = rollout(cfg, roofline, 0, actions)
    np.testing.assert_array_equal(st_flat.log.e2e, st_roof.log.e2e)
    np.testing.assert_array_equal(st_flat.nodes.busy_s, st_roof.nodes.busy_s)
    p = load_profile(scenarios.DEFAULT_PROFILE)
    busy = np.asarray(st_flat.nodes.busy_s, np.float64)
    by_hand = p.busy_power_w * busy + p.idle_power_w * (float(st_flat.t_end) - busy)
    np.testing.assert_allclose(st_flat.nodes.energy_j, by_hand, rtol=1e-4)
    assert np.all(np.asarray(st_roof.nodes.energy_j) < np.asarray(st_flat.nodes.energy_j))
    with pytest.raises(ValueError, match="'power'"):
        scenarios.make("bursty", power="tdp")
