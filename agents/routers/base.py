"""What every router is made of: the state, the base class of the rules, exact tie-breaking, and
the batched NumPy face derived from a rule.

A rule (`Rule`) is a frozen dataclass (hashable: a static argument of jit, and one compiled
episode per structure) whose parameters are its fields, written once in JAX for one cluster
(per-node fields [N], `burstgym.routing`). `BatchedRouter` is the face SB3's warm start, the
step-by-step rollout and Python users call, `router(obs, mask, view) -> actions` on a batch of
clusters: `jit(vmap(rule.act))` over the batch, never a second implementation.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from agents.routers.index import IndexSpec, held_tokens, record
from agents.routers.index import empty as empty_index
from agents.routers.index import matched as index_matched
from burstgym.compile_cache import jit
from burstgym.observation import RouterView


class RuleState(NamedTuple):
    """A rule's state in one cluster."""

    counter: jax.Array  # [] int32, decisions made with this state (round-robin deals from it)
    key: jax.Array  # [2] uint32, raw PRNG key data (jax.random.key_data)
    extra: Any  # the rule's own pytree (`Rule.init_extra`; () for most)


def rotation(counter: jax.Array, n: int) -> jax.Array:
    """[N] tie-break ranks starting at node `counter mod N` and wrapping (a rotating offset, so
    that an empty cluster is not always fed through node 0)."""
    return (jnp.arange(n, dtype=jnp.int32) - counter) % n


def first(n: int) -> jax.Array:
    """[N] tie-break ranks in node order (the first of the tied nodes wins: Rust's `min_by_key`)."""
    return jnp.arange(n, dtype=jnp.int32)


def argmin(score: jax.Array, mask: jax.Array, *then: jax.Array, order: jax.Array) -> jax.Array:
    """The allowed node of least `score`; exact ties go to the least of each key in `then` in turn,
    then to the least rank in `order` ([N], a permutation). With no allowed finite score every node
    is a candidate."""
    n = score.shape[0]
    tied = mask & jnp.isfinite(score)
    tied = jnp.where(tied.any(), tied, True)
    for key in (score, *then):
        k = jnp.where(tied, key, jnp.inf)
        tied = tied & (k == k.min())
    return jnp.argmin(jnp.where(tied, order, n)).astype(jnp.int32)


def outstanding(view: RouterView) -> jax.Array:
    """[N] requests running or waiting on each node (what a router counts as in flight)."""
    return view.running + view.waiting


@dataclass(frozen=True)
class Rule:
    """Base of every routing rule: `init`, `act` (`burstgym.routing.Router`); subclasses set
    `name`, `family` and write `decide`."""

    name: ClassVar[str] = ""
    family: ClassVar[str] = ""
    seed: int = 0

    def init(self, n_nodes: int, seed: Any = None, stream: Any = 0) -> RuleState:
        """A fresh episode's state; the PRNG key is `fold_in(key(seed), stream)` (`seed` defaults
        to the rule's), so each episode (stream) draws its own numbers. `seed` and `stream` may
        be traced integers (vmapped over clusters)."""
        seed = self.seed if seed is None else seed
        key = jax.random.key(jnp.asarray(seed, jnp.uint32))
        key = jax.random.fold_in(key, jnp.asarray(stream, jnp.uint32))
        return RuleState(jnp.int32(0), jax.random.key_data(key), self.init_extra(n_nodes))

    def init_extra(self, n_nodes: int) -> Any:
        """The rule's own state at the start of an episode (a pytree of arrays)."""
        return ()

    def act(self, state: RuleState, view: RouterView, mask: jax.Array) -> tuple[jax.Array, RuleState]:
        """The node for the arriving request ([] int32) and the next state (counter + 1). The
        rule's own state restarts with each episode (`view.step == 0`), so a batch of clusters
        that auto-reset keeps no index of an earlier episode's requests."""
        mask = jnp.asarray(mask, bool)
        start = jnp.asarray(view.step) == 0
        extra = jax.lax.cond(start, lambda: self.init_extra(mask.shape[0]), lambda: state.extra)
        action, state = self.decide(state._replace(extra=extra), view, mask)
        return action.astype(jnp.int32), state._replace(counter=state.counter + 1)

    def decide(self, state: RuleState, view: RouterView, mask: jax.Array) -> tuple[jax.Array, RuleState]:
        """The rule: the node and the next state (the counter is advanced by `act`)."""
        raise NotImplementedError

    @staticmethod
    def draw(state: RuleState) -> tuple[jax.Array, RuleState]:
        """A fresh subkey, and the state holding the advanced key."""
        key, sub = jax.random.split(jax.random.wrap_key_data(state.key))
        return sub, state._replace(key=jax.random.key_data(key))

    @classmethod
    def random_order(cls, state: RuleState, n: int) -> tuple[jax.Array, RuleState]:
        """[N] tie-break ranks drawn uniformly at random (a router that picks among tied nodes at
        random), and the state holding the advanced key."""
        sub, state = cls.draw(state)
        return jax.random.permutation(sub, n).astype(jnp.int32), state


