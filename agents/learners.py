"""Stable-Baselines3 learners (PPO by default, A2C, DQN, and MaskablePPO from sb3-contrib, which
uses the environment's action mask), observation normalisation, a behaviour-cloning warm start,
and a wrapper that routes with a trained model."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from sb3_contrib import MaskablePPO
from stable_baselines3 import A2C, DQN, PPO
from stable_baselines3.common.base_class import BaseAlgorithm
from stable_baselines3.common.running_mean_std import RunningMeanStd
from stable_baselines3.common.utils import explained_variance, get_device
from stable_baselines3.common.vec_env import VecEnv, VecNormalize

from agents.hyperparams import load, model_kwargs
from burstgym.observation import GLOBAL_FEATURES, NODE_FEATURES

ALGOS: dict[str, type[BaseAlgorithm]] = {"ppo": PPO, "a2c": A2C, "dqn": DQN, "maskable-ppo": MaskablePPO}
JAX_ALGOS = ("jax-ppo",)  # learners written in JAX (agents.jax_ppo)
DEVICES = ("auto", "cpu", "cuda")
BC_EPOCHS, BC_BATCH = 20, 256  # warm-start optimisation (docs/agents.md, "Training set-up")


def check_algo(algo: str, sb3: bool = False) -> None:
    """Refuse an unknown algorithm name with the valid ones listed (with `sb3`, SB3's only)."""
    valid = tuple(ALGOS) if sb3 else (*ALGOS, *JAX_ALGOS)
    if algo not in valid:
        raise ValueError(f"unknown algorithm {algo!r}; valid algorithms: {', '.join(valid)}")


def check_device(device: str) -> str:
    """`device` ("auto", "cpu", "cuda" or "cuda:N") as torch will use it; refuses CUDA without a GPU."""
    if device != "auto" and device != "cpu" and not re.fullmatch(r"cuda(:\d+)?", device):
        raise ValueError(f"unknown device {device!r}; valid devices: {', '.join(DEVICES)} (or cuda:N)")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"device {device!r} asked for, but torch {torch.__version__} sees no CUDA GPU")
    return str(get_device(device))


def make_model(
    algo: str,
    env,
    scenario: str,
    seed: int,
    tensorboard_log: str | None,
    overrides: dict[str, Any] | None = None,
    device: str = "cpu",
    entry: dict[str, Any] | None = None,
) -> BaseAlgorithm:
    """A fresh `algo` model on `env` with the hyperparameters of `scenario` (`entry`, an
    `agents.hyperparams.load` entry, or the algorithm's file) and `overrides`."""
    check_algo(algo, sb3=True)
    entry = load(algo, scenario) if entry is None else entry
    kwargs = {**model_kwargs(entry), **(overrides or {})}
    if algo in ("ppo", "maskable-ppo"):
        # A batch larger than one rollout would make SB3 warn and truncate it.
        kwargs["batch_size"] = min(kwargs["batch_size"], kwargs["n_steps"] * env.num_envs)
    policy = kwargs.pop("policy", "MlpPolicy")
    return ALGOS[algo](
        policy,
        env,
        seed=seed,
        tensorboard_log=tensorboard_log,
        verbose=0,
        device=check_device(device),
        **kwargs,
    )


def load_model(path: str | Path, algo: str, env=None, device: str = "cpu") -> BaseAlgorithm:
    """Load a saved model of `algo` (a clear error if the file is missing)."""
    check_algo(algo, sb3=True)
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"checkpoint {str(path)!r} does not exist")
    return ALGOS[algo].load(path, env=env, device=check_device(device))


# ------------------------------------------------------------------------- observation normalisation


