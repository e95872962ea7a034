"""What a router is: the typed protocol the rollout engine, the Gymnasium faces and `evaluate.py`
rely on, and the one function that calls a router according to its capabilities.

A router is a pure JAX rule over one cluster (`burstgym.observation.RouterView`, per-node fields
[N], an action mask [N]), vmapped over clusters and scanned over an episode by the engine
(`burstgym.rollout`); the batched NumPy call that SB3 and Python users make is derived from the
same rule (`agents.routers.BatchedRouter`), never written again:

    state = router.init(n_nodes, seed, stream)          # stream: the episode's seed
    action, state = router.act(state, view, mask)       # action: [] int32

A router says what it is with `name` and `family` (one of `FAMILIES`): code that groups routers
(the regime map of `evaluate.py`) reads the family from the router, never from a list of names.
Its state is any pytree; routers in one compiled episode may have states of different structure.

Optional capabilities, each a class attribute that is true when present:
- `observes`: a learned policy; called `act(state, view, mask, obs, weights)` with the cluster's
  normalised observation (`burstgym.observation.observe`) and the pytree its `weights()` returns
  (weights are an argument of the compiled episode, not constants in it);
- `reads_state`: a router that needs the whole cluster, for example a bound that forks the
  cluster and simulates ahead, or a model-based router reading each node's latency profile;
  called `act(state, view, mask, cluster_state, params)` with the cluster's `State` and
  `EnvParams` as the engine holds them before the request is routed.
A router may also declare `schedulers` (a tuple of `burstgym.types.SCHEDULERS`): the batching
regimes under which it takes part in its family (a batching-window rule is join-the-shortest-queue
under continuous batching); absent, every regime.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import jax

from burstgym.observation import RouterView
from burstgym.types import SCHEDULERS

# balancing: spreads load; batching: takes skew for bigger batches (or sleep); affinity: takes
# skew for prefix-cache hits; learned: a trained policy; model-based: predicts each node's latency
# for the request from a model of the nodes (agents.marginal_cost); bound: not a deployable router
# but a reference (an oracle or a lookahead) that bounds what routing can achieve.
FAMILIES = ("balancing", "batching", "affinity", "learned", "model-based", "bound")


@runtime_checkable
class Router(Protocol):
    """A routing rule the engine can run (see the module docstring)."""

    name: str
    family: str

    def init(self, n_nodes: int, seed: Any = None, stream: Any = 0) -> Any:
        """A fresh episode's state; `seed` and `stream` may be traced integers."""
        ...

    def act(self, state: Any, view: RouterView, mask: jax.Array, *extra: Any) -> tuple[jax.Array, Any]:
        """The node for the arriving request ([] int32) and the next state."""
        ...


def family_of(router: Any) -> str:
    """The router's family, checked against `FAMILIES` (a clear error for a router without one)."""
    family = getattr(router, "family", None)
    if family not in FAMILIES:
        name = getattr(router, "name", type(router).__name__)
        raise ValueError(f"router {name!r} has family {family!r}; families: {', '.join(FAMILIES)}")
    return family


def takes_part(router: Any, scheduler: str) -> bool:
    """Whether `router` takes part in its family under batching regime `scheduler`."""
    if scheduler not in SCHEDULERS:
        raise ValueError(f"unknown scheduler {scheduler!r}; valid: {', '.join(SCHEDULERS)}")
    return scheduler in getattr(router, "schedulers", SCHEDULERS)


def act(
    router: Any,
    state: Any,
    view: RouterView,
    mask: jax.Array,
    *,
    obs: jax.Array | None = None,
    weights: Any = None,
    cluster_state: Any = None,
    params: Any = None,
) -> tuple[jax.Array, Any]:
    """Call `router.act` with what its capabilities ask for (the module docstring)."""
    if getattr(router, "observes", False):
        return router.act(state, view, mask, obs, weights)
    if getattr(router, "reads_state", False):
        return router.act(state, view, mask, cluster_state, params)
    return router.act(state, view, mask)