class BatchedRouter:
    """A rule as a router over a batch of clusters: `reset(n_envs)`, then `router(obs, mask, view)`
    per step with `view` a batched `RouterView` of NumPy arrays ([B, N] per node, [B] scalars),
    `mask` [B, N] bool (None: every node allowed); returns [B] int64 actions. Cluster b's state
    starts from `rule.init(n_nodes, stream=streams[b])` (default b; the rollout engine streams
    each episode's seed, so both faces draw the same numbers for the same episodes).

    :param rule: the JAX rule (`agents.routers`), also `self.rule` for the rollout engine.
    :param n_nodes: nodes per cluster.
    :param act: the rule's function to run in place of `rule.act`, for a rule that reads more of
        the cluster than its view (`reads_state`): `act(state, view, mask, *more)`, `more` what
        each call passes after the view (`agents.predicted_latency.StreamedRouter`).
    """

    def __init__(self, rule: Rule, n_nodes: int, act: Callable | None = None):
        if act is None and getattr(rule, "reads_state", False):
            raise ValueError(f"router {rule.name!r} reads the cluster's state: run it in the JAX engine")
        self.rule, self.n_nodes = rule, n_nodes
        self.name, self.family, self.seed = rule.name, rule.family, rule.seed
        self._act = jit(jax.vmap(rule.act if act is None else act))
        self._init = jit(jax.vmap(lambda s: rule.init(n_nodes, stream=s)))
        self.reset(1)

    def reset(self, n_envs: int, streams: Any = None) -> None:
        """Start a fresh batch of `n_envs` episodes, drawing from `streams` ([n_envs] integers)."""
        streams = np.arange(n_envs) if streams is None else np.asarray(streams)
        if streams.shape != (n_envs,):
            raise ValueError(f"{streams.shape[0]} streams for {n_envs} environments")
        self.n_envs = n_envs
        self.state = self._init(jnp.asarray(streams, dtype=jnp.uint32))

    def __call__(self, obs: Any, mask: np.ndarray | None, view: RouterView, *more: Any) -> np.ndarray:
        b = np.shape(view.running)[0]
        if b != self.n_envs:
            raise ValueError(f"a batch of {b} views for a router reset for {self.n_envs} environments")
        mask = np.ones((b, self.n_nodes), dtype=bool) if mask is None else np.asarray(mask, dtype=bool)
        actions, self.state = self._act(self.state, view, mask, *more)
        return np.asarray(actions).astype(np.int64)


