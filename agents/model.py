"""The node-scoring actor-critic both learners train, defined once: its parameters, their
initialisation, the forward pass and the observation statistics it reads, written against the
array API (`array_api_compat`) so that SB3's policy (`agents.policies`, torch tensors) and the JAX
learner (`agents.jax_ppo`, jax arrays) call the same functions on the same parameters.

Actor: one MLP scores every node from that node's features and the global features, and the
scores are the action logits. Sharing the scorer across nodes means each decision teaches it about
every node, and a node's index carries no meaning of its own (as in llm-d/AIBrix scorers, but
learned). Critic: an MLP on the whole observation. Tanh activations.

Parameters: `{layer: {"kernel": [inputs, outputs], "bias": [outputs]}}` for the layers of
`LAYERS`. Initialisation follows SB3's `ortho_init`: orthogonal kernels, zero biases, gain
sqrt(2) on hidden layers, 1 on the value head, and 0.01 on the actor's output layer, which here is
the scorer's last layer (near-uniform logits at the start).

Observations are normalised as SB3's VecNormalize does, with one change: each node feature's
statistics are pooled over the nodes (`ObsStats`), so the normalisation treats every node alike
(the actor stays permutation-equivariant, and a feature that differs between nodes but not over
time, such as `capacity` in a heterogeneous cluster, keeps its differences instead of being
normalised to 0). SB3's side is `agents.learners.NodeVecNormalize`; the JAX learner carries an
`ObsStats` of jax arrays through its jitted updates.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from array_api_compat import array_namespace

from burstgym.observation import GLOBAL_FEATURES, NODE_FEATURES

NORM_EPS, CLIP_OBS = 1e-8, 10.0  # VecNormalize's defaults
STATS_EPS = 1e-4  # RunningMeanStd's initial count

Params = Mapping[str, Mapping[str, Any]]  # layer name -> {"kernel", "bias"}, arrays of one library

# layer -> gain of its orthogonal initialisation; the order is the parameters' order everywhere
GAINS = {
    "score_0": math.sqrt(2),
    "score_1": math.sqrt(2),
    "score_out": 0.01,  # the actor's head: its outputs are the logits
    "value_0": math.sqrt(2),
    "value_1": math.sqrt(2),
    "value_out": 1.0,
}
LAYERS = tuple(GAINS)


def n_nodes_of(obs_size: int) -> int:
    """The cluster size of an observation of `obs_size` values (`burstgym.observation.observe`'s
    layout: N rows of node features, then the global features); refuses any other size."""
    n, rest = divmod(obs_size - len(GLOBAL_FEATURES), len(NODE_FEATURES))
    if rest or n < 1:
        raise ValueError(f"observations of size {obs_size} are not BurstBalance observations")
    return n


def shapes(n_nodes: int, hidden: int) -> dict[str, tuple[int, int]]:
    """(inputs, outputs) of each layer for `n_nodes` nodes and hidden layers `hidden` wide."""
    f, g = len(NODE_FEATURES), len(GLOBAL_FEATURES)
    return {
        "score_0": (f + g, hidden),
        "score_1": (hidden, hidden),
        "score_out": (hidden, 1),
        "value_0": (n_nodes * f + g, hidden),
        "value_1": (hidden, hidden),
        "value_out": (hidden, 1),
    }


def init(key: jax.Array, n_nodes: int, hidden: int) -> dict[str, dict[str, np.ndarray]]:
    """Fresh parameters (float32 NumPy arrays, to load into either library) from the PRNG `key`:
    orthogonal kernels with the gains of `GAINS` (jax's orthogonal initialiser), zero biases."""
    keys = jax.random.split(key, len(LAYERS))
    out = {}
    for k, (name, (inputs, outputs)) in zip(keys, shapes(n_nodes, hidden).items(), strict=True):
        kernel = jax.nn.initializers.orthogonal(GAINS[name])(k, (inputs, outputs), jnp.float32)
        out[name] = {"kernel": np.array(kernel), "bias": np.zeros(outputs, np.float32)}
    return out


def _dense(layer: Mapping[str, Any], x: Any) -> Any:
    return x @ layer["kernel"] + layer["bias"]


def logits(params: Params, obs: Any) -> Any:
    """One score per node [..., N] of observations [..., N * F + G]: the actor's logits."""
    xp = array_namespace(obs)
    n = n_nodes_of(obs.shape[-1])
    k = n * len(NODE_FEATURES)
    nodes = xp.reshape(obs[..., :k], (*obs.shape[:-1], n, len(NODE_FEATURES)))
    glob = xp.broadcast_to(obs[..., None, k:], (*obs.shape[:-1], n, obs.shape[-1] - k))
    h = xp.tanh(_dense(params["score_0"], xp.concat([nodes, glob], axis=-1)))
    h = xp.tanh(_dense(params["score_1"], h))
    return _dense(params["score_out"], h)[..., 0]


def value(params: Params, obs: Any) -> Any:
    """The critic's value [...] of observations [..., D]."""
    xp = array_namespace(obs)
    v = xp.tanh(_dense(params["value_0"], obs))
    v = xp.tanh(_dense(params["value_1"], v))
    return _dense(params["value_out"], v)[..., 0]


def forward(params: Params, obs: Any) -> tuple[Any, Any]:
    """(logits, value) of observations [..., D]."""
    return logits(params, obs), value(params, obs)


# ----------------------------------------------------------------------- observation statistics


def normalize(obs: Any, mean: Any, var: Any, epsilon: float = NORM_EPS, clip: float = CLIP_OBS) -> Any:
    """(obs - mean) / sqrt(var + epsilon), clipped to +-clip: VecNormalize's rule."""
    xp = array_namespace(obs)  # the statistics may be another library's (NumPy's): obs decides
    return xp.clip((obs - mean) / xp.sqrt(var + epsilon), -clip, clip)


class Moments(NamedTuple):
    """Running mean, variance and count of a set of features (SB3's RunningMeanStd, as arrays of
    any array-API library: NumPy float64 for SB3, jax float32 inside the JAX learner's jit)."""

    mean: Any
    var: Any
    count: Any

    @staticmethod
    def empty(dim: int, xp: Any = jnp, dtype: Any = jnp.float32) -> Moments:
        """No data yet: mean 0, variance 1, count `STATS_EPS`."""
        return Moments(
            xp.zeros(dim, dtype=dtype), xp.ones(dim, dtype=dtype), xp.asarray(STATS_EPS, dtype=dtype)
        )

    def merge(self, mean: Any, var: Any, count: Any) -> Moments:
        """These moments merged with those of other data (parallel variance, as
        RunningMeanStd.update_from_moments)."""
        delta, total = mean - self.mean, self.count + count
        m2 = self.var * self.count + var * count + delta**2 * self.count * count / total
        return Moments(self.mean + delta * count / total, m2 / total, total)

    def update(self, x: Any) -> Moments:
        """These moments merged with the rows of `x` [M, dim]."""
        xp = array_namespace(x)
        return self.merge(xp.mean(x, axis=0), xp.var(x, axis=0), x.shape[0])


class ObsStats(NamedTuple):
    """Observation statistics with each node feature pooled over the nodes (module docstring)."""

    node: Moments
    glob: Moments

    @staticmethod
    def empty(xp: Any = jnp, dtype: Any = jnp.float32) -> ObsStats:
        """No data yet (`Moments.empty`)."""
        return ObsStats(
            Moments.empty(len(NODE_FEATURES), xp, dtype), Moments.empty(len(GLOBAL_FEATURES), xp, dtype)
        )

    def update(self, obs: Any) -> ObsStats:
        """These statistics with the observations `obs` [..., D] taken in."""
        xp = array_namespace(obs)
        obs = xp.reshape(obs, (-1, obs.shape[-1]))
        k = n_nodes_of(obs.shape[-1]) * len(NODE_FEATURES)
        node = self.node.update(xp.reshape(obs[:, :k], (-1, len(NODE_FEATURES))))
        return ObsStats(node, self.glob.update(obs[:, k:]))

    def mean_var(self, n_nodes: int) -> tuple[Any, Any]:
        """Mean and variance of each value of an `n_nodes`-node observation."""
        xp = array_namespace(self.node.mean)
        return tuple(
            xp.concat([xp.tile(a, (n_nodes,)), b]) for a, b in zip(self.node[:2], self.glob[:2], strict=True)
        )

    def normalize(self, obs: Any, epsilon: float = NORM_EPS, clip: float = CLIP_OBS) -> Any:
        """Observations [..., D] normalised by these statistics (`normalize`)."""
        mean, var = self.mean_var(n_nodes_of(obs.shape[-1]))
        return normalize(obs, mean, var, epsilon, clip)
