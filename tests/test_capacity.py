"""`load` is relative to the analytic capacity of `burstgym.capacity`: below it a node's queue
stays bounded, above it the queue grows at the excess rate (queueing theory: a G/G/1 queue is
stable iff rho < 1, and the backlog of an overloaded one grows at lambda - mu)."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator

import jax
import numpy as np
import pytest
from conftest import rollout

from burstgym import capacity, scenarios
from burstgym.latency import list_profiles, load_profile, step_time
from burstgym.workload import MMPPArrivals, Trace, TraceReplay, Workload

E = 3000
# One slot width: the queue grows to hundreds, and what is checked here is queueing, not the
# narrow tables (tests/test_core.py checks those), so one compiled width keeps the test short.
ONE_NODE = dict(
    n_nodes=1,
    episode_length=E,
    queue_capacity=1000,
    slots=1100,
    slot_widths=(),
    end="cut",
    prompt_max=1024,
    output_max=512,
)


@contextlib.contextmanager
def _compiles() -> Iterator[list[str]]:
    """The names of the programs XLA compiles inside the block, in order."""
    names: list[str] = []

    def listen(event: str, seconds: float, **kw) -> None:
        if event == "/jax/core/compile/backend_compile_duration":
            names.append(kw.get("fun_name"))

    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
        yield names
    finally:
        jax.monitoring.unregister_event_duration_listener(listen)


@pytest.mark.parametrize(
    "scheduler", [dict(scheduler="continuous", max_num_seqs=16), dict(scheduler="dynamic", max_batch_size=8)]
)
def test_load_is_relative_to_capacity(scheduler) -> None:
    """At load 0.9 the queue empties again and again; at 1.1 it ends near (lambda - mu) * T."""
    for load in (0.9, 1.1):
        cfg, params = scenarios.make("steady", load=load, **ONE_NODE, **scheduler)
        for seed in range(2):
            _, _, _, tr = rollout(cfg, params, seed, np.zeros(E, np.int64), optimized=True)
            assert (tr["error"] == 0).all()
            waiting = tr["waiting"][:, 0]
            if load < 1:
                assert waiting.max() < 0.05 * E and (waiting[E // 2 :] == 0).any()
            else:
                # (lambda - mu) * T with lambda = E / T and mu = lambda / load
                excess = (1.0 - 1.0 / load) * E
                assert 0.5 * excess < waiting[-1] < 1.5 * excess


def test_dynamic_capacity_times_each_batch_from_its_own_iterations() -> None:
    """Two batches of two requests, timed by hand from `step_time`: a batch prefills together (padded
    to its longest prompt with `padding`) and decodes until its longest member is done; the rows
    that pad the shorter batch's iterations take no time. All of it compiles at most two programs
    (prefills, decodes), not one per operation and batch length."""
    model = load_profile(list_profiles()[0]).latency
    prompts, outputs = np.array([10.0, 20.0, 5.0, 7.0]), np.array([3.0, 1.0, 2.0, 2.0])

    def t(prefill: float, decode: float, kv: float, pairs: float) -> float:
        return float(step_time(model, prefill, decode, kv, pairs))

    plain = [
        t(30, 0, 0, 55 + 210) + t(0, 1, 10, 0) + t(0, 1, 11, 0),  # only the 3-token request decodes
        t(12, 0, 0, 15 + 28) + t(0, 2, 12, 0),
    ]
    padded = [t(40, 0, 0, 420) + t(0, 2, 40, 0) + t(0, 2, 42, 0), t(14, 0, 0, 56) + t(0, 2, 14, 0)]
    for padding, times in ((False, plain), (True, padded)):
        cap = capacity.dynamic_capacity(model, 2.0, 2, prompts, outputs, padding)
        assert cap.concurrency == 2.0
        assert cap.rps == pytest.approx(2 / (2.0 * np.mean(times)), rel=1e-6)
    fresh = np.array([900.0, 3.0] * 8)  # a batch length this process has not timed before
    with _compiles() as compiles:
        capacity.dynamic_capacity(model, 1.0, 4, fresh + 1.0, fresh, False)
    assert len(compiles) <= 2 and set(compiles) <= {"jit(_step_times)"}, compiles


def test_the_length_sample_compiles_once_and_draws_what_the_workload_draws() -> None:
    """`capacity.sample_lengths` draws a workload's sample in one compiled program (its operations
    run one by one would each compile apart), with the same lengths as the workload's own sampler
    run operation by operation; workloads differing only in what cannot change the lengths (a
    generated arrival process, a rate) share it."""
    cfg, _ = scenarios.make("prefix", episode_length=16)
    n = 777  # a sample size this process has not drawn before
    key = jax.random.key(capacity.SEED)  # the key's own operation, compiled before listening
    with _compiles() as compiles:
        prompts, outputs = capacity.sample_lengths(cfg.workload, n)
    assert compiles == ["jit(_draw)"], compiles
    eager = cfg.workload.sample(key, n)
    np.testing.assert_array_equal(prompts, np.asarray(eager.prompt, np.float64))
    np.testing.assert_array_equal(outputs, np.asarray(eager.output, np.float64))
    assert prompts.shape == (n,) and (prompts >= 1).all() and (outputs >= 1).all()
    # the same workload at another rate and with bursty arrivals: lengths are drawn from keys of
    # their own, so the draw is the same and its program is reused
    bursty = dataclasses.replace(cfg.workload, arrivals=MMPPArrivals(rate=3.0, burst_ratio=4.0))
    with _compiles() as compiles:
        again = capacity.sample_lengths(bursty, n)
    assert compiles == [], compiles
    np.testing.assert_array_equal(again[0], prompts)
    np.testing.assert_array_equal(again[1], outputs)
    # a trace replayed at two rates: the episode's rows do not depend on the rate
    trace = Trace(np.arange(40.0), np.arange(1, 41, dtype=np.int32), np.full(40, 7, np.int32))
    slow, fast = (Workload(TraceReplay(trace, rate=r)) for r in (0.5, 20.0))
    drawn = capacity.sample_lengths(slow, n)
    with _compiles() as compiles:
        again = capacity.sample_lengths(fast, n)
    assert compiles == [], compiles
    np.testing.assert_array_equal(again[0], drawn[0])
    np.testing.assert_array_equal(again[1], drawn[1])
    assert set(drawn[0]) == set(range(1, 41)) and set(drawn[1]) == {7.0}