class GroupedRouter:
    """Batched routers of consecutive groups of one batch as one batched router (`BatchedRouter`'s
    face): the teacher of a mixture's vector env (`agents.sb3_vec_env.MixtureVecEnv`), whose
    groups each need the rule built for their own parameters.

    :param routers: one `BatchedRouter` per group, in the batch's order.
    :param sizes: clusters of each group.
    """

    def __init__(self, routers: list[BatchedRouter], sizes: list[int]):
        if len(routers) != len(sizes):
            raise ValueError(f"{len(routers)} routers for {len(sizes)} groups")
        self.routers, self.sizes = routers, list(sizes)
        self.name, self.family, self.seed = routers[0].name, routers[0].family, routers[0].seed
        ends = np.cumsum([0, *self.sizes])
        self._slices = [slice(int(a), int(b)) for a, b in zip(ends[:-1], ends[1:], strict=True)]

    def reset(self, n_envs: int, streams: Any = None) -> None:
        """Start a fresh batch of `n_envs` (the groups' total) episodes, drawing from `streams`."""
        if n_envs != sum(self.sizes):
            raise ValueError(f"a batch of {n_envs} environments for groups of {sum(self.sizes)}")
        streams = np.arange(n_envs) if streams is None else np.asarray(streams)
        for r, sl in zip(self.routers, self._slices, strict=True):
            r.reset(sl.stop - sl.start, streams[sl])

    def __call__(self, obs: Any, mask: np.ndarray | None, views: list[RouterView]) -> np.ndarray:
        """`views`: one batched view per group (`MixtureVecEnv.router_views`); `obs`, `mask`: the
        whole batch's. Returns [B] int64 actions."""
        if len(views) != len(self.routers):
            raise ValueError(f"{len(views)} groups of views for {len(self.routers)} routers")
        out = []
        for r, sl, view in zip(self.routers, self._slices, views, strict=True):
            out.append(r(None if obs is None else obs[sl], None if mask is None else mask[sl], view))
        return np.concatenate(out)


CACHE_VIEWS = ("router", "engine")


@dataclass(frozen=True)
class Affinity(Rule):
    """Base of the prefix-aware rules: `matched` gives each node's cached leading prompt tokens for
    the arriving request and `tree_size` the tokens each node's cache holds, as the rule sees them;
    `routed` records the decision in the rule's own state.

    `cache_view` says which cache the rule reads: "router" (default) the index its real
    counterpart keeps (`index`, `agents.routers.index`; a rule whose real router follows the
    engines' KV events has none and reads the engines' cache), "engine" the engines' exact,
    current cache (`RouterView.hit_tokens`, `cached_tokens`) whatever the real router keeps."""

    family: ClassVar[str] = "affinity"
    index: ClassVar[IndexSpec | None] = None  # the real router's own index (None: KV events)
    cache_view: str = "router"

    def __post_init__(self):
        if self.cache_view not in CACHE_VIEWS:
            raise ValueError(f"cache_view must be one of {', '.join(CACHE_VIEWS)}, got {self.cache_view!r}")
        if self.index is not None and self.cache_view != "router":  # its own name in a results table
            object.__setattr__(self, "name", f"{type(self).name}@{self.cache_view}")

    @property
    def keeps_index(self) -> bool:
        """Whether the rule reads its own index (rather than the engines' cache)."""
        return self.cache_view == "router" and self.index is not None

    def init_extra(self, n_nodes: int) -> Any:
        return empty_index(self.index, n_nodes) if self.keeps_index else ()

    def matched(self, state: RuleState, view: RouterView) -> jax.Array:
        """[N] leading prompt tokens of the arriving request each node holds."""
        if self.keeps_index:
            return index_matched(state.extra, self.index, view)
        return view.hit_tokens

    def tree_size(self, state: RuleState, view: RouterView) -> jax.Array:
        """[N] tokens each node's cache holds (its "tree size")."""
        if self.keeps_index:
            return held_tokens(state.extra, self.index, view)
        return view.cached_tokens

    def routed(self, state: RuleState, view: RouterView, node: jax.Array) -> RuleState:
        """The state after routing the arriving request to `node`."""
        if self.keeps_index:
            return state._replace(extra=record(state.extra, self.index, view, node))
        return state
