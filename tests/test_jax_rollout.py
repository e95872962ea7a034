"""The rollout engine against the step-by-step rollout (both drive the same JAX rules): bit-identical
episodes (per-request TTFT and e2e, objective, metrics), the same errors, the sharded path equal
to the unsharded one; routers of different state structures and capabilities in one compiled
episode; the PRNG routers' distributions; learned routers in the engine."""

from __future__ import annotations

import hashlib
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import default_codegen_env

from agents.rollout import Rollout, jax_rule
from agents.routers import make_router, make_rule
from agents.routers.base import BatchedRouter, Rule, argmin, first
from agents.routers.prefix_hash import md5_prefix64
from burstgym.observation import RouterView
from burstgym.types import ASLEEP, BUSY, IDLE, WAKING

N = 4
F32 = np.float32


def random_view(rng: np.random.Generator) -> RouterView:
    """One cluster's float32 view as the environment produces it."""
    kv_util = rng.random(N).astype(F32)
    prompt = F32(rng.integers(1, 5000))
    return RouterView(
        running=rng.integers(0, 200, N).astype(F32),
        waiting=rng.integers(0, 12, N).astype(F32),
        kv_util=kv_util,
        kv_used=(kv_util * F32(28755)).astype(F32),
        prefill_tokens=rng.integers(0, 20000, N).astype(F32),
        prompt_tokens=rng.integers(0, 90000, N).astype(F32),
        window_age=rng.random(N).astype(F32),
        phase=rng.choice([IDLE, IDLE, BUSY, ASLEEP, WAKING], N).astype(np.int32),
        hit_tokens=np.minimum(rng.integers(0, 5000, N), prompt).astype(F32),
        cached_tokens=rng.integers(0, 10**5, N).astype(F32),
        cache_used=rng.random(N).astype(F32),
        capacity=np.ones(N, F32),
        prefill_rate=np.full(N, 10000.0, F32),
        kv_tokens=np.full(N, 460080.0, F32),
        accepts=np.ones(N, bool),
        block_size=np.full(N, 16, np.int32),
        prompt=prompt,
        prefix_key=np.int32(rng.integers(-1, 5000)),
        chunk_ids=np.full(0, -1, np.int32),
        chunk_end=np.zeros(0, np.int32),
        step=np.int32(1),
        since_last=F32(0),
        rate=F32(1),
        time_to_go=F32(1),
        clock=F32(0),
    )


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
    jr = make_rule(name, seed=1)
    one = jax.tree.map(jnp.asarray, view)

    def run(stream):
        def body(state, _):
            a, state = jr.act(state, one, jnp.asarray(mask))
            return state, a

        return jax.lax.scan(body, jr.init(N, stream=stream), None, length=draws)[1]

    return np.asarray(jax.jit(jax.vmap(run))(jnp.arange(8, dtype=jnp.uint32))).ravel()


def test_random_router_is_uniform_and_ignores_the_mask():
    v = random_view(np.random.default_rng(1))
    mask = np.array([True, False, False, False])
    counts = np.bincount(_prng_actions("random", v, mask, 1000), minlength=N)
    assert counts.sum() == 8000 and (np.abs(counts - 2000) < 200).all()  # ~5 sigma


