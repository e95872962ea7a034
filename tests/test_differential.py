"""Differential test: the JAX core against the independent reference simulator (burstgym.reference).

Both get the same request stream (the core's `state.requests` after reset) and the same routing
actions; every request must get the same fate (dropped, finished or, with `end="cut"`, still in
flight), the same preemption count and first-admission cache hit, and the same TTFT and end-to-end
latency within 0.1% relative (absolute floor 1e-6 s); the per-node energy, prefilled and
cache-served tokens, the episode's end and each step's reward must agree too.

The reference simulates every iteration on its own, so these cases also hold the core's folding of
identical decode iterations into one event (`scheduler.decode_run`) to the iteration-level rules.
Each case is one `EnvConfig` (one compile); variants change only `EnvParams`, so they reuse it.
Between them the cases cover both schedulers, prefix caching with evictions, padded and unpadded
dynamic batches, sleep and wake, both episode ends, both reward timings and the three objectives,
with TTFT and energy weighted in the objective.

The core runs under `jax.enable_x64`: in float32 the clock's rounding over hundreds of iterations
can exceed 0.1% of the shortest TTFTs, a precision artefact, not a semantic difference.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import TIGHT_SHARED_PREFIX, rollout

from burstgym import scenarios
from burstgym.reference import RefResult, nodes_from_params, simulate

REL = 1e-3  # relative tolerance on TTFT, e2e latency, energy, objective
ABS = 1e-6  # seconds: floor for tiny values

SMALL = dict(prompt_median=96.0, prompt_max=384, output_median=48.0, output_max=192, block_size=16)
WEIGHTS = dict(ttft_weight=0.5, energy_weight=1e-4)
# A shrunk "conversation": 3 turns at most, 2 s think time, 512-token chunks (a shared system
# prompt, then each session's own), 2560 KV tokens per node (5 chunks).
CONVERSATION = dict(
    n_nodes=3,
    episode_length=240,
    load=1.0,
    max_num_seqs=8,
    queue_capacity=6,
    kv_capacity_tokens=2560,
    max_num_batched_tokens=512,
    prompt_median=64.0,
    prompt_max=128,
    output_median=48.0,
    output_max=128,
    conv_max_turns=3,
    think_time=2.0,
)

# name: (scenario, overrides); the objective, reward and end vary across the cases. Building a
# dynamic-batching scenario estimates its capacity from sampled batches (slow), so "unpadded" is
# "padded"'s build with other static switches (`SWITCHES`), arrivals and parameters unchanged.
CASES = {
    # Tight KV (1024 tokens = 64 blocks) and a 6-deep queue under skewed overload: preemptions and drops.
    "continuous": (
        "bursty",
        dict(
            n_nodes=3,
            episode_length=300,
            load=1.1,
            max_num_seqs=8,
            queue_capacity=6,
            kv_capacity_tokens=1024,
            max_num_batched_tokens=384,
            prefix_caching=False,
            **SMALL,
            **WEIGHTS,
        ),
    ),
    "prefix": (
        "conversation",
        dict(**CONVERSATION, objective="excess", reward="finish", end="cut", **WEIGHTS),
    ),
    # Shared prefixes on tight KV under skewed overload (conftest.TIGHT_SHARED_PREFIX).
    "prefix-shared": (
        "prefix",
        dict(
            n_nodes=4,
            episode_length=160,
            load=1.5,
            **TIGHT_SHARED_PREFIX,
        ),
    ),
    "padded": (
        "bursty-dynamic",
        dict(
            n_nodes=2,
            episode_length=300,
            load=1.1,
            max_batch_size=4,
            max_queue_delay=0.05,
            queue_capacity=5,
            objective="slo",
            **SMALL,
            **WEIGHTS,
        ),
    ),
}
SWITCHES = {"unpadded": ("padded", dict(padding=False, objective="latency", end="cut"))}
# Variants: (base case, parameter changes). "sleep": 4x faster nodes (lower load), sleep after
# 0.5 s idle, a 0.4 s wake-up, more weight on energy. "prefix-tight": 80 KV blocks (2.5 chunks)
# and 2x slower nodes, so the cache evicts under overload and requests are preempted.
VARIANTS = {
    "sleep": ("continuous", dict(speed=0.25, sleep_timeout=0.5, wake_delay=0.4, energy_weight=1e-3)),
    "prefix-tight": ("prefix", dict(speed=2.0, kv_blocks=80)),
}


def _vary(params, changes: dict):
    """`params` with the node fields in `changes` set on every node (`speed` multiplies)."""
    n = params.nodes
    fields = {}
    for key, value in changes.items():
        if key == "speed":
            fields[key] = n.speed * value
        elif key in n._fields:
            fields[key] = jnp.full_like(getattr(n, key), value)
    params = params._replace(nodes=n._replace(**fields))
    if "energy_weight" in changes:
        params = params._replace(energy_weight=jnp.full_like(params.energy_weight, changes["energy_weight"]))
    return params


def _actions(n_nodes: int, length: int, seed: int) -> np.ndarray:
    """Random routing skewed to node 0 (half the traffic), so one node overloads."""
    rng = np.random.default_rng(seed)
    p = np.r_[0.5, np.full(n_nodes - 1, 0.5 / (n_nodes - 1))]
    return rng.choice(n_nodes, size=length, p=p).astype(np.int32)


def _reference(cfg, params, req, actions) -> RefResult:
    """The reference's episode on the core's stream (the first E requests; the next marks the cut)."""
    e = cfg.episode_length
    return simulate(
        nodes_from_params(cfg, params), req.arrival[:e], req.prompt[:e], req.output[:e], actions,
        chunk_ids=req.chunk_ids[:e], id_tokens=req.id_tokens[:e],
        grain=cfg.chunk_tokens, objective=cfg.objective, reward=cfg.reward, end=cfg.end,
        t_cut=float(req.arrival[e]), drop_penalty=float(params.drop_penalty),
        energy_weight=float(params.energy_weight), ttft_weight=float(params.ttft_weight),
        ttft_slo=float(params.ttft_slo), tpot_slo=float(params.tpot_slo),
    )  # fmt: skip


@functools.cache
def _build(case: str):
    """(cfg, params) of a case, built once; floats made float64 for the x64 rollout (the build
    itself runs in float32, which is faster: both simulators get the same values)."""
    if case in SWITCHES:
        base, switches = SWITCHES[case]
        cfg, params = _build(base)
        return dataclasses.replace(cfg, **switches), params
    name, overrides = CASES[case]
    cfg, params = scenarios.make(name, **overrides)
    with jax.enable_x64(True):
        wide = jax.tree.map(lambda x: x.astype(float) if jnp.issubdtype(x.dtype, jnp.floating) else x, params)
    return cfg, wide


@pytest.fixture(scope="module", params=[*CASES, *SWITCHES, *VARIANTS])
def pair(request):
    """(case name, cfg, params, final state, trace, reference result), computed once."""
    base, changes = VARIANTS.get(request.param, (request.param, {}))
    cfg, params = _build(base)
    with jax.enable_x64(True):
        params = _vary(params, changes)
        actions = _actions(cfg.n_nodes, cfg.episode_length, seed=7)
        _, st0, st, trace = rollout(cfg, params, 3, actions, x64=True)
        req = jax.tree.map(np.asarray, st0.requests)
        ref = _reference(cfg, params, req, actions)
    st = jax.tree.map(np.asarray, st._replace(key=0))
    return request.param, cfg, params, st, trace, ref


def _close(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return np.abs(a - b) <= np.maximum(REL * np.abs(b), ABS)


# What each case must exercise (guards: a case that never drops or evicts proves little about it).
EXERCISES = {
    "continuous": {"drops", "preemptions"},
    "sleep": {"wake"},
    "prefix": {"hits", "evictions", "cut"},
    "prefix-tight": {"drops", "preemptions", "hits", "evictions", "cut"},
    "prefix-shared": {"drops", "preemptions", "hits", "evictions"},
    "padded": {"drops", "padding", "slo"},
    "unpadded": {"drops", "cut"},
}


def test_case_exercises_what_it_claims(pair) -> None:
    """Guard: each case really does what `EXERCISES` says, and serves a good part of its requests."""
    case, cfg, _, _, _, ref = pair
    finished = np.isfinite(ref.finish_time)
    assert finished.sum() > cfg.episode_length // 3
    seen = {
        "drops": ref.dropped.any(),
        "preemptions": ref.total_preemptions > 0,
        # some request waited for a wake-up: its TTFT includes the wake delay
        "wake": np.nanmax(ref.ttft) >= VARIANTS["sleep"][1]["wake_delay"],
        "hits": (ref.hit_tokens[finished] > 0).mean() > 0.3,
        "evictions": ref.evicted_blocks.sum() > 0,
        "cut": (~ref.dropped & ~finished).any(),
        "slo": 0 < ref.goodput < finished.sum(),
        "padding": ref.prefill_tokens.sum() > cfg.workload.mean_prompt * (~ref.dropped).sum(),
    }
    missing = sorted(k for k in EXERCISES[case] if not seen[k])
    assert not missing, f"case {case} does not exercise {missing}"


def test_same_fates(pair) -> None:
    """Each request is dropped, finished or (cut) in flight in both, with the same preemptions and hits."""
    _, _, _, st, _, ref = pair
    finished = np.isfinite(ref.finish_time)
    np.testing.assert_array_equal(st.log.node, ref.node)
    np.testing.assert_array_equal(st.log.dropped, ref.dropped)
    np.testing.assert_array_equal(np.isfinite(st.log.e2e), finished)
    np.testing.assert_array_equal(st.log.preemptions[finished], ref.preemptions[finished])
    np.testing.assert_array_equal(st.log.hit_tokens[finished], ref.hit_tokens[finished])


def test_same_latencies(pair) -> None:
    """TTFT and end-to-end latency of every finished request within 0.1% (floor 1e-6 s)."""
    _, _, _, st, _, ref = pair
    finished = np.isfinite(ref.finish_time)
    bad_ttft = np.flatnonzero(finished & ~_close(st.log.ttft, ref.ttft))
    bad_e2e = np.flatnonzero(finished & ~_close(st.log.e2e, ref.e2e_latency))
    assert bad_ttft.size == 0, f"TTFT differs: {bad_ttft[:10]} {st.log.ttft[bad_ttft]} {ref.ttft[bad_ttft]}"
    assert bad_e2e.size == 0, f"e2e differs for requests {bad_e2e[:10]}"


def test_same_node_totals(pair) -> None:
    """Per-node energy, busy time, prefilled and cache-served tokens, and the episode's end agree."""
    _, _, _, st, _, ref = pair
    np.testing.assert_allclose(st.nodes.energy_j, ref.energy_j, rtol=REL)
    np.testing.assert_allclose(st.nodes.busy_s, ref.busy_s, rtol=REL)
    np.testing.assert_array_equal(st.nodes.prefill_tokens, ref.prefill_tokens)
    np.testing.assert_array_equal(st.nodes.saved_tokens, ref.saved_tokens)
    np.testing.assert_allclose(st.t_end, ref.t_end, rtol=REL)


def test_same_rewards(pair) -> None:
    """Each step's reward is minus the reference's step cost over `reward_scale`; so is their sum."""
    _, _, params, _, trace, ref = pair
    cost = -trace["reward"] * float(params.reward_scale)
    np.testing.assert_allclose(cost, ref.step_cost, rtol=REL, atol=ABS)
    np.testing.assert_allclose(cost.sum(), ref.objective, rtol=REL)
