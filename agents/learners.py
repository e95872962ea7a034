"""Stable-Baselines3 learners (PPO by default, A2C, DQN, and MaskablePPO from sb3-contrib, which
uses the environment's action mask) and a wrapper that routes with a trained model."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch
from sb3_contrib import MaskablePPO
from stable_baselines3 import A2C, DQN, PPO
from stable_baselines3.common.base_class import BaseAlgorithm

from agents.hyperparams import hyperparams
from agents.policies import MaskableNodeScoringPolicy, NodeScoringPolicy

ALGOS: dict[str, type[BaseAlgorithm]] = {"ppo": PPO, "a2c": A2C, "dqn": DQN, "maskable-ppo": MaskablePPO}
POLICIES = {"NodeScoringPolicy": NodeScoringPolicy, "MaskableNodeScoringPolicy": MaskableNodeScoringPolicy}


def check_algo(algo: str) -> None:
    """Refuse an unknown algorithm name with the valid ones listed."""
    if algo not in ALGOS:
        raise ValueError(f"unknown algorithm {algo!r}; valid algorithms: {', '.join(ALGOS)}")


def make_model(
    algo: str,
    env,
    scenario: str,
    seed: int,
    tensorboard_log: str | None,
    overrides: dict[str, Any] | None = None,
) -> BaseAlgorithm:
    """A fresh `algo` model on `env` with the hyperparameters of `scenario` (and `overrides`)."""
    check_algo(algo)
    kwargs = {**hyperparams(algo, scenario), **(overrides or {})}
    if algo in ("ppo", "maskable-ppo"):
        # A batch larger than one rollout would make SB3 warn and truncate it.
        kwargs["batch_size"] = min(kwargs["batch_size"], kwargs["n_steps"] * env.num_envs)
    policy = kwargs.pop("policy", "MlpPolicy")
    return ALGOS[algo](
        POLICIES.get(policy, policy),
        env,
        seed=seed,
        tensorboard_log=tensorboard_log,
        verbose=0,
        device="cpu",
        **kwargs,
    )


def load_model(path: str | Path, algo: str, env=None) -> BaseAlgorithm:
    """Load a saved model of `algo` (a clear error if the file is missing)."""
    check_algo(algo)
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"checkpoint {str(path)!r} does not exist")
    return ALGOS[algo].load(path, env=env, device="cpu")


class PolicyRouter:
    """A trained model as a router with the heuristics' interface (deterministic actions)."""

    balancing = False

    def __init__(self, model: BaseAlgorithm, name: str = "learned"):
        self.model = model
        self.name = name
        self.masked = isinstance(model, MaskablePPO)

    def reset(self, n_envs: int) -> None:
        """Nothing to reset: the policy is a function of the observation."""

    def __call__(self, obs: np.ndarray, mask: np.ndarray | None = None, view: Any = None) -> np.ndarray:
        """Actions for a batch of observations (`view`, the heuristics' input, is not used)."""
        kwargs = {"action_masks": mask} if self.masked and mask is not None else {}
        actions, _ = self.model.predict(np.asarray(obs, dtype=np.float32), deterministic=True, **kwargs)
        return np.asarray(actions, dtype=np.int64)


def behaviour_clone(
    model: BaseAlgorithm, env, teacher, steps: int, epochs: int = 4, batch_size: int = 1024
) -> float:
    """Warm-start an actor-critic `model` by imitating the heuristic `teacher` on `env` for `steps`
    environment steps (cross-entropy on the teacher's actions); returns the final agreement."""
    if not hasattr(model.policy, "get_distribution"):
        raise ValueError(f"behaviour cloning needs an actor-critic policy, not {type(model.policy).__name__}")
    obs = env.reset()
    teacher.reset(env.num_envs)
    xs, ys = [], []
    for _ in range(max(steps // env.num_envs, 1)):
        actions = teacher(obs, env.action_masks(), env.router_views())
        xs.append(obs)
        ys.append(actions)
        obs, _, _, _ = env.step(actions)
    x = torch.as_tensor(np.concatenate(xs), dtype=torch.float32)
    y = torch.as_tensor(np.concatenate(ys), dtype=torch.long)
    policy = model.policy
    optimizer = torch.optim.Adam(policy.parameters(), lr=1e-3)
    for _ in range(epochs):
        for idx in torch.randperm(len(x)).split(batch_size):
            loss = -policy.get_distribution(x[idx]).log_prob(y[idx]).mean()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    with torch.no_grad():
        agree = (policy.get_distribution(x).distribution.probs.argmax(dim=1) == y).float().mean()
    return float(agree)