class NodePooledRunningMeanStd(RunningMeanStd):
    """Running mean and variance of an observation made of `n_nodes` rows of the same node features
    followed by global features: each node feature's statistics are pooled over the nodes, so the
    normalisation treats every node alike (the node-scoring actor stays permutation-equivariant,
    and a feature that differs between nodes but not over time, such as `capacity` in a
    heterogeneous cluster, keeps its differences instead of being normalised to 0)."""

    def __init__(self, n_nodes: int, epsilon: float = 1e-4):
        self.n_nodes, self.n_feats, self.n_global = n_nodes, len(NODE_FEATURES), len(GLOBAL_FEATURES)
        super().__init__(epsilon, shape=(n_nodes * self.n_feats + self.n_global,))
        self.node = RunningMeanStd(epsilon, shape=(self.n_feats,))
        self.glob = RunningMeanStd(epsilon, shape=(self.n_global,))

    def update(self, arr: np.ndarray) -> None:
        arr = np.asarray(arr, dtype=np.float64)
        k = self.n_nodes * self.n_feats
        self.node.update(arr[:, :k].reshape(-1, self.n_feats))
        self.glob.update(arr[:, k:])
        self._sync()

    def _sync(self) -> None:
        self.mean = np.concatenate([np.tile(self.node.mean, self.n_nodes), self.glob.mean])
        self.var = np.concatenate([np.tile(self.node.var, self.n_nodes), self.glob.var])
        self.count = self.glob.count

    def copy(self) -> NodePooledRunningMeanStd:
        out = NodePooledRunningMeanStd(self.n_nodes)
        out.node, out.glob = self.node.copy(), self.glob.copy()
        out._sync()
        return out

    def combine(self, other: NodePooledRunningMeanStd) -> None:
        self.node.combine(other.node)
        self.glob.combine(other.glob)
        self._sync()


class NodeVecNormalize(VecNormalize):
    """SB3's VecNormalize with the node features' statistics pooled over nodes
    (`NodePooledRunningMeanStd`); saved and loaded as VecNormalize is (`save`, `VecNormalize.load`)."""

    def __init__(self, venv: VecEnv, **kwargs: Any):
        super().__init__(venv, **kwargs)
        dim = int(np.prod(self.observation_space.shape))
        n_nodes, rest = divmod(dim - len(GLOBAL_FEATURES), len(NODE_FEATURES))
        if rest or n_nodes < 1:
            raise ValueError(f"observations of size {dim} are not BurstBalance observations")
        if self.norm_obs:
            self.obs_rms = NodePooledRunningMeanStd(n_nodes)


def normalize_env(env: VecEnv, kwargs: dict[str, Any] | None) -> VecEnv:
    """`env` wrapped in `NodeVecNormalize(**kwargs)`, or `env` itself when `kwargs` is None."""
    return env if kwargs is None else NodeVecNormalize(env, **kwargs)


def vecnormalize_path(model_path: str | Path) -> Path | None:
    """The normalisation statistics saved with a model, or None: `<prefix>_vecnormalize_<N>_steps.pkl`
    beside an SB3 checkpoint `<prefix>_<N>_steps.zip`, `<stem>_vecnormalize.pkl` (train.py's
    `best_model_vecnormalize.pkl`), then `vecnormalize.pkl` in the model's directory (train.py's
    final model, rl-zoo3's best model) or in `<stem>/` (rl-zoo3's final model)."""
    path = Path(model_path)
    candidates = []
    m = re.fullmatch(r"(.*)_(\d+)_steps", path.stem)
    if m:
        candidates.append(path.with_name(f"{m.group(1)}_vecnormalize_{m.group(2)}_steps.pkl"))
    candidates += [
        path.with_name(f"{path.stem}_vecnormalize.pkl"),
        path.with_name("vecnormalize.pkl"),
        path.parent / path.stem / "vecnormalize.pkl",
    ]
    return next((c for c in candidates if c.is_file()), None)


def load_normalization(path: str | Path, venv: VecEnv | None = None) -> VecNormalize:
    """Saved normalisation statistics, frozen (no updates, rewards as they are), for inference."""
    import pickle

    with open(path, "rb") as f:
        norm = pickle.load(f)
    if venv is not None:
        norm.set_venv(venv)
    norm.training = False
    norm.norm_reward = False
    return norm


# ---------------------------------------------------------------------------------------- routing


