"""Tests of the JAX core: queueing theory (M/D/1), determinism, no re-tracing, reward = objective."""

from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import BASE, OPTIMIZED, TIGHT_SHARED_PREFIX, base, rollout, rollout_fn

from burstgym import scenarios
from burstgym.compile_cache import jit
from burstgym.env import BurstBalance, chunk_widths, needed_chunks
from burstgym.latency import LatencyModel
from burstgym.reward import objective_from_log
from burstgym.workload import EmpiricalLengths, PoissonArrivals, Workload


def _md1(rate: float, service: float, episode_length: int):
    """One node serving one request at a time in exactly `service` seconds, Poisson arrivals."""
    # One slot width: the M/D/1 test vmaps whole episodes, and a vmapped width switch would run
    # every width's branch (burstgym.env, "Slot widths").
    cfg, params = scenarios.make(
        "steady",
        n_nodes=1,
        episode_length=episode_length,
        max_num_seqs=1,
        queue_capacity=40,
        prompt_max=64,
        output_max=64,
        slot_widths=(),
    )
    workload = Workload(PoissonArrivals(rate), EmpiricalLengths((32,)), EmpiricalLengths((1,)))
    cfg = dataclasses.replace(cfg, workload=workload)
    n = params.nodes
    # step_time = overhead_s exactly: every other coefficient 0, linear layers max(0, 0) with p = 1.
    zero = {f: jnp.zeros_like(n.speed) for f in LatencyModel._fields}
    lat = LatencyModel(
        **{
            **zero,
            "overhead_s": jnp.full_like(n.speed, service),
            "knee_p": jnp.ones_like(n.speed),
            "tile_tokens": jnp.ones_like(n.speed),
        }
    )
    return cfg, params._replace(nodes=n._replace(latency=lat, speed=jnp.ones_like(n.speed)))


def test_md1_mean_wait() -> None:
    """Mean queueing delay of an M/D/1 queue: Wq = rho / (2 mu (1 - rho)), within 5%.

    512 independent clusters (vmap) of 400 arrivals at rho = 0.5; the first 100 requests of each
    episode are discarded (the queue starts empty). Wait = end-to-end latency - service time,
    since every request has one output token and runs alone.
    """
    service, rho, e, warm = 1.0, 0.5, 400, 100
    cfg, params = _md1(rho / service, service, e)
    run = jax.jit(jax.vmap(rollout_fn(cfg), in_axes=(0, None, None)), compiler_options=OPTIMIZED)
    keys = jax.random.split(jax.random.key(0), 512)
    _, st0, st, _ = run(keys, params, jnp.zeros(e, jnp.int32))
    assert not np.asarray(st.log.dropped).any()
    e2e = np.asarray(st.log.e2e, np.float64)[:, warm:]
    ttft = np.asarray(st.log.ttft, np.float64)[:, warm:]
    np.testing.assert_allclose(e2e, ttft)
    assert e2e.min() >= service * (1 - 1e-3)  # float32 clock: ~1e-4 s rounding at t ~ 800 s
    wq = e2e.mean() - service
    print(f"M/D/1: Wq measured {wq:.4f}, theory {rho / (2 * (1 - rho) / service):.4f}")
    mu = 1.0 / service
    expected = rho / (2 * mu * (1 - rho))
    assert wq == pytest.approx(expected, rel=0.05), (wq, expected)


@pytest.fixture(scope="module")
def small():
    cfg, params = base("continuous")
    return cfg, params


def _episode(cfg, params, seed, actions):
    obs0, _, st, trace = rollout(cfg, params, seed, actions)
    return obs0, jax.tree.map(np.asarray, st.log), trace


