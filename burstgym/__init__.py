"""burstgym: a laboratory for routing traffic across batching LLM inference servers.

Importing it registers `BurstBalance-v0` with Gymnasium (with a native vector entry point).
"""

import gymnasium as gym

from burstgym.scenarios import SCENARIOS, make

__all__ = ["SCENARIOS", "make"]
__version__ = "0.1.0"

if "BurstBalance-v0" not in gym.registry:
    gym.register(
        id="BurstBalance-v0",
        entry_point="burstgym.gym_env:BurstBalanceEnv",
        vector_entry_point="burstgym.gym_env:BurstBalanceVectorEnv",
        disable_env_checker=False,
    )