class PolicyRouter:
    """A trained model as a router with the heuristics' interface.

    :param deterministic: argmax actions (default), else sampled from the policy.
    :param normalize: the VecNormalize whose observation statistics the model was trained with
        (None: observations as they are). Only its statistics are kept (by reference, so a live
        training VecNormalize is followed as it updates; never updated here), which keeps the
        router picklable.
    """

    family = "learned"

    def __init__(
        self,
        model: BaseAlgorithm,
        name: str = "learned",
        deterministic: bool = True,
        normalize: VecNormalize | None = None,
    ):
        self.model = model
        self.name = name
        self.deterministic = deterministic
        self.masked = isinstance(model, MaskablePPO)
        self.obs_rms = normalize.obs_rms if normalize is not None and normalize.norm_obs else None
        self.clip_obs = float(normalize.clip_obs) if normalize is not None else 0.0
        self.epsilon = float(normalize.epsilon) if normalize is not None else 0.0

    @property
    def observation_shape(self) -> tuple[int, ...]:
        """The observation shape the model takes."""
        return tuple(self.model.observation_space.shape)

    def reset(self, n_envs: int) -> None:
        """Nothing to reset: the policy is a function of the observation."""

    def observe(self, obs: np.ndarray) -> np.ndarray:
        """The observations as the policy reads them (normalised as VecNormalize does, if the model
        was trained so)."""
        obs = np.asarray(obs, dtype=np.float32)
        if self.obs_rms is not None:
            scaled = (obs - self.obs_rms.mean) / np.sqrt(self.obs_rms.var + self.epsilon)
            obs = np.clip(scaled, -self.clip_obs, self.clip_obs).astype(np.float32)
        return obs

    def jax_router(self) -> Any:
        """The policy as an `agents.jax_ppo.JaxPolicyRouter` (the current weights and statistics,
        copied), so that it runs in the JAX rollout engine; None for what that network does not
        express: a policy other than `NodeScoringPolicy` (MlpPolicy, DQN, the masked policy), or
        statistics other than the node-pooled ones with VecNormalize's default epsilon and clip.
        The network is the same function; torch and XLA round differently, so its logits agree
        to float32 rounding (tests/test_jax_rollout.py), not bit for bit."""
        from agents import jax_ppo
        from agents.policies import NodeScorer

        policy = self.model.policy
        extractor = getattr(policy, "mlp_extractor", None)
        if self.masked or not isinstance(extractor, NodeScorer):
            return None
        stats = None
        if self.obs_rms is not None:
            rms = self.obs_rms
            if not isinstance(rms, NodePooledRunningMeanStd) or (self.epsilon, self.clip_obs) != (
                jax_ppo.NORM_EPS,
                jax_ppo.CLIP_OBS,
            ):
                return None
            moments = [
                jax_ppo.Moments(*(np.float32(x) for x in (m.mean, m.var, m.count)))
                for m in (rms.node, rms.glob)
            ]
            stats = jax_ppo.ObsStats(*moments)

        def dense(layer: torch.nn.Linear) -> dict[str, np.ndarray]:
            w = layer.weight.detach().cpu().numpy().astype(np.float32)
            return {"kernel": w.T.copy(), "bias": layer.bias.detach().cpu().numpy().astype(np.float32)}

        score, value = extractor.score, extractor.value
        params = {
            "params": {
                "score_0": dense(score[0]),
                "score_1": dense(score[2]),
                "score_out": dense(score[4]),
                "value_0": dense(value[0]),
                "value_1": dense(value[2]),
                "value_out": dense(policy.value_net),
            }
        }
        hidden = int(score[0].out_features)
        n_nodes = extractor.n_nodes
        return jax_ppo.JaxPolicyRouter(params, stats, n_nodes, hidden, self.name, self.deterministic)

    def __call__(self, obs: np.ndarray, mask: np.ndarray | None = None, view: Any = None) -> np.ndarray:
        """Actions for a batch of observations (`view`, the heuristics' input, is not used)."""
        kwargs = {"action_masks": mask} if self.masked and mask is not None else {}
        actions, _ = self.model.predict(self.observe(obs), deterministic=self.deterministic, **kwargs)
        return np.asarray(actions, dtype=np.int64)