def test_same_seed_same_trajectory(small) -> None:
    """Same seed and actions: bit-identical observations, rewards and log; another seed differs."""
    cfg, params = small
    actions = np.random.default_rng(0).integers(0, cfg.n_nodes, cfg.episode_length)
    a, b, c = (_episode(cfg, params, s, actions) for s in (1, 1, 2))
    np.testing.assert_array_equal(a[0], b[0])
    for k in ("obs", "reward", "done", "time"):
        np.testing.assert_array_equal(a[2][k], b[2][k])
    for x, y in zip(a[1], b[1], strict=True):
        np.testing.assert_array_equal(x, y)
    assert not np.array_equal(a[2]["obs"], c[2]["obs"])
    assert not np.array_equal(a[2]["reward"], c[2]["reward"])


def test_step_not_retraced() -> None:
    """The jitted step is traced once, then reused for every step of an episode and the next."""
    cfg, params = _md1(0.5, 0.1, 24)
    env = BurstBalance(cfg)
    traces = []

    def counted(state, action, params):
        traces.append(1)  # runs only while tracing
        return env.step_env(state, action, params)

    step = jax.jit(counted)
    reset = jax.jit(env.reset)
    for episode in range(2):
        _, state = reset(jax.random.key(episode), params)
        for _ in range(cfg.episode_length):
            _, state, _, done, _ = step(state, jnp.int32(0), params)
        assert bool(done)
        assert len(traces) == 1, f"re-traced in episode {episode}"


def _objective(st0, st, cfg, params) -> float:
    """The episode's objective recomputed from its request log."""
    energy = st.nodes.energy_j
    return float(objective_from_log(st0.requests, st.service, st.log, energy, st.horizon, cfg, params))


def test_latency_rewards_sum_to_objective(small) -> None:
    """Latency objective with energy and drops: -sum(rewards) * scale == objective from the log."""
    cfg, params = small
    params = params._replace(energy_weight=jnp.asarray(1e-3, params.energy_weight.dtype))
    actions = np.random.default_rng(1).choice(cfg.n_nodes, cfg.episode_length, p=[0.7, 0.1, 0.1, 0.1])
    _, st0, st, trace = rollout(cfg, params, 5, actions)
    assert int(st.log.dropped.sum()) > 0 and float(st.nodes.energy_j.sum()) > 0
    objective = _objective(st0, st, cfg, params)
    energy_part = 1e-3 * float(st.nodes.energy_j.sum())
    assert energy_part > 0.01 * objective  # the energy term matters at this tolerance
    got = -trace["reward"].astype(np.float64).sum() * float(params.reward_scale)
    assert got == pytest.approx(objective, rel=1e-4)


def test_slo_rewards_sum_to_goodput() -> None:
    """SLO objective: rewards sum to goodput - drop_penalty * drops (over the scale), from the log."""
    cfg, params = base("continuous", objective="slo", ttft_slo=0.5, tpot_slo=0.05)
    actions = np.random.default_rng(2).choice(cfg.n_nodes, cfg.episode_length, p=[0.7, 0.1, 0.1, 0.1])
    _, st0, st, trace = rollout(cfg, params, 6, actions)
    cost = _objective(st0, st, cfg, params)
    drops = int(st.log.dropped.sum())
    assert drops > 0 and -cost + float(params.drop_penalty) * drops > 0  # some requests met their SLO
    got = -trace["reward"].astype(np.float64).sum() * float(params.reward_scale)
    assert got == pytest.approx(cost, rel=1e-5, abs=1e-3)


@pytest.mark.parametrize(
    "overrides",
    [
        dict(objective="excess"),
        dict(reward="finish"),
        dict(reward="finish", objective="excess", ttft_weight=2.0),
        dict(ttft_weight=1.0),
    ],
)
def test_objectives_and_rewards_agree_with_the_log(overrides) -> None:
    """Every objective / reward timing / TTFT weight sums to the objective recomputed from the log
    (accrual and finish rewards differ in when they pay, not in what)."""
    cfg, params = base("continuous", **overrides)
    actions = np.random.default_rng(3).choice(cfg.n_nodes, cfg.episode_length, p=[0.7, 0.1, 0.1, 0.1])
    _, st0, st, trace = rollout(cfg, params, 7, actions)
    cost = _objective(st0, st, cfg, params)
    got = -trace["reward"].astype(np.float64).sum() * float(params.reward_scale)
    assert got == pytest.approx(cost, rel=1e-4, abs=1e-3)
    if cfg.objective == "excess":  # latency beyond an idle node's: never negative per request
        served = ~np.asarray(st.log.dropped)
        excess = np.asarray(st.log.e2e - st.service.e2e[: cfg.episode_length])[served]
        assert excess.min() >= -1e-4


