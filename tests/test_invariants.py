"""Invariants of the JAX core over randomised clusters and random routing (hypothesis).

Every example reuses one compiled episode per scheduler: the examples vary only parameters
(per-node running limit, queue capacity, KV blocks, block size, speed as the load knob, sleep),
never shapes. Clusters of 1-4 nodes are 4-node clusters whose router uses only the first n.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from conftest import BASE, base, rollout
from hypothesis import given, settings
from hypothesis import strategies as st

from burstgym.gym_env import _spaces
from burstgym.observation import OBS_HIGH

N = BASE["n_nodes"]
LONGEST = BASE["prompt_max"] + BASE["output_max"]


@st.composite
def clusters(draw):
    """Per-node parameters within the shared shapes, a load factor and a routing."""
    ints = lambda lo, hi: st.lists(st.integers(lo, hi), min_size=N, max_size=N)  # noqa: E731
    block = draw(st.sampled_from([1, 4, 8, 16, 32]))
    return {
        "n_used": draw(st.integers(1, N)),
        "max_num_seqs": draw(ints(1, BASE["max_num_seqs"])),
        "max_batch_size": draw(ints(1, BASE["max_batch_size"])),
        "queue_capacity": draw(ints(1, BASE["queue_capacity"])),
        "block_size": block,
        # enough blocks for the longest request (else a node would stall), up to ~3x that
        "kv_tokens": draw(ints(LONGEST + block, 3 * LONGEST)),
        "budget": draw(st.sampled_from([LONGEST, 512, 2048])),
        "load": draw(st.floats(0.3, 2.0)),
        "sleep": draw(st.booleans()),
        "seed": draw(st.integers(0, 2**16)),
    }


def _params(c, params):
    """`params` with the drawn per-node values; `load` scales iteration times (speed)."""
    n = params.nodes
    i32 = lambda v: jnp.asarray(v, jnp.int32)  # noqa: E731
    full = lambda v: jnp.full_like(n.speed, v)  # noqa: E731
    bs = c["block_size"]
    nodes = n._replace(
        speed=n.speed * c["load"],
        max_num_seqs=i32(c["max_num_seqs"]),
        max_batch_size=i32(c["max_batch_size"]),
        queue_capacity=i32(c["queue_capacity"]),
        block_size=jnp.full_like(n.block_size, bs),
        kv_blocks=i32([kv // bs for kv in c["kv_tokens"]]),
        max_num_batched_tokens=jnp.full_like(n.max_num_batched_tokens, c["budget"]),
        sleep_timeout=full(0.2 if c["sleep"] else np.inf),
        wake_delay=full(0.1 if c["sleep"] else 0.0),
    )
    return params._replace(nodes=nodes)


@pytest.mark.parametrize("scheduler", ["continuous", "dynamic"])
@settings(max_examples=8, deadline=None)
@given(c=clusters())
def test_invariants(scheduler, c) -> None:
    """Conservation, KV bounds, finite and in-space observations, monotone clocks, full drain."""
    c = {**c, "scheduler": scheduler}
    cfg, params = base(scheduler)
    params = _params(c, params)
    rng = np.random.default_rng(c["seed"])
    actions = rng.integers(0, c["n_used"], cfg.episode_length)
    obs0, st0, st, tr = rollout(cfg, params, c["seed"], actions)
    e = cfg.episode_length
    space, _ = _spaces(cfg)

    # requests: arrived (step index + 1 after routing) == finished + in flight + dropped
    arrived = np.arange(1, e + 1)
    np.testing.assert_array_equal(tr["finished"] + tr["in_flight"] + tr["dropped"], arrived)
    # running set, queue and KV blocks within their limits on every node at every step. An arrival
    # is accepted only below queue_capacity waiting, so a node holds at most queue_capacity + the
    # running limit; preemption may move running requests to the queue beyond queue_capacity.
    p = params.nodes
    qc = np.asarray(p.queue_capacity)
    if c["scheduler"] == "continuous":
        assert (tr["kv_used"] <= np.asarray(p.kv_blocks)).all()
        assert (tr["running"] <= np.asarray(p.max_num_seqs)).all()
        assert (tr["waiting"] + tr["running"] <= qc + np.asarray(p.max_num_seqs)).all()
    else:
        assert (tr["running"] <= np.asarray(p.max_batch_size)).all()
        assert (tr["waiting"] <= qc).all()
    # finite, in-space observations and finite rewards
    obs = np.concatenate([np.asarray(obs0)[None], tr["obs"]])
    assert np.isfinite(obs).all() and np.isfinite(tr["reward"]).all()
    assert obs.min() >= 0.0 and obs.max() <= OBS_HIGH
    assert all(space.contains(o) for o in obs)
    # simulated time never goes back, globally and per node
    time = np.r_[float(st0.time), tr["time"]]
    assert (np.diff(time) >= 0).all()
    last = np.concatenate([np.asarray(st0.nodes.last_time)[None], tr["last_time"]])
    assert (np.diff(last, axis=0) >= 0).all()
    # the final step drains: nothing in flight, every accepted request finished after it arrived
    assert tr["done"][-1] and not tr["done"][:-1].any()
    assert tr["in_flight"][-1] == 0
    dropped = np.asarray(st.log.dropped)
    finish = np.asarray(st.log.finish)
    first = np.asarray(st.log.first_token)
    arrival = np.asarray(st0.requests.arrival)
    assert np.isfinite(finish[~dropped]).all() and np.isnan(finish[dropped]).all()
    assert (first[~dropped] > arrival[~dropped]).all() and (finish[~dropped] >= first[~dropped]).all()
    assert float(st.t_end) >= np.nanmax(finish, initial=arrival[-1]) - 1e-6