def load_router(
    path: str | Path,
    algo: str,
    name: str = "learned",
    device: str = "cpu",
    deterministic: bool = True,
    require_normalization: bool = False,
) -> Any:
    """A saved model as a router, with the normalisation statistics saved beside it
    (`vecnormalize_path`); `require_normalization` refuses a model whose statistics are missing.
    A jax-ppo checkpoint holds its statistics (`agents.jax_ppo.JaxPolicyRouter`)."""
    check_algo(algo)
    if algo in JAX_ALGOS:
        from agents.jax_ppo import JaxPolicyRouter

        router = JaxPolicyRouter.load(path, name, deterministic=deterministic)
        if router.stats is None and require_normalization:
            raise ValueError(
                f"model {str(path)!r} was trained on normalised observations but holds no statistics"
            )
        return router
    model = load_model(path, algo, device=device)
    stats = vecnormalize_path(path)
    if stats is None and require_normalization:
        raise FileNotFoundError(
            f"model {str(path)!r} was trained on normalised observations but no statistics "
            "(vecnormalize.pkl) lie beside it"
        )
    norm = load_normalization(stats) if stats is not None else None
    return PolicyRouter(model, name, deterministic=deterministic, normalize=norm)


# ------------------------------------------------------------------------------ behaviour cloning


def _returns(rewards, dones, bootstrap, last_value, gamma) -> np.ndarray:
    """Discounted returns [T, B] of a rollout: `bootstrap[t]` is added (discounted) where an episode
    was truncated at step t, `last_value` continues the episodes still running at the end."""
    out = np.zeros_like(rewards)
    future = last_value
    for t in range(len(rewards) - 1, -1, -1):
        future = rewards[t] + gamma * (np.where(dones[t], bootstrap[t], future))
        out[t] = future
    return out


@dataclass
class TeacherData:
    """A heuristic's rollout on a vector env, time-major ([T, B, ...]); observations raw."""

    obs: np.ndarray  # [T, B, D]
    actions: np.ndarray  # [T, B]
    rewards: np.ndarray  # [T, B] (unnormalised)
    dones: np.ndarray  # [T, B]
    truncated: np.ndarray  # [T, B] episode ended by truncation (bootstrap from terminal_obs)
    terminal_obs: np.ndarray  # [T, B, D] raw terminal observation where truncated
    last_obs: np.ndarray  # [B, D] the observation after the last step


