"""The JAX routers against their NumPy twins, and the JAX rollout engine against the step-by-step
rollout: same decisions on random router views (ties and masked nodes included), bit-identical
episodes (per-request TTFT and e2e, objective, metrics), the same errors, and the sharded path
equal to the unsharded one."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from agents.jax_routers import JAX_ROUTERS, argmin, make_jax_router, md5_prefix64, twin
from agents.rollout import Rollout
from agents.routers import ROUTERS, make_router
from burstgym.observation import RouterView
from burstgym.types import ASLEEP, BUSY, IDLE, WAKING

N = 4
EXACT = [name for name, cls in JAX_ROUTERS.items() if cls.exact]
F32 = np.float32


def random_views(rng: np.random.Generator, b: int, n: int = N, ties: bool = True) -> RouterView:
    """A batch of `b` float32 views as the environment produces them: with `ties`, every signal
    drawn from a few values (exact ties everywhere), else spread out."""

    def few(values, shape):
        return np.asarray(values, F32)[rng.integers(0, len(values), shape)]

    if ties:
        running = few([0, 1, 2, 3, 8, 12, 20, 90], (b, n))
        waiting = few([0, 0, 1, 2, 3], (b, n))
        kv_util = few([0.0, 0.25, 0.5, 0.9, 0.95], (b, n))
        prefill = few([0, 256, 512, 4096], (b, n))
        prompt = few([1, 300, 1024, 2048], (b,))
        hit = np.minimum(few([0, 256, 512, 768, 1024], (b, n)), prompt[:, None])
        cached = few([0, 256, 1024], (b, n))
        age = few([0.0, 0.01, 0.02], (b, n))
    else:
        running = rng.integers(0, 200, (b, n)).astype(F32)
        waiting = rng.integers(0, 12, (b, n)).astype(F32)
        kv_util = rng.random((b, n)).astype(F32)
        prefill = rng.integers(0, 20000, (b, n)).astype(F32)
        prompt = rng.integers(1, 5000, b).astype(F32)
        hit = np.minimum(rng.integers(0, 5000, (b, n)), prompt[:, None]).astype(F32)
        cached = rng.integers(0, 10**5, (b, n)).astype(F32)
        age = rng.random((b, n)).astype(F32)
    accepts = rng.random((b, n)) < 0.7
    accepts[rng.random(b) < 0.3] = True
    return RouterView(
        running=running,
        waiting=waiting,
        kv_util=kv_util,
        kv_used=(kv_util * F32(28755)).astype(F32),  # as the env derives it: usage x blocks
        prefill_tokens=prefill,
        window_age=age,
        phase=rng.choice([IDLE, IDLE, BUSY, ASLEEP, WAKING], (b, n)).astype(np.int32),
        hit_tokens=hit,
        cached_tokens=cached,
        cache_used=rng.random((b, n)).astype(F32),
        capacity=np.ones((b, n), F32),
        accepts=accepts,
        block_size=np.full((b, n), 16, np.int32),
        prompt=prompt,
        prefix_key=rng.integers(-1, 5000, b).astype(np.int32),
        step=np.zeros(b, np.int32),
        since_last=np.zeros(b, F32),
        rate=np.ones(b, F32),
        time_to_go=np.ones(b, F32),
    )


def env_mask(view: RouterView) -> np.ndarray:
    a = np.asarray(view.accepts)
    return a | ~a.any(axis=1, keepdims=True)


def decisions(name: str, views: list[RouterView], seed: int = 3):
    """The NumPy router's and its twin's actions on consecutive batches of views ([T, B] each)."""
    b = views[0].running.shape[0]
    router = make_router(name, N, seed=seed)
    router.reset(b)
    jr = twin(router)
    act = jax.jit(jax.vmap(jr.act))
    state = jax.vmap(lambda s: jr.init(N, stream=s))(jnp.arange(b, dtype=jnp.uint32))
    out_np, out_jax = [], []
    for v in views:
        m = env_mask(v)
        out_np.append(router(None, m, v))
        a, state = act(state, v, m)
        out_jax.append(np.asarray(a))
    return np.stack(out_np), np.stack(out_jax)


def test_every_router_has_a_jax_twin():
    assert set(JAX_ROUTERS) == set(ROUTERS)
    for name in ROUTERS:
        t = twin(make_router(name, N, seed=5))
        assert t is not None and t.name == name and t.seed == 5


@pytest.mark.parametrize("name", EXACT)
def test_jax_router_equals_numpy_router_on_random_views(name):
    rng = np.random.default_rng(7)
    views = [random_views(rng, 64, ties=t % 2 == 0) for t in range(10)]
    a_np, a_jax = decisions(name, views)
    np.testing.assert_array_equal(a_jax, a_np)


def test_ties_rotate_with_the_counter_as_in_numpy():
    """An empty cluster: every node tied, the pick advances with the decision counter."""
    empty = random_views(np.random.default_rng(0), 1)
    empty = RouterView(*(np.zeros_like(x) if x.dtype != bool else np.ones_like(x) for x in empty))
    empty = empty._replace(prompt=np.ones(1, F32), prefix_key=np.full(1, -1, np.int32))
    for name in ("jsq", "least-tokens", "least-kv", "dynamo-kv", "aibrix-prefix", "sglang-cache-aware"):
        a_np, a_jax = decisions(name, [empty] * 8)
        np.testing.assert_array_equal(a_jax[:, 0], [0, 1, 2, 3, 0, 1, 2, 3])
        np.testing.assert_array_equal(a_jax, a_np)


def test_dynamo_cost_is_compared_exactly_where_float32_would_tie():
    """kv_used one float32 ulp apart under a large prefill backlog: the float32 sums round to a
    tie (the cached-tokens key would pick node 0), the exact (float64) costs do not (node 1)."""
    v = random_views(np.random.default_rng(0), 1)
    kv = np.array([[np.nextafter(F32(1000), F32(2000)), 1000, 5e6, 5e6]], F32)
    v = v._replace(
        kv_used=kv,
        prefill_tokens=np.array([[2**22, 2**22, 0, 0]], F32),
        hit_tokens=np.zeros((1, N), F32),
        prompt=np.array([16.0], F32),
        cached_tokens=np.array([[0, 5, 0, 0]], F32),
        accepts=np.ones((1, N), bool),
    )
    one = jax.tree.map(lambda x: jnp.asarray(x[0]), v)
    naive = one.kv_used + one.prefill_tokens / 16 + jnp.ceil(one.prompt / 16)
    assert int(argmin(naive, jnp.ones(N, bool), 0, one.cached_tokens)) == 0
    a_np, a_jax = decisions("dynamo-kv", [v])
    assert a_np[0, 0] == a_jax[0, 0] == 1


def test_aibrix_calm_set_is_exact_at_mean_plus_std():
    """Loads [x, x + 1, x + 2]: mean + sample std = x + 2 exactly, so the third node is calm."""
    v = random_views(np.random.default_rng(0), 3)
    base = np.array([0, 1000, 100000], F32)[:, None]
    v = v._replace(
        running=np.concatenate([base + np.array([0, 1, 2], F32), np.full((3, 1), 50, F32)], axis=1),
        hit_tokens=np.tile(np.array([0, 0, 900, 900], F32), (3, 1)),
        prompt=np.full(3, 1000, F32),
        accepts=np.array([[True, True, True, False]] * 3),
    )
    a_np, a_jax = decisions("aibrix-prefix", [v])
    np.testing.assert_array_equal(a_jax, a_np)
    assert (a_jax == 2).all()


def test_md5_ring_hash_matches_hashlib():
    keys = np.concatenate(
        [
            np.arange(2000),
            np.random.default_rng(0).integers(0, 2**31 - 1, 2000),
            [9, 10, 99, 10**9, 2**31 - 1],
        ]
    ).astype(np.int32)
    hi, lo = jax.jit(jax.vmap(md5_prefix64))(keys)
    got = (np.asarray(hi).astype(np.uint64) << np.uint64(32)) | np.asarray(lo).astype(np.uint64)
    want = [int.from_bytes(hashlib.md5(str(int(k)).encode()).digest()[:8], "big") for k in keys]
    np.testing.assert_array_equal(got, np.array(want, dtype=np.uint64))


def _prng_actions(name: str, view: RouterView, mask: np.ndarray, draws: int) -> np.ndarray:
    jr = make_jax_router(name, seed=1)
    one = jax.tree.map(jnp.asarray, view)

    def run(stream):
        def body(state, _):
            a, state = jr.act(state, one, jnp.asarray(mask))
            return state, a

        return jax.lax.scan(body, jr.init(N, stream=stream), None, length=draws)[1]

    return np.asarray(jax.jit(jax.vmap(run))(jnp.arange(8, dtype=jnp.uint32))).ravel()


def _single(view: RouterView, i: int = 0) -> RouterView:
    return jax.tree.map(lambda x: np.asarray(x)[i], view)


def test_random_router_is_uniform_and_ignores_the_mask():
    v = _single(random_views(np.random.default_rng(1), 1))
    mask = np.array([True, False, False, False])
    counts = np.bincount(_prng_actions("random", v, mask, 1000), minlength=N)
    assert counts.sum() == 8000 and (np.abs(counts - 2000) < 200).all()  # ~5 sigma


def test_power_of_two_picks_the_less_loaded_of_two_distinct_nodes():
    v = _single(random_views(np.random.default_rng(1), 1))._replace(
        running=np.array([3, 0, 9, 5], F32), waiting=np.zeros(N, F32)
    )
    a = _prng_actions("power-of-two", v, np.ones(N, bool), 1500)
    freq = np.bincount(a, minlength=N) / a.size
    # loads rank nodes 1 < 0 < 3 < 2: the least of a uniform pair is rank k with (N - 1 - k) / 6
    np.testing.assert_allclose(freq[[1, 0, 3, 2]], [3 / 6, 2 / 6, 1 / 6, 0.0], atol=0.02)
    # node 1 full: a pair holding it goes to its partner; {0,1} {0,2} {0,3} -> 0, {1,2} -> 2, else 3
    mask = np.array([True, False, True, True])
    a = _prng_actions("power-of-two", v, mask, 1500)
    np.testing.assert_allclose(np.bincount(a, minlength=N) / a.size, [3 / 6, 0.0, 1 / 6, 2 / 6], atol=0.02)


def test_llm_d_picks_a_best_scoring_node_and_splits_ties_uniformly():
    rng = np.random.default_rng(3)
    for _ in range(5):  # dyadic values: float32 and float64 scores are both exact
        v = random_views(rng, 64)._replace(
            prompt=np.full(64, 1024, F32), hit_tokens=rng.integers(0, 5, (64, N)).astype(F32) * 256
        )
        router = make_router("llm-d", N)
        router.reset(64)
        m = env_mask(v)
        block = 16.0
        prefix = np.floor(v.hit_tokens / block) / 64.0
        q = np.where(m, v.waiting, np.nan)
        qmax, qmin = np.nanmax(q, axis=1, keepdims=True), np.nanmin(q, axis=1, keepdims=True)
        spread = qmax - qmin
        queue = np.where(spread > 0, (qmax - v.waiting) / np.where(spread > 0, spread, 1.0), 1.0)
        score = np.where(m, 3 * prefix + 2 * (1.0 - v.kv_util.astype(np.float64)) + 2 * queue, -np.inf)
        best = score == score.max(axis=1, keepdims=True)
        _, a_jax = decisions("llm-d", [v])
        assert best[np.arange(64), a_jax[0]].all()
        assert best[np.arange(64), router(None, m, v)].all()
    z = np.zeros(N, F32)
    empty = _single(random_views(rng, 1))._replace(running=z, waiting=z, kv_util=z, hit_tokens=z)
    counts = np.bincount(_prng_actions("llm-d", empty, np.ones(N, bool), 1000), minlength=N)
    assert (np.abs(counts - 2000) < 200).all()


class _PythonRoundRobin:
    """A router without a JAX twin (as the learned router), stepped by the NumPy path."""

    name = "python-round-robin"

    def reset(self, n_envs):
        self.k = 0

    def __call__(self, obs, mask, view):
        self.k += 1
        return np.full(obs.shape[0], (self.k - 1) % N)


ROLLOUT_ROUTERS = (
    "round-robin",
    "least-tokens",
    "sglang-cache-aware",
    "dynamo-kv",
    "aibrix-prefix",
    "prefix-hash",
)


def _assert_same(a, b):
    np.testing.assert_array_equal(a.cost, b.cost)
    np.testing.assert_array_equal(a.ttft, b.ttft)
    np.testing.assert_array_equal(a.e2e, b.e2e)
    assert a.metrics.keys() == b.metrics.keys()
    for k in a.metrics:
        np.testing.assert_array_equal(a.metrics[k], b.metrics[k], err_msg=k)


@pytest.mark.parametrize("scenario", ["bursty", "prefix"])
def test_jax_rollout_equals_step_by_step_rollout(scenario):
    # bursty: 48-request episodes, so steps run at two slot widths (32 and 48) in both engines;
    # prefix: 32 (one width), to keep the compile of its seven routers short.
    length = {"bursty": 48, "prefix": 32}[scenario]
    rollout = Rollout(scenario, episode_length=length)
    assert len(rollout.core.widths) == {"bursty": 2, "prefix": 1}[scenario]
    seeds = [0, 1]
    routers = [make_router(n, rollout.cfg.n_nodes) for n in ROLLOUT_ROUTERS]
    steps = []
    fast = rollout.run(routers + [_PythonRoundRobin()], seeds, progress=steps.append)
    slow = rollout.run(routers, seeds, engine="numpy")
    assert list(fast) == [*ROLLOUT_ROUTERS, "python-round-robin"]
    assert steps == list(range(length))
    for name in ROLLOUT_ROUTERS:
        _assert_same(fast[name], slow[name])
    _assert_same(fast["python-round-robin"], fast["round-robin"])  # the two engines, one batch
    assert np.isfinite(fast["round-robin"].e2e).mean() > 0.9
    assert len({float(ep.cost.sum()) for ep in fast.values()}) > 2  # the routers do differ


def test_engine_choice_is_checked():
    rollout = Rollout("bursty", episode_length=48)
    with pytest.raises(ValueError, match="unknown engine 'gpu'"):
        rollout.run([make_router("round-robin", N)], [0], engine="gpu")
    with pytest.raises(ValueError, match="without a JAX twin: python-round-robin"):
        rollout.run([_PythonRoundRobin()], [0], engine="jax")


def test_errors_are_raised_after_the_jax_call_as_step_by_step():
    """A slot table too small: both engines raise the same error at the same request."""
    rollout = Rollout("bursty", episode_length=32, slots=2, load=1.0)
    routers = [make_router("round-robin", N), make_router("least-tokens", N)]
    messages = []
    for engine in ("jax", "numpy", "auto"):
        batch = routers + ([_PythonRoundRobin()] if engine == "auto" else [])
        with pytest.raises(RuntimeError, match=r"simulation error at request \d+: a node's slot table") as e:
            rollout.run(batch, [0, 1], engine=engine)
        messages.append(str(e.value))
    assert len(set(messages)) == 1, messages


SHARDED = textwrap.dedent(
    """
    import jax, numpy as np
    from agents.jax_routers import make_jax_router
    from burstgym import scenarios
    from burstgym.rollout import cluster_mesh, rollout
    assert len(jax.devices()) == 2, jax.devices()
    cfg, params = scenarios.make("bursty", episode_length=32)
    routers = [make_jax_router(n) for n in ("round-robin", "least-tokens", "power-of-two")]
    a = rollout(cfg, params, routers, [0, 1, 2, 3])
    b = rollout(cfg, params, routers, [0, 1, 2, 3], shard=False)
    assert a.devices == 2 and b.devices == 1, (a.devices, b.devices)
    assert cluster_mesh(3) is None and cluster_mesh(4).devices.size == 2  # 3 clusters: unsharded
    for f in ("objective", "rewards", "node", "dropped", "ttft", "e2e", "error"):
        np.testing.assert_array_equal(getattr(a, f), getattr(b, f), err_msg=f)
    # the per-request log is bit-identical; percentiles interpolate at q / 100, which XLA compiles
    # per shard shape (divide, or multiply by 1 / 100): p99 may move by ~1e-6 relative
    for k in a.metrics:
        np.testing.assert_allclose(a.metrics[k], b.metrics[k], rtol=1e-5, err_msg=k)
    print("sharded ok", a.objective[:2])
    """
)


def test_sharded_rollout_equals_unsharded_on_two_devices():
    env = {
        **os.environ,
        "XLA_FLAGS": (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=2").strip(),
        "JAX_PLATFORMS": "cpu",
    }
    root = Path(__file__).resolve().parents[1]
    out = subprocess.run(
        [sys.executable, "-c", SHARDED], cwd=root, env=env, capture_output=True, text=True, timeout=900
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "sharded ok" in out.stdout


# ------------------------------------------------------------------------- learned routers


@pytest.fixture(scope="module")
def sb3_policy():
    """A PPO NodeScoringPolicy (SB3's initialisation, its actor head scaled up so that its logits
    are far from uniform: argmax decided by the network, not by rounding) with node-pooled
    observation statistics fitted to random observations."""
    import gymnasium as gym
    import torch
    from stable_baselines3.common.vec_env import DummyVecEnv

    import burstgym  # noqa: F401  (registers BurstBalance-v0)
    from agents.learners import NodeVecNormalize, PolicyRouter, make_model

    env = NodeVecNormalize(
        DummyVecEnv([lambda: gym.make("BurstBalance-v0", scenario="prefix", episode_length=48)]),
        norm_reward=False,
    )
    model = make_model("ppo", env, "prefix", seed=0, tensorboard_log=None, overrides={"n_steps": 16})
    dim = env.observation_space.shape[0]
    env.obs_rms.update(np.random.default_rng(5).gamma(2.0, 0.3, (256, dim)))
    with torch.no_grad():
        model.policy.actor_head.weight.mul_(300.0)
    yield model, env, PolicyRouter(model, normalize=env)
    env.close()


def test_sb3_policy_converts_to_the_same_network_in_jax(sb3_policy):
    import torch

    from agents.learners import PolicyRouter, make_model

    model, env, router = sb3_policy
    jr = router.jax_router()
    assert jr is not None and jr.name == router.name and jr.n_nodes == N
    raw = np.random.default_rng(0).gamma(2.0, 0.3, (64, env.observation_space.shape[0])).astype(np.float32)
    with torch.no_grad():
        theirs = model.policy.mlp_extractor.forward_actor(torch.as_tensor(router.observe(raw))).numpy()
    params, stats = jr.weights()
    ours, _ = jr.net.apply(params, stats.normalize(jnp.asarray(raw), N))
    np.testing.assert_allclose(np.asarray(ours), theirs, rtol=1e-4, atol=1e-4)
    assert np.ptp(theirs, axis=1).min() > 1e-2  # the scaled head: well-separated logits
    np.testing.assert_array_equal(jr(raw), router(raw))
    head = model.policy.actor_head.bias
    with torch.no_grad():  # a copy of the current weights, not a view of the torch tensors
        head.add_(1.0)
        moved = router.jax_router().weights()[0]["params"]["score_out"]["bias"]
        head.sub_(1.0)
    assert not np.allclose(moved, params["params"]["score_out"]["bias"])
    mlp = make_model(
        "ppo", env, "prefix", seed=0, tensorboard_log=None, overrides={"n_steps": 16, "policy": "MlpPolicy"}
    )
    assert PolicyRouter(mlp, normalize=env).jax_router() is None  # stays step by step


def test_learned_policy_in_the_jax_engine_equals_its_step_by_step_episodes(sb3_policy):
    from agents import jax_ppo
    from burstgym import rollout as jax_rollout

    rollout = Rollout("prefix", episode_length=32)  # the step-by-step test's configuration
    seeds = [0, 1]
    jr = sb3_policy[2].jax_router()
    sampled = jax_ppo.JaxPolicyRouter(*jr.weights(), N, jr.hidden, "sampled", deterministic=False)
    rr = make_router("round-robin", N)
    fast = rollout.run([jr, sampled, rr], seeds)
    slow = rollout.run([jr, rr], seeds, engine="numpy")
    _assert_same(fast["learned"], slow["learned"])
    _assert_same(fast["round-robin"], slow["round-robin"])
    assert not np.array_equal(fast["learned"].e2e, fast["round-robin"].e2e, equal_nan=True)
    assert not np.array_equal(fast["learned"].e2e, fast["sampled"].e2e, equal_nan=True)
    # Weights are an argument of the compiled episode: other weights, no new compilation, other
    # episodes.
    params, stats = jr.weights()
    other = jax_ppo.JaxPolicyRouter(jax.tree.map(lambda x: -x, params), stats, N, jr.hidden)
    assert other == jr and hash(other) == hash(jr)
    again = jax_rollout.rollout(rollout.cfg, rollout.params, [other, sampled, twin(rr)], seeds)
    assert again.compile_s == 0.0
    assert not np.array_equal(again.e2e[:2], fast["learned"].e2e, equal_nan=True)
