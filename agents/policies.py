"""SB3 policies with the node-scoring actor-critic (`agents.model`): its layers held as torch
parameters, its forward pass the shared one, its initialisation the shared one.

Use it with `policy: agents.policies.NodeScoringPolicy` in `agents/hyperparams.yml` (PPO, A2C;
`MaskableNodeScoringPolicy` for MaskablePPO); rl-zoo3 imports the dotted path.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
import torch
from sb3_contrib.common.maskable.policies import MaskableActorCriticPolicy
from stable_baselines3.common.policies import ActorCriticPolicy
from torch import nn

from agents import model

# state-dict names of models saved before the network was shared (train.py runs before 2026-12)
_OLD_NAMES = {
    "mlp_extractor.score.0.": "mlp_extractor.layers.score_0.",
    "mlp_extractor.score.2.": "mlp_extractor.layers.score_1.",
    "mlp_extractor.score.4.": "mlp_extractor.layers.score_out.",
    "mlp_extractor.value.0.": "mlp_extractor.layers.value_0.",
    "mlp_extractor.value.2.": "mlp_extractor.layers.value_1.",
    "value_net.": "mlp_extractor.layers.value_out.",
}


class NodeScorer(nn.Module):
    """SB3 `mlp_extractor`: the layers of `agents.model` (torch `Linear`s, read as the shared
    layout, kernel = weight.T); latent_pi is the logits, latent_vf the value."""

    def __init__(self, n_nodes: int, hidden: int = 64):
        super().__init__()
        self.n_nodes = n_nodes
        self.latent_dim_pi = n_nodes
        self.latent_dim_vf = 1
        self.layers = nn.ModuleDict(
            {name: nn.Linear(i, o) for name, (i, o) in model.shapes(n_nodes, hidden).items()}
        )

    def params(self) -> dict[str, dict[str, torch.Tensor]]:
        """The parameters in `agents.model`'s layout (views of the torch parameters)."""
        return {name: {"kernel": layer.weight.T, "bias": layer.bias} for name, layer in self.layers.items()}

    def numpy_params(self) -> dict[str, dict[str, np.ndarray]]:
        """A float32 NumPy copy of the parameters, in `agents.model`'s layout."""
        return {
            name: {k: v.detach().cpu().numpy().astype(np.float32, copy=True) for k, v in layer.items()}
            for name, layer in self.params().items()
        }

    def load_params(self, params: model.Params) -> None:
        """Copy `params` (`agents.model`'s layout, arrays of any library) into the layers."""
        with torch.no_grad():
            for name, layer in self.layers.items():
                layer.weight.copy_(torch.from_numpy(np.array(params[name]["kernel"]).T))
                layer.bias.copy_(torch.from_numpy(np.array(params[name]["bias"])))

    def forward_actor(self, obs: torch.Tensor) -> torch.Tensor:
        return model.logits(self.params(), obs)

    def forward_critic(self, obs: torch.Tensor) -> torch.Tensor:
        return model.value(self.params(), obs)[:, None]

    def forward(self, obs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.forward_actor(obs), self.forward_critic(obs)


class _NodeScoring:
    """Mixin: the node scorer as extractor, its outputs used directly as logits and value."""

    def _build_mlp_extractor(self) -> None:
        self.mlp_extractor = NodeScorer(int(self.action_space.n), **self.net_arch_kwargs())

    def net_arch_kwargs(self) -> dict:
        arch = self.net_arch if isinstance(self.net_arch, list) and self.net_arch else [64]
        return {"hidden": int(arch[0])}

    @property
    def actor_head(self) -> nn.Linear:
        """The layer whose outputs are the logits (one score per node)."""
        return self.mlp_extractor.layers["score_out"]

    def _build(self, lr_schedule: Any) -> None:
        """SB3's `_build` with the extractor's outputs as logits and value, and, with `ortho_init`,
        `agents.model.init` (seeded from torch's generator, which SB3 seeds) in place of SB3's."""
        self._build_mlp_extractor()
        self.action_net, self.value_net = nn.Identity(), nn.Identity()
        if self.ortho_init:
            seed = int(torch.randint(2**31 - 1, ()))
            hidden = self.net_arch_kwargs()["hidden"]
            self.mlp_extractor.load_params(
                model.init(jax.random.key(seed), self.mlp_extractor.n_nodes, hidden)
            )
        self.optimizer = self.optimizer_class(self.parameters(), lr=lr_schedule(1), **self.optimizer_kwargs)

    def _load_from_state_dict(self, state_dict: dict[str, Any], prefix: str, *args: Any) -> None:
        """Read models saved with the earlier layer names (`_OLD_NAMES`) too."""
        for key in [k for k in state_dict if k.startswith(prefix)]:
            for old, new in _OLD_NAMES.items():
                if key.startswith(prefix + old):
                    state_dict[prefix + new + key[len(prefix + old) :]] = state_dict.pop(key)
        super()._load_from_state_dict(state_dict, prefix, *args)


class NodeScoringPolicy(_NodeScoring, ActorCriticPolicy):
    """PPO / A2C policy with the node-scoring actor-critic."""


class MaskableNodeScoringPolicy(_NodeScoring, MaskableActorCriticPolicy):
    """MaskablePPO policy with the node-scoring actor-critic."""


NODE_SCORING = tuple(
    f"{c.__module__}.{c.__qualname__}" for c in (NodeScoringPolicy, MaskableNodeScoringPolicy)
)