def collect_teacher(env, teacher, steps: int) -> TeacherData:
    """`teacher`'s rollout on `env` for `steps` environment steps (a VecNormalize `env` keeps
    updating its statistics; raw observations and rewards are kept)."""
    norm = env if isinstance(env, VecNormalize) else None

    def raw(obs):
        return norm.get_original_obs() if norm is not None else obs

    obs = raw(env.reset())
    teacher.reset(env.num_envs)
    xs, ys, rs, ds, cuts, terms = [], [], [], [], [], []
    for _ in range(max(steps // env.num_envs, 1)):
        actions = teacher(obs, env.action_masks(), env.router_views())
        xs.append(obs)
        ys.append(np.asarray(actions))
        new_obs, reward, done, infos = env.step(actions)
        rs.append(norm.get_original_reward() if norm is not None else reward)
        ds.append(done)
        term = np.zeros_like(obs)
        cut = np.zeros(env.num_envs, dtype=bool)
        for i in np.flatnonzero(done):
            if infos[i].get("TimeLimit.truncated"):
                cut[i] = True
                t_obs = infos[i]["terminal_observation"]  # VecNormalize normalised it in place
                term[i] = norm.unnormalize_obs(t_obs) if norm is not None else t_obs
        cuts.append(cut)
        terms.append(term)
        obs = raw(new_obs)
    return TeacherData(
        np.stack(xs),
        np.stack(ys),
        np.stack(rs).astype(np.float64),
        np.stack(ds),
        np.stack(cuts),
        np.stack(terms),
        np.asarray(obs),
    )


def fit_warm_start(
    model: BaseAlgorithm,
    data: TeacherData,
    normalize: VecNormalize | None = None,
    epochs: int = BC_EPOCHS,
    batch_size: int = BC_BATCH,
    critic: bool = True,
    lr: float = 1e-3,
) -> dict[str, float]:
    """Fit `model`'s actor (cross-entropy on the teacher's actions) and, with `critic`, its value
    head (regression on discounted returns, `model.gamma`) to `data`; observations normalised by
    `normalize`'s statistics. Returns are bootstrapped from the critic where the data stop before
    the episode does (the end of the rollout, a truncated episode) and recomputed every epoch."""
    policy, device = model.policy, model.device
    gamma = float(getattr(model, "gamma", 0.99))
    dim = data.obs.shape[-1]

    def observe(a: np.ndarray) -> torch.Tensor:
        a = a.reshape(-1, dim)
        a = normalize.normalize_obs(a) if normalize is not None else a
        return torch.as_tensor(np.asarray(a, dtype=np.float32), device=device)

    x = observe(data.obs)
    y = torch.as_tensor(data.actions.reshape(-1), dtype=torch.long, device=device)
    cut_obs, last_obs = observe(data.terminal_obs), observe(data.last_obs)

    def values(t: torch.Tensor) -> np.ndarray:
        with torch.no_grad():
            return policy.predict_values(t).squeeze(-1).double().cpu().numpy()

    def targets() -> torch.Tensor:
        bootstrap = np.where(data.truncated, values(cut_obs).reshape(data.truncated.shape), 0.0)
        g = _returns(data.rewards, data.dones, bootstrap, values(last_obs), gamma)
        return torch.as_tensor(g.reshape(-1), dtype=torch.float32, device=device)

    def ev() -> float:
        return float(explained_variance(values(x), targets().cpu().numpy().astype(np.float64)))

    ev0 = ev()
    optimizer = torch.optim.Adam(policy.parameters(), lr=lr)
    for _ in range(epochs):
        returns = targets() if critic else None
        for idx in torch.randperm(len(x), device=device).split(batch_size):
            loss = -policy.get_distribution(x[idx]).log_prob(y[idx]).mean()
            if critic:
                value = policy.predict_values(x[idx]).squeeze(-1)
                loss = loss + torch.nn.functional.mse_loss(value, returns[idx])
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    with torch.no_grad():
        agree = (policy.get_distribution(x).distribution.probs.argmax(dim=1) == y).float().mean()
    return {
        "agreement": float(agree),
        "value_explained_variance": ev(),
        "value_explained_variance_initial": ev0,
        "samples": int(len(x)),
    }


def behaviour_clone(
    model: BaseAlgorithm,
    env,
    teacher,
    steps: int,
    epochs: int = BC_EPOCHS,
    batch_size: int = BC_BATCH,
    critic: bool = True,
) -> dict[str, float]:
    """Warm-start an actor-critic `model` on the heuristic `teacher`'s rollouts on `env` for
    `steps` environment steps (`collect_teacher`, then `fit_warm_start`): the actor by
    cross-entropy on the teacher's actions and, with `critic`, the value head by regression on the
    discounted returns of those rollouts. With a VecNormalize `env`, statistics are gathered during
    the collection and every observation is normalised with the final ones.

    Returns {"agreement": fraction of the teacher's actions the actor takes (argmax),
    "value_explained_variance": the critic's explained variance of the returns (as SB3's
    `train/explained_variance`, on the imitation data), "value_explained_variance_initial": the
    same before the warm start, "samples": the number of observations}."""
    if not hasattr(model.policy, "get_distribution"):
        raise ValueError(f"behaviour cloning needs an actor-critic policy, not {type(model.policy).__name__}")
    data = collect_teacher(env, teacher, steps)
    norm = env if isinstance(env, VecNormalize) else None
    return fit_warm_start(model, data, norm, epochs=epochs, batch_size=batch_size, critic=critic)
