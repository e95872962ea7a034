"""Every router by name: the heuristics (`agents.heuristics`) and the production routers
(`agents.production`)."""

from __future__ import annotations

from agents.heuristics import HEURISTICS, Router
from agents.production import PRODUCTION

ROUTERS: dict[str, type[Router]] = {r.name: r for r in (*HEURISTICS, *PRODUCTION)}


def make_router(name: str, n_nodes: int, seed: int = 0) -> Router:
    """The router called `name` (see `ROUTERS`) for clusters of `n_nodes`."""
    if name not in ROUTERS:
        raise ValueError(f"unknown router {name!r}; valid routers: {', '.join(ROUTERS)}")
    return ROUTERS[name](n_nodes, seed=seed)
