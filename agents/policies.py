"""A permutation-equivariant actor for routing: one small network scores every node from that
node's features plus the global features, and the scores are the action logits. Sharing the
scorer across nodes means each decision teaches it about every node, and a node's index carries
no meaning of its own (as in llm-d/AIBrix scorers, but learned). The critic is a plain MLP.

Use it with `policy: agents.policies.NodeScoringPolicy` in `agents/hyperparams.yml` (PPO, A2C;
`MaskableNodeScoringPolicy` for MaskablePPO); rl-zoo3 imports the dotted path.

Initialisation follows SB3's (`ortho_init=True`): orthogonal weights, zero biases, gain sqrt(2) on
hidden layers, 1 on the value head, and 0.01 on the actor's output layer, which here is the
scorer's last layer (SB3 would otherwise give it the hidden gain, sqrt(2), since it sits in the
extractor, and start from nearly deterministic logits).
"""

from __future__ import annotations

import torch
from sb3_contrib.common.maskable.policies import MaskableActorCriticPolicy
from stable_baselines3.common.policies import ActorCriticPolicy
from torch import nn

from burstgym.observation import GLOBAL_FEATURES, NODE_FEATURES


def _mlp(inputs: int, hidden: int, outputs: int) -> nn.Sequential:
    return nn.Sequential(
        nn.Linear(inputs, hidden), nn.Tanh(), nn.Linear(hidden, hidden), nn.Tanh(), nn.Linear(hidden, outputs)
    )


class NodeScorer(nn.Module):
    """SB3 `mlp_extractor`: latent_pi is one score per node, latent_vf a hidden vector."""

    def __init__(self, n_nodes: int, hidden: int = 64):
        super().__init__()
        self.n_nodes = n_nodes
        self.n_feats = len(NODE_FEATURES)
        self.latent_dim_pi = n_nodes
        self.latent_dim_vf = hidden
        self.score = _mlp(self.n_feats + len(GLOBAL_FEATURES), hidden, 1)  # score[-1]: the actor's head
        obs_dim = n_nodes * self.n_feats + len(GLOBAL_FEATURES)
        self.value = nn.Sequential(
            nn.Linear(obs_dim, hidden), nn.Tanh(), nn.Linear(hidden, hidden), nn.Tanh()
        )

    def forward_actor(self, obs: torch.Tensor) -> torch.Tensor:
        nodes = obs[:, : self.n_nodes * self.n_feats].reshape(-1, self.n_nodes, self.n_feats)
        glob = obs[:, self.n_nodes * self.n_feats :].unsqueeze(1).expand(-1, self.n_nodes, -1)
        return self.score(torch.cat([nodes, glob], dim=-1)).squeeze(-1)

    def forward_critic(self, obs: torch.Tensor) -> torch.Tensor:
        return self.value(obs)

    def forward(self, obs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.forward_actor(obs), self.forward_critic(obs)


class _NodeScoring:
    """Mixin: the node scorer as extractor, and its scores used directly as the logits."""

    def _build_mlp_extractor(self) -> None:
        self.mlp_extractor = NodeScorer(int(self.action_space.n), **self.net_arch_kwargs())

    def net_arch_kwargs(self) -> dict:
        arch = self.net_arch if isinstance(self.net_arch, list) and self.net_arch else [64]
        return {"hidden": int(arch[0])}

    @property
    def actor_head(self) -> nn.Linear:
        """The layer whose outputs are the logits (one score per node)."""
        return self.mlp_extractor.score[-1]

    def _build(self, lr_schedule) -> None:
        super()._build(lr_schedule)
        self.action_net = nn.Identity()
        if self.ortho_init:  # SB3's action-head gain on the layer that now produces the logits
            self.init_weights(self.actor_head, gain=0.01)
        self.optimizer = self.optimizer_class(self.parameters(), lr=lr_schedule(1), **self.optimizer_kwargs)


class NodeScoringPolicy(_NodeScoring, ActorCriticPolicy):
    """PPO / A2C policy with the node-scoring actor."""


class MaskableNodeScoringPolicy(_NodeScoring, MaskableActorCriticPolicy):
    """MaskablePPO policy with the node-scoring actor."""
