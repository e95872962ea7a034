"""Heuristic routers, vectorised over environments: a batch of observations in, a batch of node
indices out (NumPy). They read the documented observation (`burstgym.observation`): per node
`running`, `waiting`, `kv_util`, `outstanding_prompt`, `window_age`, `idle`, `busy`, `asleep`.

Counts are recovered from the normalised features with the limits in `ClusterLimits`
(`running * running_limit + waiting * queue_capacity` = outstanding requests). Ties between
equally good nodes are broken by a per-environment rotating offset, so an empty cluster is not
always fed through node 0. Every router except round-robin, random and weighted skew avoids
nodes the action mask marks as full (the mask is all True when every node would drop).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from burstgym.observation import NODE_FEATURES, node_features
from burstgym.scenarios import settings_for

RUNNING, WAITING, KV_UTIL, OUT_PROMPT, WINDOW_AGE, IDLE, BUSY, ASLEEP = range(len(NODE_FEATURES))


@dataclass(frozen=True)
class ClusterLimits:
    """What a router must know to turn normalised features back into counts."""

    n_nodes: int
    running_limit: int  # max_num_seqs (continuous) or max_batch_size (dynamic)
    queue_capacity: int

    @classmethod
    def of(cls, scenario: str, **settings) -> ClusterLimits:
        """The limits of a scenario with `settings` overrides applied."""
        _, s = settings_for(scenario, **settings)
        limit = s.max_num_seqs if s.scheduler == "continuous" else s.max_batch_size
        return cls(s.n_nodes, limit, s.queue_capacity)


class Router:
    """Base class: `reset(n_envs)` once, then `__call__(obs, mask)` per step; `obs` is
    [n_envs, obs_size], `mask` [n_envs, n_nodes] bool (None: every node allowed)."""

    name = "router"
    balancing = True  # False for routers that take skew on purpose (for the regime map)

    def __init__(self, limits: ClusterLimits, seed: int = 0):
        self.limits = limits
        self.seed = seed
        self.reset(1)

    def reset(self, n_envs: int) -> None:
        """Start a fresh batch of `n_envs` episodes."""
        self.n_envs = n_envs
        self.counter = np.zeros(n_envs, dtype=np.int64)
        self.rng = np.random.default_rng(self.seed)

    def __call__(self, obs: np.ndarray, mask: np.ndarray | None = None) -> np.ndarray:
        obs = np.asarray(obs, dtype=np.float64)
        if mask is None:
            mask = np.ones((obs.shape[0], self.limits.n_nodes), dtype=bool)
        actions = self.act(node_features(obs, self.limits.n_nodes), np.asarray(mask, dtype=bool))
        self.counter += 1
        return actions.astype(np.int64)

    def act(self, feats: np.ndarray, mask: np.ndarray) -> np.ndarray:
        """Pick a node per environment from `feats` [n_envs, n_nodes, features]."""
        raise NotImplementedError

    def outstanding(self, feats: np.ndarray) -> np.ndarray:
        """[n_envs, n_nodes] requests running or waiting on each node."""
        lim = self.limits
        return feats[..., RUNNING] * lim.running_limit + feats[..., WAITING] * lim.queue_capacity

    def argmin(self, score: np.ndarray, mask: np.ndarray) -> np.ndarray:
        """Per environment, the allowed node of least `score`; ties go to a rotating offset."""
        n = self.limits.n_nodes
        rotation = (np.arange(n)[None, :] - self.counter[:, None]) % n
        key = np.where(mask, score, np.inf) + 1e-9 * rotation  # scores differ by >= 1/limit
        return np.argmin(key, axis=1)


class RoundRobin(Router):
    """Node `t mod N` for the t-th request of each episode (everyone's default)."""

    name = "round-robin"

    def act(self, feats, mask):
        return self.counter % self.limits.n_nodes


class Random(Router):
    """A uniformly random node (the other universal baseline)."""

    name = "random"

    def act(self, feats, mask):
        return self.rng.integers(0, self.limits.n_nodes, size=feats.shape[0])


class LeastRequests(Router):
    """Join the shortest queue: fewest running + waiting requests (Vidur LOR, splitwise JSQ)."""

    name = "jsq"

    def act(self, feats, mask):
        return self.argmin(self.outstanding(feats), mask)


class LeastTokens(Router):
    """Fewest prompt tokens still to prefill (the only outstanding tokens the router can see;
    output lengths are hidden), then fewest requests (llm-d / AIBrix least-outstanding-tokens)."""

    name = "least-tokens"

    def act(self, feats, mask):
        return self.argmin(feats[..., OUT_PROMPT] + 1e-4 * self.outstanding(feats), mask)


class PowerOfTwo(Router):
    """Sample two distinct nodes, send to the one with fewer requests (Ray Serve, Mitzenmacher)."""

    name = "power-of-two"

    def act(self, feats, mask):
        b, n = mask.shape
        first = self.rng.integers(0, n, size=b)
        second = (first + self.rng.integers(1, n, size=b)) % n if n > 1 else first
        pair = np.zeros((b, n), dtype=bool)
        pair[np.arange(b), first] = True
        pair[np.arange(b), second] = True
        allowed = pair & mask
        allowed = np.where(allowed.any(axis=1, keepdims=True), allowed, mask)
        return self.argmin(self.outstanding(feats), allowed)


class LeastKV(Router):
    """Lowest KV-cache utilisation, then fewest requests (llm-d / AIBrix KV-cache scorers)."""

    name = "least-kv"

    def act(self, feats, mask):
        return self.argmin(feats[..., KV_UTIL] + 1e-4 * self.outstanding(feats), mask)


class WeightedSkew(Router):
    """The claim's recipe: a fixed weighted split in which node 0 gets 10% more traffic than each
    other node (weights 1.1 : 1 : ... : 1, i.e. 11 of every 10N + 1 requests on node 0), dealt
    deterministically by smooth weighted round-robin (nginx) per environment."""

    name = "weighted-skew"
    balancing = False

    def reset(self, n_envs):
        super().reset(n_envs)
        n = self.limits.n_nodes
        self.weights = np.full(n, 10.0)
        self.weights[0] = 11.0
        self.current = np.zeros((n_envs, n))

    def act(self, feats, mask):
        self.current += self.weights
        pick = np.argmax(self.current, axis=1)
        self.current[np.arange(pick.size), pick] -= self.weights.sum()
        return pick


class PackLoad(Router):
    """Bin packing (AIBrix slo-pack-load): the busiest node (most requests relative to its running
    limit) still under the cap `kv_util < kv_cap`, `running < running_cap` and at most
    `max_waiting` waiting requests; when no node is under the cap, the least loaded node."""

    name = "pack-load"
    balancing = False
    kv_cap = 0.9
    running_cap = 0.9
    max_waiting = 2

    def act(self, feats, mask):
        load = self.outstanding(feats) / self.limits.running_limit
        waiting = feats[..., WAITING] * self.limits.queue_capacity
        under = (feats[..., KV_UTIL] < self.kv_cap) & (feats[..., RUNNING] < self.running_cap)
        under &= (waiting <= self.max_waiting + 1e-6) & mask
        pack = self.argmin(-load, under)
        spread = self.argmin(load, mask)
        return np.where(under.any(axis=1), pack, spread)


class SoonestBatch(Router):
    """For batching windows (Triton dynamic batcher): join the forming batch that launches soonest,
    on an idle node that already has waiting requests, ranked by progress towards launch
    max(window_age, waiting / running_limit) (the window expires or the batch fills); when no idle
    node has a forming batch, the node with fewest requests."""

    name = "soonest-batch"
    balancing = False

    def act(self, feats, mask):
        waiting = feats[..., WAITING] * self.limits.queue_capacity
        forming = (feats[..., IDLE] > 0.5) & (waiting > 0.5) & mask
        progress = np.maximum(feats[..., WINDOW_AGE], waiting / self.limits.running_limit)
        join = self.argmin(-progress, forming)
        spread = self.argmin(self.outstanding(feats), mask)
        return np.where(forming.any(axis=1), join, spread)


ROUTERS: dict[str, type[Router]] = {
    r.name: r
    for r in (
        RoundRobin,
        Random,
        LeastRequests,
        LeastTokens,
        PowerOfTwo,
        LeastKV,
        WeightedSkew,
        PackLoad,
        SoonestBatch,
    )
}


def make_router(name: str, limits: ClusterLimits, seed: int = 0) -> Router:
    """The heuristic router called `name` (see `ROUTERS`)."""
    if name not in ROUTERS:
        raise ValueError(f"unknown router {name!r}; valid routers: {', '.join(ROUTERS)}")
    return ROUTERS[name](limits, seed=seed)
