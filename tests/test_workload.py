"""Statistics and JAX contract of the workload parts (burstgym/workload.py)."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from burstgym.workload import (
    DiurnalArrivals,
    EmpiricalLengths,
    GammaArrivals,
    LogNormalLengths,
    MMPPArrivals,
    PoissonArrivals,
    Requests,
    TraceReplay,
    Workload,
    ZipfLengths,
)
from burstgym.workload.traces import Trace

KEY = jax.random.PRNGKey(0)
KEY_B = jax.random.PRNGKey(1)
N = 50_000  # long draws, for statistics
SMALL = 64  # short draws; one size everywhere so eager kernels are compiled once


def _toy_trace(size: int = 50, seed: int = 1) -> Trace:
    rng = np.random.default_rng(seed)
    arrival = np.cumsum(rng.gamma(0.2, 5.0, size))
    arrival -= arrival[0]
    return Trace(arrival, rng.integers(1, 5000, size), rng.integers(1, 500, size))


PROCESSES = {
    "poisson": PoissonArrivals(rate=10.0),
    "gamma": GammaArrivals(rate=10.0, cv=3.0),
    "mmpp": MMPPArrivals(rate=10.0, burst_ratio=math.inf, mean_on=0.2, mean_off=0.8),
    "mmpp_leaky": MMPPArrivals(rate=10.0, burst_ratio=8.0, mean_on=0.5, mean_off=0.5),
    "diurnal": DiurnalArrivals(PoissonArrivals(rate=10.0), amplitude=0.8, period=50.0),
    "trace": TraceReplay(_toy_trace(), rate=10.0),
}


PARTS = {  # name: (part, n), drawn by the `draws` fixture
    **{name: (process, N) for name, process in PROCESSES.items()},
    **{f"faster_{name}": (PROCESSES[name].with_rate(25.0), N) for name in ("poisson", "gamma", "trace")},
    **{f"gamma_cv{cv}": (GammaArrivals(rate=5.0, cv=cv), N) for cv in (0.5, 2.0, 4.0)},
    "diurnal_phase0": (DiurnalArrivals(PoissonArrivals(rate=10.0), amplitude=0.8, period=50.0, phase=0.0), N),
    # MMPP extremes: switching much faster than arrivals; rare intense bursts
    "mmpp_fast_switching": (MMPPArrivals(rate=0.1, burst_ratio=math.inf, mean_on=0.05, mean_off=0.05), SMALL),
    "mmpp_rare_bursts": (MMPPArrivals(rate=500.0, burst_ratio=1e6, mean_on=0.01, mean_off=100.0), SMALL),
    "lognormal": (LogNormalLengths(median=300.0, sigma=1.2, max_tokens=2000, min_tokens=4), N),
    "zipf": (ZipfLengths(exponent=1.5, max_tokens=3000, min_tokens=2), N),
    "empirical": (EmpiricalLengths(np.array([3, 7, 7, 100])), N),
}
ARRIVALS = [name for name, (part, _) in PARTS.items() if hasattr(part, "mean_rate")]


def _eager(part, key: jax.Array, n: int) -> np.ndarray:
    """Op-by-op sampling. Compiled kernels are shared by every part and parameter with the same
    shapes, where `jax.jit` compiles each part anew: this keeps the file fast. `jax.jit` and
    `jax.vmap` are checked by test_workloads_jit_and_vmap."""
    with jax.disable_jit():
        return np.asarray(part.sample(key, n))


@pytest.fixture(scope="module")
def draws() -> dict[str, np.ndarray]:
    """Every part of PARTS drawn once with KEY."""
    return {name: _eager(part, KEY, n) for name, (part, n) in PARTS.items()}


WORKLOADS = (  # together they cover every arrival process and length distribution
    Workload(GammaArrivals(3.0, cv=3.0), LogNormalLengths(1000, 1.0, 8000), ZipfLengths(1.2, 500)),
    Workload(MMPPArrivals(3.0, 8.0, 0.5, 0.5), EmpiricalLengths((5, 9)), LogNormalLengths(50, 1.0, 900)),
    Workload(
        DiurnalArrivals(PoissonArrivals(3.0), 0.5, 60.0), ZipfLengths(1.1, 99), EmpiricalLengths((1, 2))
    ),
    Workload(TraceReplay(_toy_trace()), output=EmpiricalLengths((1, 2, 50))),
)


def test_workloads_jit_and_vmap() -> None:
    """Jitted and vmapped over keys: deterministic per key, different across keys."""
    keys = jnp.stack([KEY, KEY, KEY_B])
    batch = jax.jit(jax.vmap(lambda k: [w.sample(k, SMALL) for w in WORKLOADS]))(keys)
    for requests in batch:
        assert isinstance(requests, Requests)
        assert requests.arrival.dtype == jnp.result_type(float)
        assert requests.prompt.dtype == requests.output.dtype == jnp.int32
        assert int(requests.prompt.min()) >= 1 and int(requests.output.min()) >= 1
        assert np.all(requests.arrival[:, 0] == 0.0) and np.all(np.diff(requests.arrival, axis=1) >= 0)
        assert requests.chunk_ids.shape[:2] == (3, SMALL)
        for column in (requests.arrival, requests.prompt, requests.output):
            assert column.shape == (3, SMALL)
            np.testing.assert_array_equal(column[0], column[1])  # same key, same draw
            assert not np.array_equal(column[0], column[2])  # another key, another draw


@pytest.mark.parametrize("name", ARRIVALS)
def test_arrivals_start_at_zero_and_never_decrease(draws: dict, name: str) -> None:
    times = draws[name]
    assert times.dtype == jnp.result_type(float)
    assert times[0] == 0.0 and np.all(np.isfinite(times)) and np.all(np.diff(times) >= 0)


@pytest.mark.parametrize("name", sorted(PROCESSES))
def test_empirical_rate_matches_mean_rate(draws: dict, name: str) -> None:
    times = draws[name]
    assert (N - 1) / times[-1] == pytest.approx(PROCESSES[name].mean_rate, rel=0.04)


@pytest.mark.parametrize("cv", [0.5, 2.0, 4.0])
def test_gamma_interarrival_cv(draws: dict, cv: float) -> None:
    gaps = np.diff(draws[f"gamma_cv{cv}"])
    assert gaps.std() / gaps.mean() == pytest.approx(cv, rel=0.06)


def _dispersion(times: np.ndarray, window: float) -> float:
    counts = np.bincount((times // window).astype(int))[:-1]  # the last window is partial
    return counts.var() / counts.mean()


def test_mmpp_is_burstier_than_poisson(draws: dict) -> None:
    assert _dispersion(draws["poisson"], 2.0) == pytest.approx(1.0, abs=0.1)
    assert _dispersion(draws["mmpp"], 2.0) > 5.0  # about 13 for long windows (on 1/5 of the time)


def test_mmpp_rates() -> None:
    p = MMPPArrivals(rate=6.0, burst_ratio=4.0, mean_on=1.0, mean_off=2.0)
    assert (p.rate_on * 1.0 + p.rate_off * 2.0) / 3.0 == pytest.approx(6.0)
    assert p.rate_on / p.rate_off == pytest.approx(4.0)
    assert MMPPArrivals(rate=6.0, mean_on=1.0, mean_off=2.0).rate_off == 0.0


def test_diurnal_rate_follows_the_sinusoid(draws: dict) -> None:
    period, amp = 50.0, 0.8
    rising = np.mean((draws["diurnal_phase0"] % period) < period / 2)  # sin > 0 on the first half
    assert rising == pytest.approx((1 + 2 * amp / math.pi) / 2, abs=0.01)


@pytest.mark.parametrize("name", sorted(PROCESSES))
def test_with_rate_is_exact(name: str) -> None:
    process = PROCESSES[name]
    faster = process.with_rate(25.0)
    assert faster.mean_rate == 25.0
    assert faster.with_rate(process.mean_rate) == process


@pytest.mark.parametrize("name", ["poisson", "gamma", "trace"])
def test_with_rate_scales_time(draws: dict, name: str) -> None:
    np.testing.assert_allclose(draws[f"faster_{name}"], draws[name] * 10.0 / 25.0, rtol=1e-5)


def test_workload_with_rate_keeps_lengths() -> None:
    w = Workload(GammaArrivals(rate=2.0, cv=2.0), LogNormalLengths(500, 1.0, 4000), ZipfLengths(1.1, 1000))
    assert w.with_rate(7.0).mean_rate == 7.0
    assert (w.with_rate(7.0).mean_prompt, w.with_rate(7.0).mean_output) == (w.mean_prompt, w.mean_output)


@settings(max_examples=10, deadline=None)
@given(
    rate=st.floats(0.1, 1000.0),
    cv=st.floats(0.2, 8.0),
    amp=st.floats(0.0, 1.0),
    seed=st.integers(0, 2**31 - 1),
)
def test_arrivals_invariants_for_random_parameters(rate: float, cv: float, amp: float, seed: int) -> None:
    key = jax.random.PRNGKey(seed)
    for process in (
        GammaArrivals(rate, cv),
        DiurnalArrivals(GammaArrivals(rate, cv), amp, period=10.0 / rate),
    ):
        times = _eager(process, key, SMALL)
        assert times.shape == (SMALL,) and times[0] == 0.0
        assert np.all(np.isfinite(times)) and np.all(np.diff(times) >= 0)


def test_lognormal_median_bounds_and_mean(draws: dict) -> None:
    x = draws["lognormal"]
    assert x.dtype == np.int32 and x.min() >= 4 and x.max() <= 2000
    assert np.median(x) == pytest.approx(300, abs=5)
    assert x.mean() == pytest.approx(PARTS["lognormal"][0].mean, rel=0.01)


def test_zipf_pmf_bounds_and_mean(draws: dict) -> None:
    x = draws["zipf"]
    assert x.min() >= 2 and x.max() <= 3000
    harmonic = np.sum(np.arange(2, 3001) ** -1.5)
    assert np.mean(x == 2) == pytest.approx(2**-1.5 / harmonic, abs=0.005)
    assert np.mean(x == 3) == pytest.approx(3**-1.5 / harmonic, abs=0.005)
    assert x.mean() == pytest.approx(PARTS["zipf"][0].mean, rel=0.03)


def test_empirical_lengths(draws: dict) -> None:
    x = draws["empirical"]
    assert set(np.unique(x)) == {3, 7, 100}
    assert np.mean(x == 7) == pytest.approx(0.5, abs=0.01)
    assert PARTS["empirical"][0].mean == 29.25
    with pytest.raises(ValueError):
        EmpiricalLengths((0, 5))


@settings(max_examples=15, deadline=None)
@given(
    median=st.floats(1.0, 5000.0),
    sigma=st.floats(0.01, 3.0),
    exponent=st.floats(0.3, 3.0),
    high=st.sampled_from([1, 2, 100, 5000]),  # few table sizes: few compiled shapes
    seed=st.integers(0, 2**31 - 1),
)
def test_lengths_stay_in_bounds(median: float, sigma: float, exponent: float, high: int, seed: int) -> None:
    for dist in (LogNormalLengths(median, sigma, high), ZipfLengths(exponent, high)):
        x = _eager(dist, jax.random.PRNGKey(seed), SMALL)
        assert x.dtype == np.int32 and x.min() >= 1 and x.max() <= high
        assert 1 <= dist.mean <= high


def test_workloads_hash_by_value() -> None:
    trace = _toy_trace()
    copy = Trace(*(np.array(a) for a in trace[:3]))
    assert Workload(TraceReplay(trace)) == Workload(TraceReplay(copy))
    assert hash(Workload(TraceReplay(trace))) == hash(Workload(TraceReplay(copy)))
    assert TraceReplay(trace) != TraceReplay(_toy_trace(seed=2))
    assert hash(EmpiricalLengths((1, 2))) == hash(EmpiricalLengths(np.array([1, 2])))


def test_trace_lengths_need_trace_replay() -> None:
    with pytest.raises(ValueError, match="TraceReplay"):
        Workload(PoissonArrivals(1.0), prompt=LogNormalLengths(10, 1, 100))


def test_trace_replay_reproduces_gaps_and_pairs_with_wraparound() -> None:
    trace = _toy_trace(size=20)
    replay = TraceReplay(trace, rate=4.0)
    scale = replay.native_rate / 4.0
    assert replay.native_rate == pytest.approx(19 / trace.arrival[-1])
    gaps = np.append(np.diff(trace.arrival), trace.arrival[-1] / 19)
    for seed in range(5):
        key = jax.random.PRNGKey(seed)
        with jax.disable_jit():
            requests = Workload(replay).sample(key, SMALL)  # wraps around more than twice
            rows = np.asarray(replay.window(jax.random.split(key, 3)[0], SMALL))
        assert rows[1] == (rows[0] + 1) % 20
        np.testing.assert_array_equal(requests.prompt, trace.prompt[rows])
        np.testing.assert_array_equal(requests.output, trace.output[rows])
        np.testing.assert_allclose(np.diff(requests.arrival), gaps[rows[:-1]] * scale, rtol=1e-4, atol=1e-5)


def test_trace_replay_rejects_bad_traces() -> None:
    with pytest.raises(ValueError, match="non-decreasing"):
        TraceReplay(Trace(np.array([0.0, 2.0, 1.0]), np.ones(3), np.ones(3)))
    with pytest.raises(ValueError, match=">= 1"):
        TraceReplay(Trace(np.array([0.0, 1.0]), np.array([1, 0]), np.ones(2)))
    with pytest.raises(ValueError, match="two requests"):
        TraceReplay(Trace(np.array([0.0]), np.ones(1), np.ones(1)))
