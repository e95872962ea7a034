"""lookahead: each decision takes the node whose forked, drained cluster costs least; the forked
cost is the core's own drained step; the engine runs it through `reads_state`."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from agents.lookahead import Lookahead, forked_costs
from agents.routers import make_rule
from burstgym import scenarios
from burstgym.env import BurstBalance
from burstgym.observation import action_mask
from burstgym.rollout import rollout

E = 16
ALL = np.ones(3, bool)  # every node of the 3-node clusters allowed


@functools.lru_cache(maxsize=4)
def _setup(scenario: str):
    cfg, params = scenarios.make(scenario, n_nodes=3, episode_length=E, load=0.9)
    core = BurstBalance(cfg)
    bound = Lookahead(cfg)
    others = [make_rule(n) for n in ("round-robin", "jsq", "least-tokens", "least-kv")]

    @jax.jit
    def decide(state, rstate, allow):
        view = core.view(state, params)
        mask = action_mask(view) & allow
        costs = bound.costs(state, params)
        action, rstate = bound.act(rstate, view, mask, state, params)
        picks = [r.act(r.init(cfg.n_nodes), view, mask)[0] for r in others]
        return costs, action, rstate, mask, jnp.stack(picks)

    return cfg, params, core, bound, decide, jax.jit(core.step_env)


def _episode(scenario: str, seed: int):
    """Step one episode with the lookahead; per decision its forked costs, choice, mask, the nodes
    the other routers would pick, and the state before the decision."""
    cfg, params, core, bound, decide, step = _setup(scenario)
    _, state = core.reset(jax.random.key(seed), params)
    rstate = bound.init(cfg.n_nodes)
    out = []
    for _ in range(E):
        costs, action, rstate, mask, picks = decide(state, rstate, ALL)
        out.append((np.asarray(costs), int(action), np.asarray(mask), np.asarray(picks), state))
        _, state, *_ = step(state, action, params)
    return out, state


@pytest.mark.parametrize("scenario", ["bursty", "bursty-dynamic"])
def test_each_choice_has_the_least_drained_cost_over_nodes(scenario):
    """Its choice's forked cost is the minimum over the allowed nodes, so never above the node any
    other router (round-robin, JSQ, least-tokens, least-KV) would have picked at that decision."""
    decisions, _ = _episode(scenario, 0)
    spread = 0.0
    for costs, action, mask, picks, _ in decisions:
        assert mask[action]
        assert costs[action] == costs[mask].min()
        assert np.all(costs[action] <= costs[picks])
        spread = max(spread, float(costs.max() - costs.min()))
    assert spread > 0  # the nodes did differ at some decision


def test_forked_cost_is_the_drained_step_of_the_core():
    """A fork routes the request, cuts the episode after it and drains: its cost equals minus the
    reward of that step of the core, node by node."""
    cfg, params, core, _, _, step = _setup("bursty")
    decisions, _ = _episode("bursty", 1)
    costs, _, _, _, state = decisions[E // 2]
    cut = state._replace(horizon=state.step + 1)
    for node in range(cfg.n_nodes):
        _, drained, reward, done, _ = step(cut, jnp.int32(node), params)
        assert bool(done) and not np.any(np.isnan(np.asarray(drained.log.e2e[: int(state.step) + 1])))
        assert costs[node] == pytest.approx(-float(reward) * float(params.reward_scale), rel=1e-5)


def test_horizon_routes_the_next_arrivals_with_the_base_router():
    """With `horizon` k the fork also routes the next k arrivals (by the base router) before the
    drain: its cost covers them, so it exceeds the one-request fork's; k = 0 is the one-request fork."""
    cfg, params, core, _, _, _ = _setup("bursty")
    decisions, _ = _episode("bursty", 2)
    costs, _, _, _, state = decisions[4]
    drained = dataclasses.replace(cfg, workload=None, end="drain")
    far = jax.jit(lambda s: forked_costs(BurstBalance(drained), s, params, 3, make_rule("jsq")))
    near = jax.jit(lambda s: forked_costs(BurstBalance(drained), s, params, 0))
    np.testing.assert_allclose(np.asarray(near(state)), costs, rtol=1e-6)
    assert np.all(np.asarray(far(state)) > np.asarray(near(state)))
    # At the episode's last arrival there is nothing left to follow: the horizon ends with the episode.
    last, _, _, _, state = decisions[E - 1]
    np.testing.assert_allclose(np.asarray(far(state)), np.asarray(near(state)), rtol=1e-6)
    np.testing.assert_allclose(np.asarray(near(state)), last, rtol=1e-6)


def test_ties_rotate_and_excluded_nodes_are_never_taken():
    """On the empty cluster every fork costs the same, so the choice rotates with the counter (an
    empty cluster is not always fed through node 0); a node the mask excludes is never taken, even
    where its fork is the cheapest."""
    cfg, params, core, bound, decide, _ = _setup("bursty")
    decisions, _ = _episode("bursty", 3)
    costs, _, _, _, first = decisions[0]
    assert np.all(costs == costs[0])
    for counter in range(cfg.n_nodes):
        rstate = bound.init(cfg.n_nodes)._replace(counter=jnp.int32(counter))
        assert int(decide(first, rstate, ALL)[1]) == counter
    costs, action, _, _, state = next(d for d in decisions if np.ptp(d[0]) > 0)
    allow = ALL.copy()
    allow[action] = False
    _, second, _, mask, _ = decide(state, bound.init(cfg.n_nodes), allow)
    assert int(second) != action and costs[int(second)] == costs[np.asarray(mask)].min()


def test_engine_runs_it_through_reads_state_as_stepped():
    """`burstgym.rollout` runs the bound (reads_state) and routes every request as the stepped loop."""
    cfg, params, _, bound, _, _ = _setup("bursty")
    batch = rollout(cfg, params, [bound], [0])
    decisions, _ = _episode("bursty", 0)
    np.testing.assert_array_equal(batch.node[0], [d[1] for d in decisions])


def test_refusals():
    cfg, _ = scenarios.make("steady", n_nodes=2, episode_length=4)
    with pytest.raises(ValueError, match="horizon"):
        Lookahead(cfg, horizon=-1)
    with pytest.raises(ValueError, match="base router"):
        Lookahead(cfg, horizon=2)
    cut = BurstBalance(dataclasses.replace(cfg, end="cut"))
    with pytest.raises(ValueError, match="drain"):
        forked_costs(cut, None, None)
    assert Lookahead(cfg).family == "bound" and Lookahead(cfg).reads_state and not Lookahead(cfg).deployable
