"""Every router by name: one rule per module of this package, found by scanning it.

A rule is written once, in JAX, for one cluster (`agents.routers.base.Rule`, the protocol of
`burstgym.routing`); the rollout engine runs it inside the compiled episode and
`make_router` derives the batched NumPy face from it. Adding a router is adding one module here
that defines a `Rule` subclass with a `name` and a `family`, a test, and a line in the table of
docs/agents.md.

    rule = make_rule("dynamo-kv", temperature=0.5)      # the JAX rule, parameters overridden
    router = make_router("jsq", n_nodes=4)              # router(obs, mask, view) on NumPy batches
"""

from __future__ import annotations

import dataclasses
import importlib
import pkgutil
from typing import Any

from agents.routers.base import BatchedRouter, GroupedRouter, Rule
from burstgym.routing import FAMILIES, family_of
from burstgym.types import EnvConfig, EnvParams


def _discover() -> dict[str, type[Rule]]:
    found: dict[str, type[Rule]] = {}
    for info in pkgutil.iter_modules(__path__):
        if info.name == "base":
            continue
        module = importlib.import_module(f"{__name__}.{info.name}")
        for obj in vars(module).values():
            mine = isinstance(obj, type) and issubclass(obj, Rule) and obj.__module__ == module.__name__
            if mine and obj.name:
                if obj.name in found:
                    raise ValueError(f"two routers are called {obj.name!r}: {found[obj.name]} and {obj}")
                family_of(obj)
                found[obj.name] = obj
    # by family, round-robin (the baseline) first, then by name
    order = sorted(
        found.items(), key=lambda kv: (FAMILIES.index(kv[1].family), kv[0] != "round-robin", kv[0])
    )
    return dict(order)


ROUTERS: dict[str, type[Rule]] = _discover()


def make_rule(name: str, seed: int = 0, **params: Any) -> Rule:
    """The rule called `name` (see `ROUTERS`) with its parameters overridden by `params`."""
    if name not in ROUTERS:
        raise ValueError(f"unknown router {name!r}; valid routers: {', '.join(ROUTERS)}")
    cls = ROUTERS[name]
    fields = {f.name for f in dataclasses.fields(cls)} - {"seed"}
    for key in params:
        if key not in fields:
            valid = ", ".join(sorted(fields)) or "none"
            raise ValueError(f"router {name!r} has no parameter {key!r}; parameters: {valid}")
    return cls(seed=seed, **params)


# Deployable routers configured from the scenario they serve (its nodes, lengths and objective),
# beside the rules of ROUTERS: agents/marginal_cost.py.
SCENARIO_ROUTERS = ("marginal-cost",)


def scenario_rule(name: str, cfg: EnvConfig, params: EnvParams, seed: int = 0, **options: Any) -> Rule:
    """The deployable router called `name` for the scenario `cfg`, `params`: a rule of `ROUTERS`
    (`make_rule`), or one of `SCENARIO_ROUTERS` configured with the scenario."""
    if name == "marginal-cost":
        from agents.marginal_cost import MarginalCost  # it builds on this package's base

        return MarginalCost.for_scenario(cfg, params, seed=seed, **options)
    if name not in ROUTERS:
        valid = ", ".join((*ROUTERS, *SCENARIO_ROUTERS))
        raise ValueError(f"unknown router {name!r}; valid routers: {valid}")
    return make_rule(name, seed, **options)


def make_router(name: str, n_nodes: int, seed: int = 0, **params: Any) -> BatchedRouter:
    """The router called `name` for clusters of `n_nodes`, as a batched NumPy router."""
    return BatchedRouter(make_rule(name, seed, **params), n_nodes)


__all__ = [
    "ROUTERS",
    "SCENARIO_ROUTERS",
    "BatchedRouter",
    "GroupedRouter",
    "Rule",
    "make_router",
    "make_rule",
    "scenario_rule",
]
