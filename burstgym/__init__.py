"""burstgym: a laboratory for routing traffic across batching LLM inference servers.

Importing it registers `BurstBalance-v0` with Gymnasium (with a native vector entry point) and
turns on JAX's persistent compilation cache (`burstgym.compile_cache`: `BURSTGYM_JAX_CACHE=off`
switches it off, `BURSTGYM_JAX_CACHE=/folder` moves it).
`burstgym.SCENARIOS` and `burstgym.make` come from `burstgym.scenarios`, imported on first use
so that `python -m burstgym.latency` and `python -m burstgym.calibrate` start cleanly.
"""

from typing import Any

import gymnasium as gym

from burstgym import compile_cache

__all__ = ["SCENARIOS", "make"]
__version__ = "0.1.0"

compile_cache.enable()

if "BurstBalance-v0" not in gym.registry:
    gym.register(
        id="BurstBalance-v0",
        entry_point="burstgym.gym_env:BurstBalanceEnv",
        vector_entry_point="burstgym.gym_env:BurstBalanceVectorEnv",
    )


def __getattr__(name: str) -> Any:
    if name in __all__:
        from burstgym import scenarios

        return getattr(scenarios, name)
    raise AttributeError(f"module 'burstgym' has no attribute {name!r}")