def test_power_of_two_picks_the_less_loaded_of_two_distinct_nodes():
    v = random_view(np.random.default_rng(1))._replace(
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


class _PythonRoundRobin:
    """A router only Python can call (as an SB3 policy the JAX network cannot express), stepped by
    the step-by-step path."""

    name = "python-round-robin"

    def reset(self, n_envs):
        self.k = 0

    def __call__(self, obs, mask, view):
        self.k += 1
        return np.full(obs.shape[0], (self.k - 1) % N)


# deterministic and PRNG rules, with and without a state of their own: the load-balancing rules on
# `bursty`, the prefix-aware ones on `prefix` (every router compiled costs seconds in both engines);
# round-robin on both, as the Python router's twin
ROLLOUT_ROUTERS = {
    "bursty": ("round-robin", "least-tokens", "weighted-skew", "power-of-two"),
    "prefix": ("round-robin", "sglang-cache-aware", "dynamo-kv", "llm-d", "aibrix-prefix", "prefix-hash"),
}


def _assert_same(a, b):
    np.testing.assert_array_equal(a.cost, b.cost)
    np.testing.assert_array_equal(a.ttft, b.ttft)
    np.testing.assert_array_equal(a.e2e, b.e2e)
    assert a.metrics.keys() == b.metrics.keys()
    for k in a.metrics:
        np.testing.assert_array_equal(a.metrics[k], b.metrics[k], err_msg=k)


@pytest.mark.parametrize("scenario", [pytest.param("bursty", marks=pytest.mark.default_codegen), "prefix"])
def test_jax_rollout_equals_step_by_step_rollout(scenario):
    # bursty: 48-request episodes, so steps run at two slot widths (32 and 48) in both engines;
    # prefix: 32 (one width), to keep the compile of its routers short.
    length = {"bursty": 48, "prefix": 32}[scenario]
    rollout = Rollout(scenario, episode_length=length)
    assert len(rollout.core.widths) == {"bursty": 2, "prefix": 1}[scenario]
    seeds = [0, 1]
    names = ROLLOUT_ROUTERS[scenario]
    routers = [make_router(n, rollout.cfg.n_nodes) for n in names]
    steps = []
    fast = rollout.run(routers + [_PythonRoundRobin()], seeds, progress=steps.append)
    slow = rollout.run(routers, seeds, engine="numpy")
    assert list(fast) == [*names, "python-round-robin"]
    assert steps == list(range(length))
    for name in names:
        _assert_same(fast[name], slow[name])
    _assert_same(fast["python-round-robin"], fast["round-robin"])  # the two engines, one batch
    assert np.isfinite(fast["round-robin"].e2e).mean() > 0.9
    assert len({float(ep.cost.sum()) for ep in fast.values()}) > 2  # the routers do differ


def test_engine_choice_is_checked():
    rollout = Rollout("bursty", episode_length=48)
    with pytest.raises(ValueError, match="unknown engine 'gpu'"):
        rollout.run([make_router("round-robin", N)], [0], engine="gpu")
    with pytest.raises(ValueError, match="not JAX rules: python-round-robin"):
        rollout.run([_PythonRoundRobin()], [0], engine="jax")


@dataclass(frozen=True)
class _LeastRouted(Rule):
    """A router that reads the cluster's state (`reads_state`): the node with the fewest requests
    routed so far (`NodeState.routed`), ties to the first; over a fresh episode it deals as
    round-robin does."""

    name: ClassVar[str] = "least-routed"
    family: ClassVar[str] = "bound"
    reads_state: ClassVar[bool] = True

    def act(self, state, view, mask, cluster_state, params):
        routed = cluster_state.nodes.routed.astype(jnp.float32)
        node = argmin(routed, jnp.ones_like(mask), order=first(mask.shape[0]))
        return node, state._replace(counter=state.counter + 1)


def test_a_router_reading_the_cluster_state_runs_in_the_engine():
    rollout = Rollout("bursty", episode_length=48)
    res = rollout.run([_LeastRouted(), make_router("round-robin", N)], [0, 1], engine="jax")
    _assert_same(res["least-routed"], res["round-robin"])
    with pytest.raises(ValueError, match="reads the cluster's state"):
        BatchedRouter(_LeastRouted(), N)


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
    from agents.routers import make_rule
    from burstgym import scenarios
    from burstgym.rollout import cluster_mesh, rollout
    assert len(jax.devices()) == 2, jax.devices()
    cfg, params = scenarios.make("bursty", episode_length=32)
    routers = [make_rule(n) for n in ("round-robin", "least-tokens", "power-of-two")]
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
    env = default_codegen_env()  # a sharded and an unsharded call agree bit for bit with these
    env["XLA_FLAGS"] += " --xla_force_host_platform_device_count=2"
    env["JAX_PLATFORMS"] = "cpu"
    root = Path(__file__).resolve().parents[1]
    out = subprocess.run(
        [sys.executable, "-c", SHARDED], cwd=root, env=env, capture_output=True, text=True, timeout=900
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "sharded ok" in out.stdout


def test_threaded_rollout_equals_one_call():
    """Clusters split over threads (the CPU default), with the last part padded, give every
    cluster the same episode as one call over all of them; a bad thread count is refused."""
    from burstgym import scenarios
    from burstgym.rollout import rollout, usable_cores

    cfg, params = scenarios.make("bursty", episode_length=32)
    routers = [make_rule(n) for n in ("round-robin", "least-tokens", "power-of-two")]
    seeds = [0, 1, 2, 3, 4]  # 15 clusters: 2 threads of 8, the last padded by one
    one = rollout(cfg, params, routers, seeds, threads=1)
    assert one.threads == 1
    many = rollout(cfg, params, routers, seeds, threads=2)
    assert many.threads == 2 and many.rewards.shape == one.rewards.shape
    for f in ("objective", "rewards", "node", "dropped", "ttft", "e2e", "error", "error_step"):
        np.testing.assert_array_equal(getattr(many, f), getattr(one, f), err_msg=f)
    for k in one.metrics:  # percentiles interpolate per compiled shape (see the sharded test)
        np.testing.assert_allclose(many.metrics[k], one.metrics[k], rtol=1e-5, err_msg=k)
    assert rollout(cfg, params, routers[:1], [0]).threads == 1  # one cluster: one thread
    assert rollout(cfg, params, routers, seeds).threads == min(usable_cores(), 15)
    with pytest.raises(ValueError, match="threads must be at least 1, got 0"):
        rollout(cfg, params, routers, seeds, threads=0)


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

    from agents import model as network
    from agents.learners import PolicyRouter, make_model

    model, env, router = sb3_policy
    jr = router.jax_router()
    assert jr is not None and jr.name == router.name and jr.n_nodes == N
    raw = np.random.default_rng(0).gamma(2.0, 0.3, (64, env.observation_space.shape[0])).astype(np.float32)
    with torch.no_grad():
        theirs = model.policy.mlp_extractor.forward_actor(torch.as_tensor(router.observe(raw))).numpy()
    params, stats = jr.weights()
    ours = network.logits(params["params"], stats.normalize(jnp.asarray(raw)))
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
    again = jax_rollout.rollout(rollout.cfg, rollout.params, [other, sampled, jax_rule(rr)], seeds)
    assert again.compile_s == 0.0
    assert not np.array_equal(again.e2e[:2], fast["learned"].e2e, equal_nan=True)


def test_compiled_episodes_lists_each_configuration_once():
    from burstgym import rollout as jax_rollout
    from burstgym import scenarios

    cfg, params = scenarios.make("bursty", episode_length=7)  # a length no other test compiles
    before = len(jax_rollout.compiled_episodes())
    first = jax_rollout.rollout(cfg, params, [make_rule("round-robin")], [0], threads=1)
    programs = jax_rollout.compiled_episodes()
    assert len(programs) == before + 1 and first.compile_s > 0
    assert "while" in programs[-1].as_text()  # the episode's scan, readable as HLO
    again = jax_rollout.rollout(cfg, params, [make_rule("round-robin")], [1], threads=1)
    assert again.compile_s == 0.0 and len(jax_rollout.compiled_episodes()) == before + 1