def test_cut_end_stops_with_requests_in_flight() -> None:
    """`end="cut"`: the episode stops at the last arrival with requests still in flight (a
    truncation), where "drain" serves them all (a termination)."""
    actions = np.zeros(BASE["episode_length"], np.int64)
    cut_cfg, cut_params = base("continuous", end="cut")
    _, _, cut, tr_cut = rollout(cut_cfg, cut_params, 8, actions)
    drain_cfg, drain_params = base("continuous")
    _, _, drain, tr_drain = rollout(drain_cfg, drain_params, 8, actions)
    assert tr_cut["done"][-1] and tr_cut["in_flight"][-1] > 0
    assert tr_drain["in_flight"][-1] == 0
    assert float(cut.t_end) < float(drain.t_end)
    # up to the last step the two episodes are the same
    np.testing.assert_allclose(tr_cut["reward"][:-1], tr_drain["reward"][:-1], rtol=1e-6)


def test_step_time_is_affine_in_kv_tokens():
    """`scheduler.decode_run` folds a stretch of decode iterations into one event by summing an
    arithmetic series; that is exact only if step time is affine in kv_tokens at a fixed batch.
    Holds for every shipped profile, or the fold would silently approximate."""
    from burstgym.latency import list_profiles, load_profile, step_time

    for name in list_profiles():
        lat = load_profile(name).latency
        for n in (1, 7, 64):
            kv = np.array([0.0, 1000.0, 2000.0, 50_000.0, 100_000.0]) * n / 8 + n
            d = np.asarray(step_time(lat, 0.0, float(n), kv, 0.0), dtype=np.float64)
            slope = (d[1] - d[0]) / (kv[1] - kv[0])
            np.testing.assert_allclose(d, d[0] + slope * (kv - kv[0]), rtol=1e-5, err_msg=name)


