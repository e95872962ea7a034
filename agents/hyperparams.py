"""Hyperparameters per algorithm and scenario, in the manner of rl-zoo3's `hyperparams/*.yml`.

`HYPERPARAMS[algo]["default"]` applies to every scenario; a scenario's own entry overrides it.
Values are constructor arguments of the SB3 algorithm (`policy_kwargs` included), plus `policy`:
"MlpPolicy" or a node-scoring policy of `agents.policies`. They are
sized for a CPU budget of minutes with 64-128 clusters of 256-request episodes.
"""

from __future__ import annotations

from typing import Any

_NET = {"net_arch": [64, 64]}

HYPERPARAMS: dict[str, dict[str, dict[str, Any]]] = {
    "ppo": {
        "default": {
            "policy": "NodeScoringPolicy",
            "n_steps": 32,
            "batch_size": 512,
            "n_epochs": 8,
            "learning_rate": 5e-4,
            "gamma": 0.98,
            "gae_lambda": 0.9,
            "ent_coef": 0.01,
            "clip_range": 0.2,
            "policy_kwargs": _NET,
        },
    },
    "maskable-ppo": {
        "default": {
            "policy": "MaskableNodeScoringPolicy",
            "n_steps": 32,
            "batch_size": 512,
            "n_epochs": 8,
            "learning_rate": 5e-4,
            "gamma": 0.98,
            "gae_lambda": 0.9,
            "ent_coef": 0.01,
            "policy_kwargs": _NET,
        },
    },
    "a2c": {
        "default": {
            "policy": "NodeScoringPolicy",
            "n_steps": 16,
            "learning_rate": 7e-4,
            "gamma": 0.98,
            "gae_lambda": 0.9,
            "ent_coef": 0.01,
            "policy_kwargs": _NET,
        },
    },
    "dqn": {
        "default": {
            "learning_rate": 5e-4,
            "buffer_size": 100_000,
            "learning_starts": 2_000,
            "batch_size": 256,
            "gamma": 0.98,
            "train_freq": 4,
            "gradient_steps": 4,
            "target_update_interval": 2_000,
            "exploration_fraction": 0.3,
            "exploration_final_eps": 0.02,
            "policy_kwargs": _NET,
        },
    },
}


def hyperparams(algo: str, scenario: str) -> dict[str, Any]:
    """The constructor arguments of `algo` on `scenario` (a fresh copy)."""
    table = HYPERPARAMS[algo]
    return {**table["default"], **table.get(scenario, {})}
