"""Heuristic routers, vectorised over environments: a batch of router views in, a batch of node
indices out (NumPy).

Routers read `burstgym.observation.RouterView` in natural units (requests, tokens, blocks), with a
leading batch dimension: per-node fields [B, N], scalars [B]. Learned routers read the normalised
observation instead, so every router is called as `router(obs, mask, view)`. Ties between equally
good nodes are broken by a per-environment rotating offset, so an empty cluster is not always fed
through node 0. Every router except round-robin, random and weighted skew avoids nodes the action
mask marks as full (the mask is all True when every node would drop).

The production routers (SGLang, Dynamo, llm-d, AIBrix, vLLM production stack) are in
`agents.production`; `agents.routers.ROUTERS` lists both families.
"""

from __future__ import annotations

import numpy as np

from burstgym.observation import RouterView
from burstgym.types import IDLE


class Router:
    """Base class: `reset(n_envs)` once, then `__call__(obs, mask, view)` per step; `obs` is
    [n_envs, obs_size], `mask` [n_envs, n_nodes] bool (None: every node allowed), `view` a
    batched `RouterView` of NumPy arrays."""

    name = "router"
    balancing = True  # False for routers that take skew on purpose (for the regime map)

    def __init__(self, n_nodes: int, seed: int = 0):
        self.n_nodes = n_nodes
        self.seed = seed
        self.reset(1)

    def reset(self, n_envs: int) -> None:
        """Start a fresh batch of `n_envs` episodes."""
        self.n_envs = n_envs
        self.counter = np.zeros(n_envs, dtype=np.int64)
        self.rng = np.random.default_rng(self.seed)

    def __call__(self, obs: np.ndarray, mask: np.ndarray | None, view: RouterView) -> np.ndarray:
        b = np.asarray(view.running).shape[0]
        mask = np.ones((b, self.n_nodes), dtype=bool) if mask is None else np.asarray(mask, dtype=bool)
        v = RouterView(*(np.asarray(x) for x in view))
        actions = self.act(v, mask)
        self.counter += 1
        return np.asarray(actions).astype(np.int64)

    def act(self, view: RouterView, mask: np.ndarray) -> np.ndarray:
        """Pick a node per environment from the batched `view`."""
        raise NotImplementedError

    @staticmethod
    def outstanding(view: RouterView) -> np.ndarray:
        """[B, N] requests running or waiting on each node."""
        return view.running + view.waiting

    def argmin(self, score: np.ndarray, mask: np.ndarray, *then: np.ndarray) -> np.ndarray:
        """Per environment, the allowed node of least `score`; exact ties go to the least of each
        key in `then` in turn (compared exactly, in float64), then to a rotating offset."""
        n = self.n_nodes
        rotation = (np.arange(n)[None, :] - self.counter[:, None]) % n
        tied = mask & np.isfinite(score)
        tied = np.where(tied.any(axis=1, keepdims=True), tied, True)
        for key in (score, *then):
            k = np.where(tied, np.asarray(key, dtype=np.float64), np.inf)
            tied &= k == k.min(axis=1, keepdims=True)
        return np.argmin(np.where(tied, rotation, n), axis=1)


class RoundRobin(Router):
    """Node `t mod N` for the t-th request of each episode (everyone's default)."""

    name = "round-robin"

    def act(self, view, mask):
        return self.counter % self.n_nodes


class Random(Router):
    """A uniformly random node (the other universal baseline)."""

    name = "random"

    def act(self, view, mask):
        return self.rng.integers(0, self.n_nodes, size=mask.shape[0])


class LeastRequests(Router):
    """Join the shortest queue: fewest running + waiting requests (Vidur LOR, splitwise JSQ)."""

    name = "jsq"

    def act(self, view, mask):
        return self.argmin(self.outstanding(view), mask)


class LeastTokens(Router):
    """Fewest prompt tokens still to prefill (the only outstanding tokens the router can see;
    output lengths are hidden), then fewest requests (llm-d / AIBrix least-outstanding-tokens)."""

    name = "least-tokens"

    def act(self, view, mask):
        return self.argmin(view.prefill_tokens, mask, self.outstanding(view))


class PowerOfTwo(Router):
    """Sample two distinct nodes, send to the one with fewer requests (Ray Serve, Mitzenmacher)."""

    name = "power-of-two"

    def act(self, view, mask):
        b, n = mask.shape
        first = self.rng.integers(0, n, size=b)
        second = (first + self.rng.integers(1, n, size=b)) % n if n > 1 else first
        pair = np.zeros((b, n), dtype=bool)
        pair[np.arange(b), first] = True
        pair[np.arange(b), second] = True
        allowed = pair & mask
        allowed = np.where(allowed.any(axis=1, keepdims=True), allowed, mask)
        return self.argmin(self.outstanding(view), allowed)


class LeastKV(Router):
    """Lowest KV-cache utilisation, then fewest requests (llm-d / AIBrix KV-cache scorers)."""

    name = "least-kv"

    def act(self, view, mask):
        return self.argmin(view.kv_util, mask, self.outstanding(view))


class WeightedSkew(Router):
    """The claim's recipe: a fixed weighted split in which node 0 gets 10% more traffic than each
    other node (weights 1.1 : 1 : ... : 1, i.e. 11 of every 10N + 1 requests on node 0), dealt
    deterministically by smooth weighted round-robin (nginx) per environment."""

    name = "weighted-skew"
    balancing = False

    def reset(self, n_envs):
        super().reset(n_envs)
        self.weights = np.full(self.n_nodes, 10.0)
        self.weights[0] = 11.0
        self.current = np.zeros((n_envs, self.n_nodes))

    def act(self, view, mask):
        self.current += self.weights
        pick = np.argmax(self.current, axis=1)
        self.current[np.arange(pick.size), pick] -= self.weights.sum()
        return pick


class PackLoad(Router):
    """Bin packing (AIBrix slo-pack-load): the busiest node (most outstanding requests) still under
    the cap `kv_util < kv_cap` with at most `max_waiting` waiting requests; when no node is under
    the cap, the least loaded node. The cap is on KV usage and the queue, the two signals vLLM
    exports, rather than on a running limit a router cannot read."""

    name = "pack-load"
    balancing = False
    kv_cap = 0.9
    max_waiting = 2

    def act(self, view, mask):
        load = self.outstanding(view)
        under = (view.kv_util < self.kv_cap) & (view.waiting <= self.max_waiting) & mask
        pack = self.argmin(-load, under)
        spread = self.argmin(load, mask)
        return np.where(under.any(axis=1), pack, spread)


class SoonestBatch(Router):
    """For batching windows (Triton dynamic batcher): join the forming batch that launches soonest,
    on an idle node that already has waiting requests, ranked by the age of its oldest waiting
    request, then by how many wait; when no idle node has a forming batch, the node with fewest
    requests."""

    name = "soonest-batch"
    balancing = False

    def act(self, view, mask):
        forming = (view.phase == IDLE) & (view.waiting > 0) & mask
        join = self.argmin(-view.window_age, forming, -view.waiting)
        spread = self.argmin(self.outstanding(view), mask)
        return np.where(forming.any(axis=1), join, spread)


HEURISTICS: tuple[type[Router], ...] = (
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
