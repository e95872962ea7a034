"""Invariants of the JAX core over randomised clusters and random routing (hypothesis).

Every example reuses one compiled episode per scheduler: the examples vary only parameters
(per-node running limit, queue capacity, KV blocks, block size, speed as the load knob, sleep),
never shapes. Clusters of 1-4 nodes are 4-node clusters whose router uses only the first n.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest
from conftest import BASE, base, rollout
from hypothesis import given, settings
from hypothesis import strategies as st

from burstgym.gym_env import _spaces
from burstgym.observation import OBS_HIGH
from burstgym.prefix_cache import entry_bound

N = BASE["n_nodes"]
KV_FACTOR = (1.05, 3.0)  # a node's KV blocks hold this many times the longest request


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
        "kv_factor": draw(st.lists(st.floats(*KV_FACTOR), min_size=N, max_size=N)),
        "budget": draw(st.sampled_from([None, 512, 2048])),
        "load": draw(st.floats(0.3, 2.0)),
        "sleep": draw(st.booleans()),
        "seed": draw(st.integers(0, 2**16)),
    }


def _params(c, params, longest):
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
        kv_blocks=i32([int(f * longest) // bs + 1 for f in c["kv_factor"]]),
        max_num_batched_tokens=jnp.full_like(n.max_num_batched_tokens, c["budget"] or longest),
        sleep_timeout=full(0.2 if c["sleep"] else np.inf),
        wake_delay=full(0.1 if c["sleep"] else 0.0),
    )
    return params._replace(nodes=nodes)


# Shared prefixes of 8 groups cut into 64-token chunks, so prefix hits, pinning and eviction occur.
PREFIX = dict(prefix_share=1.0, prefix_groups=8, prefix_median=128.0, prefix_max=256, chunk_tokens=64)
CASES = {"continuous": ("continuous", {}), "dynamic": ("dynamic", {}), "prefix": ("continuous", PREFIX)}


@pytest.mark.parametrize("case", list(CASES))
@settings(max_examples=8, deadline=None)
@given(c=clusters())
def test_invariants(case, c) -> None:
    """Conservation, KV bounds (cache included), finite and in-space observations, monotone clocks,
    full drain, no core error."""
    scheduler, extra = CASES[case]
    c = {**c, "scheduler": scheduler}
    cfg, params = base(scheduler, **extra)
    assert cfg.prefix_caching == (case == "prefix")
    longest = cfg.workload.max_prompt + cfg.workload.max_output
    if cfg.prefix_caching:  # a cache sized for the most KV blocks drawn (3x the longest, 1-token blocks)
        most = entry_bound(int(KV_FACTOR[1] * longest) + 1, 1, cfg.chunk_tokens, BASE["max_num_seqs"], True)
        cfg = dataclasses.replace(cfg, cache_entries=max(cfg.cache_entries, most))
    params = _params(c, params, longest)
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
        # the prefix cache's totals, kept by every change, equal a recount of its chunks
        np.testing.assert_array_equal(tr["cache_kept"], tr["cache_scan"])
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
    time = np.r_[float(st0.clock), tr["time"]]
    assert (np.diff(time) >= 0).all()
    last = np.concatenate([np.asarray(st0.nodes.last_time)[None], tr["last_time"]])
    assert (np.diff(last, axis=0) >= 0).all()
    # the final step drains: nothing in flight, every accepted request finished after it arrived
    assert tr["done"][-1] and not tr["done"][:-1].any()
    assert tr["in_flight"][-1] == 0
    dropped = np.asarray(st.log.dropped)
    e2e = np.asarray(st.log.e2e)
    ttft = np.asarray(st.log.ttft)
    arrival = np.asarray(st0.requests.arrival)[:e]
    assert np.isfinite(e2e[~dropped]).all() and np.isnan(e2e[dropped]).all()
    assert (ttft[~dropped] > 0).all() and (e2e[~dropped] >= ttft[~dropped]).all()
    assert float(st.t_end) >= np.nanmax(arrival + e2e, initial=arrival[-1]) - 1e-4
    assert (tr["error"] == 0).all()
    # the prefix cache never serves the whole prompt (one token is always prefilled), serves
    # shared prefixes when there are some, and nothing without a cache
    hits = np.asarray(st.log.hit_tokens)
    prompt = np.asarray(st0.requests.prompt)[:e]
    assert (hits[~dropped] <= prompt[~dropped] - 1).all()
    assert (hits.sum() > 0) == (case == "prefix")