def test_steps_on_narrow_slot_tables_equal_full_width_steps() -> None:
    """A step runs on the narrowest slot table that holds every node's requests plus the arriving
    one (burstgym.env, "Slot widths"), and there on the fewest chunks per request that hold them
    ("Chunk widths"). An episode whose nodes fill past the narrow widths and whose requests have
    more chunks than the narrow chunk width gives the same fates, latencies, rewards and
    prefix-cache totals as the same episode at full width."""
    cfg, params = scenarios.make(
        "prefix",
        **{
            **BASE,
            "episode_length": 48,
            "max_num_seqs": 8,
            "queue_capacity": 8,
            "kv_capacity_tokens": 8192,
            "prompt_max": 1024,
            "prefix_median": 512.0,
            "prefix_max": 1024,
            "load": 3.0,
        },
    )
    assert cfg.prefix_caching and cfg.slots == 16
    actions = np.arange(cfg.episode_length) % cfg.n_nodes
    narrow = dataclasses.replace(cfg, slot_widths=(4,), chunk_widths=(4,))
    wide = dataclasses.replace(cfg, slot_widths=(), chunk_widths=())
    assert BurstBalance(narrow).widths == (4, 16) and BurstBalance(wide).widths == (cfg.slots,)
    _, first = BurstBalance(narrow).reset(jax.random.key(0), params)
    b = first.requests.chunk_ids.shape[-1]
    assert chunk_widths(narrow, b) == (4, b) and chunk_widths(wide, b) == (b,)
    per_request = -(-np.asarray(first.requests.id_tokens) // cfg.chunk_tokens)
    assert (per_request <= 4).mean() > 0.5 and (per_request > 4).any()  # both chunk widths are needed
    assert int(needed_chunks(first, cfg.chunk_tokens)) == per_request[:2].max()  # empty slots: k, k + 1
    _, _, st_n, tr_n = rollout(narrow, params, 0, actions)
    _, _, st_w, tr_w = rollout(wide, params, 0, actions)
    per_node = (tr_n["running"] + tr_n["waiting"]).max(axis=1)  # after each step
    assert per_node[:-1].min() + 1 <= 4 and per_node.max() >= 4  # the narrow and the full width ran
    np.testing.assert_array_equal(st_n.log.dropped, st_w.log.dropped)
    np.testing.assert_array_equal(st_n.log.node, st_w.log.node)
    for field in ("ttft", "e2e"):
        np.testing.assert_allclose(getattr(st_n.log, field), getattr(st_w.log, field), rtol=1e-6)
    np.testing.assert_allclose(tr_n["reward"], tr_w["reward"], rtol=1e-5, atol=1e-7)
    np.testing.assert_array_equal(tr_n["cache_kept"], tr_w["cache_kept"])


def test_the_slot_width_choice_traces_the_step_once_per_width(monkeypatch) -> None:
    """Compiling a step traces the step's work once per slot width, not once more to learn the
    outputs' shapes that the chain of conds starts from (burstgym.env, `_at_width`)."""
    cfg, params = scenarios.make("prefix", n_nodes=4, episode_length=16, **TIGHT_SHARED_PREFIX)
    core = BurstBalance(dataclasses.replace(cfg, slot_widths=(4, 8)))
    assert core.widths == (4, 8, cfg.slots)
    _, state = core.reset(jax.random.key(0), params)
    traced = []
    route_advance = BurstBalance._route_advance

    def counting(self, *args):
        traced.append(args[0].slots.status.shape)
        return route_advance(self, *args)

    monkeypatch.setattr(BurstBalance, "_route_advance", counting)
    jax.jit(core.step_env).trace(state, jnp.int32(0), params)
    assert sorted(shape[-1] for shape in traced) == [4, 8, cfg.slots], traced


def test_a_scanned_prefix_step_updates_the_cache_tables_in_place() -> None:
    """The slot-width branches (burstgym.env, "Slot widths") hand the prefix cache's [N, H]
    tables to the step's event loops without copying them: in a program that scans `step_env`
    (compiled as the core's programs are, `compile_cache.jit`), no `while` body copies a table.
    With one `lax.switch` over the widths, XLA copied them at every pass of all but one width's
    event loop (docs/performance.md, "Compiling")."""
    cfg, params = scenarios.make("prefix", n_nodes=4, episode_length=16, **TIGHT_SHARED_PREFIX)
    core = BurstBalance(dataclasses.replace(cfg, slot_widths=(4,)))
    assert core.widths == (4, cfg.slots)  # the step runs on two slot widths
    _, state = core.reset(jax.random.key(0), params)

    def run(s):
        def body(s, _):
            return core.step_env(s, (s.step % cfg.n_nodes).astype(jnp.int32), params)[1], None

        return jax.lax.scan(body, s, None, length=8)[0]

    text = jit(run).lower(state).compile().as_text()
    n, h = state.cache.table.key.shape
    blocks = re.split(r"\n(?=\S.*\{\s*$)", text, flags=re.M)  # one computation each
    computations = {c.split(" ", 1)[0].lstrip("%"): c for c in blocks}
    bodies = set(re.findall(r"body=%([\w.\-]+)", text))
    assert bodies and bodies <= computations.keys()
    table_copy = re.compile(rf"= \w+\[{n},{h}\]\{{[0-9,]+\}} copy\(")
    copied = {b: len(table_copy.findall(computations[b])) for b in bodies}
    assert not any(copied.values()), f"while bodies copying a cache table: {copied}"
