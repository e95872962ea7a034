"""Stable-Baselines3 learners (PPO by default, A2C, DQN, and MaskablePPO from sb3-contrib, which
uses the environment's action mask), observation normalisation, a behaviour-cloning warm start,
and a wrapper that routes with a trained model."""

from __future__ import annotations

import io
import json
import math
import pickle
import re
import zipfile
import zlib
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
    """A fresh `algo` model to train on `env` with the hyperparameters of `scenario` (`entry`, an
    `agents.hyperparams.load` entry, or the algorithm's file) and `overrides` (`build_model`)."""
    entry = load(algo, scenario) if entry is None else entry
    return build_model(
        algo,
        {**entry, **(overrides or {})},
        env=env,
        device=device,
        trusted=True,
        seed=seed,
        tensorboard_log=tensorboard_log,
    )


PICKLE_HINT = "pass allow_pickle=True (--allow-pickle) only for a file you trust: unpickling can run any code"


def read_sb3_zip(path: str | Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """(data, state dicts) of an SB3 model file, read without unpickling anything.

    An SB3 `.zip` holds `data` (JSON; entries JSON cannot express are cloudpickled inside it) and
    torch files (`policy.pth`, `policy.optimizer.pth`, `pytorch_variables.pth`). `data` keeps only
    its plain JSON entries (the cloudpickled ones are dropped, never decoded); each `.pth` is read
    with `torch.load(weights_only=True)`, which refuses anything but tensors and plain containers.
    A truncated or foreign file, or one that holds code, is refused in one line naming it."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"checkpoint {str(path)!r} does not exist")
    try:
        with zipfile.ZipFile(path) as archive:
            names = archive.namelist()
            if "data" not in names or "policy.pth" not in names:
                raise ValueError(
                    f"{path}: not a readable SB3 model file (no data or policy.pth inside: truncated, "
                    "damaged or not SB3's)"
                )
            raw = json.loads(archive.read("data"))
            states = {}
            for name in names:
                if name.endswith(".pth"):
                    buffer = io.BytesIO(archive.read(name))
                    try:
                        states[name[: -len(".pth")]] = torch.load(
                            buffer, map_location="cpu", weights_only=True
                        )
                    except pickle.UnpicklingError:
                        raise ValueError(
                            f"{path}: {name} holds objects other than tensors, which could run code when "
                            f"unpickled; not loaded ({PICKLE_HINT})"
                        ) from None
    except (zipfile.BadZipFile, EOFError, zlib.error, json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(
            f"{path}: not a readable SB3 model file (truncated or damaged: {_line(e)})"
        ) from None
    except RuntimeError as e:  # torch's reader of a damaged .pth
        raise ValueError(f"{path}: not a readable SB3 model file ({_line(e)})") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{path}: not an SB3 model file (its data is not a JSON object)")
    data = {k: v for k, v in raw.items() if not (isinstance(v, dict) and ":serialized:" in v)}
    return data, states


def _line(error: BaseException) -> str:
    """The first line of an exception's message."""
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def build_model(
    algo: str,
    entry: dict[str, Any],
    n_nodes: int | None = None,
    env=None,
    device: str = "cpu",
    trusted: bool = False,
    **extra: Any,
) -> BaseAlgorithm:
    """A fresh `algo` model with the hyperparameters `entry`, on `env` (to train) or on none, for
    `n_nodes` nodes (to act, or to take weights); `extra` goes to the constructor (`seed`,
    `tensorboard_log`). Untrusted entries (a model's run configuration) import only
    `agents.policies` and evaluate nothing (`agents.hyperparams.model_kwargs`)."""
    from burstgym.gym_env import spaces

    check_algo(algo, sb3=True)
    kwargs = {**model_kwargs(entry, trusted=trusted), **extra}
    policy = kwargs.pop("policy", "MlpPolicy")
    if env is not None:
        if algo in ("ppo", "maskable-ppo"):  # a batch larger than one rollout: SB3 warns and truncates
            kwargs["batch_size"] = min(
                kwargs.get("batch_size", 64), kwargs.get("n_steps", 2048) * env.num_envs
            )
        return ALGOS[algo](policy, env, verbose=0, device=check_device(device), **kwargs)
    if n_nodes is None:
        raise ValueError("build_model needs env or n_nodes")
    model = ALGOS[algo](
        policy, None, verbose=0, device=check_device(device), _init_setup_model=False, **kwargs
    )
    model.observation_space, model.action_space = spaces(n_nodes)
    model.n_envs = 1
    model._setup_model()
    return model


def load_model(
    path: str | Path,
    algo: str,
    env=None,
    device: str = "cpu",
    config: dict[str, Any] | None = None,
    allow_pickle: bool = False,
) -> BaseAlgorithm:
    """Load a saved SB3 model of `algo` without running code from the file: the network is rebuilt
    from its run's `config.json` (`config`, else the one `agents.runs.find_config` finds) and
    the weights and optimiser state are read as tensors (`read_sb3_zip`); the step count comes
    with them. `allow_pickle=True` loads with SB3's own loader instead (which unpickles, so it can
    run code): the way to load a model with no burstgym run configuration, such as rl-zoo3's."""
    from agents import runs

    check_algo(algo, sb3=True)
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"checkpoint {str(path)!r} does not exist")
    if allow_pickle:
        try:
            return ALGOS[algo].load(path, env=env, device=check_device(device))
        except (zipfile.BadZipFile, EOFError, KeyError, AssertionError, pickle.UnpicklingError) as e:
            raise ValueError(f"{path}: not a readable SB3 model file ({_line(e)})") from None
    data, states = read_sb3_zip(path)
    where = runs.run_dir_of(path) / runs.CONFIG
    if config is None:
        found = runs.find_config(path)
        if found is None:
            raise ValueError(
                f"{path}: no {runs.CONFIG} of a burstgym run beside it, so its network cannot be rebuilt "
                f"without unpickling the file; {PICKLE_HINT}"
            )
        where, config = found
    runs.require(config, where, "algo", "scenario", "settings", "hyperparams")
    if config["algo"] != algo:
        raise ValueError(f"{path}: trained with {config['algo']!r} ({where}), not {algo!r}")
    n_nodes = _n_nodes(config, where)
    try:
        model = build_model(algo, config["hyperparams"], n_nodes, env=env, device=device)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{where}: hyperparams: {_line(e)}") from None
    extra = {k: v for k, v in states.pop("pytorch_variables", {}).items()}
    if extra:
        raise ValueError(f"{path}: torch variables {sorted(extra)} are not supported for {algo}")
    try:
        model.set_parameters(states, exact_match=True, device=model.device)
    except (RuntimeError, ValueError, KeyError) as e:
        raise ValueError(f"{path}: the weights do not fit the network of {where} ({_line(e)})") from None
    for key in ("num_timesteps", "_n_updates"):
        value = data.get(key, 0)
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"{path}: data entry {key!r} is not a step count: {value!r}")
        setattr(model, key, value)
    return model


def _n_nodes(config: dict[str, Any], where: Path) -> int:
    """The cluster size of a run configuration, its settings validated as the scenario's."""
    from burstgym import scenarios

    if not isinstance(config["settings"], dict) or not isinstance(config["scenario"], str):
        raise ValueError(f"{where}: 'scenario' must be a name and 'settings' a mapping")
    try:
        return scenarios.settings_for(config["scenario"], **config["settings"])[1].n_nodes
    except (TypeError, ValueError) as e:
        raise ValueError(f"{where}: {_line(e)}") from None


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


STATS_FORMAT = "burstgym-observation-normalization"


def vecnormalize_path(model_path: str | Path) -> Path | None:
    """The normalisation statistics saved with a model, or None: `<prefix>_vecnormalize_<N>_steps`
    beside a checkpoint `<prefix>_<N>_steps.zip`, `<stem>_vecnormalize` (train.py's
    `best_model_vecnormalize`), then `vecnormalize` in the model's directory (train.py's final
    model, rl-zoo3's best model) or in `<stem>/` (rl-zoo3's final model); at each place the JSON
    statistics train.py writes (`.json`) before a pickle (`.pkl`: SB3's and rl-zoo3's)."""
    path = Path(model_path)
    stems = []
    m = re.fullmatch(r"(.*)_(\d+)_steps", path.stem)
    if m:
        stems.append(path.with_name(f"{m.group(1)}_vecnormalize_{m.group(2)}_steps"))
    stems += [
        path.with_name(f"{path.stem}_vecnormalize"),
        path.with_name("vecnormalize"),
        path.parent / path.stem / "vecnormalize",
    ]
    candidates = [stem.with_suffix(ext) for stem in stems for ext in (".json", ".pkl")]
    return next((c for c in candidates if c.is_file()), None)


def _moments(rms: RunningMeanStd) -> dict[str, Any]:
    return {
        "mean": np.asarray(rms.mean).tolist(),
        "var": np.asarray(rms.var).tolist(),
        "count": float(rms.count),
    }


def save_normalization(norm: VecNormalize, path: str | Path) -> None:
    """Write `norm`'s settings and statistics as JSON (atomically): a data file, which loading
    never executes, unlike VecNormalize.save's pickle."""
    from agents.runs import atomic

    rms = norm.obs_rms
    if isinstance(rms, NodePooledRunningMeanStd):
        obs = {"nodes": rms.n_nodes, "node": _moments(rms.node), "global": _moments(rms.glob)}
    else:
        obs = _moments(rms)
    blob = {
        "format": STATS_FORMAT,
        "version": 1,
        **{k: getattr(norm, k) for k in ("norm_obs", "norm_reward")},
        **{k: float(getattr(norm, k)) for k in ("clip_obs", "clip_reward", "gamma", "epsilon")},
        "obs_rms": obs,
        "ret_rms": _moments(norm.ret_rms),
    }
    with atomic(path) as tmp:
        tmp.write_text(json.dumps(blob, indent=1) + "\n")


@dataclass(frozen=True)
class ObsNormalization:
    """Normalisation statistics read from a file: what `PolicyRouter` applies (the attributes it
    reads of a VecNormalize), and `wrap` to continue training with them."""

    norm_obs: bool
    norm_reward: bool
    clip_obs: float
    clip_reward: float
    gamma: float
    epsilon: float
    obs_rms: RunningMeanStd
    ret_rms: RunningMeanStd

    def wrap(self, venv: VecEnv, training: bool) -> VecNormalize:
        """`venv` normalised with these statistics: updated and rewards normalised as saved when
        `training`, frozen with rewards as they are otherwise."""
        kwargs = {
            k: getattr(self, k) for k in ("norm_obs", "norm_reward", "clip_obs", "clip_reward", "gamma")
        }
        pooled = isinstance(self.obs_rms, NodePooledRunningMeanStd)
        norm = (NodeVecNormalize if pooled else VecNormalize)(venv, epsilon=self.epsilon, **kwargs)
        if norm.obs_rms.mean.shape != self.obs_rms.mean.shape:
            raise ValueError(
                f"statistics of {self.obs_rms.mean.shape[0]} observation values for observations of "
                f"{norm.obs_rms.mean.shape[0]}"
            )
        norm.obs_rms, norm.ret_rms = self.obs_rms.copy(), self.ret_rms.copy()
        norm.training = training
        norm.norm_reward = self.norm_reward and training
        return norm


def _read_moments(blob: Any, where: str, size: int | None) -> RunningMeanStd:
    if not isinstance(blob, dict) or set(blob) != {"mean", "var", "count"}:
        raise ValueError(f"{where}: expected mean, var and count")
    try:
        mean, var = (np.asarray(blob[k], dtype=np.float64) for k in ("mean", "var"))
        count = float(blob["count"])
    except (TypeError, ValueError):
        raise ValueError(f"{where}: mean, var and count must be numbers") from None
    if mean.shape != var.shape or mean.ndim > 1 or (size is not None and mean.shape != (size,)):
        raise ValueError(
            f"{where}: mean and var must be {size or 'equal'}-long lists, got {mean.shape}, {var.shape}"
        )
    if not (np.isfinite(mean).all() and np.isfinite(var).all() and (var >= 0).all() and count > 0):
        raise ValueError(f"{where}: statistics must be finite, var >= 0 and count > 0")
    rms = RunningMeanStd(shape=mean.shape)
    rms.mean, rms.var, rms.count = mean, var, count
    return rms


def read_normalization(path: str | Path) -> ObsNormalization:
    """JSON statistics written by `save_normalization`, checked field by field; a damaged or
    foreign file is refused in one line naming it."""
    path = Path(path)
    try:
        blob = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(
            f"{path}: not readable normalisation statistics (truncated or damaged: {_line(e)})"
        ) from None
    if not isinstance(blob, dict) or blob.get("format") != STATS_FORMAT or blob.get("version") != 1:
        raise ValueError(
            f"{path}: not normalisation statistics written by train.py ({STATS_FORMAT}, version 1)"
        )
    flags, numbers = ("norm_obs", "norm_reward"), ("clip_obs", "clip_reward", "gamma", "epsilon")
    for k in flags:
        if not isinstance(blob.get(k), bool):
            raise ValueError(f"{path}: {k!r} must be true or false")
    for k in numbers:
        v = blob.get(k)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
            raise ValueError(f"{path}: {k!r} must be a finite number >= 0, got {v!r}")
    obs = blob.get("obs_rms")
    if isinstance(obs, dict) and "nodes" in obs:
        n = obs["nodes"]
        if isinstance(n, bool) or not isinstance(n, int) or n < 1 or set(obs) != {"nodes", "node", "global"}:
            raise ValueError(f"{path}: obs_rms: expected nodes (a positive integer), node and global")
        obs_rms = NodePooledRunningMeanStd(n)
        obs_rms.node = _read_moments(obs["node"], f"{path}: obs_rms.node", len(NODE_FEATURES))
        obs_rms.glob = _read_moments(obs["global"], f"{path}: obs_rms.global", len(GLOBAL_FEATURES))
        obs_rms._sync()
    else:
        obs_rms = _read_moments(obs, f"{path}: obs_rms", None)
    ret_rms = _read_moments(blob.get("ret_rms"), f"{path}: ret_rms", None)
    return ObsNormalization(
        *(blob[k] for k in flags), *(float(blob[k]) for k in numbers), obs_rms=obs_rms, ret_rms=ret_rms
    )


def load_normalization(
    path: str | Path, venv: VecEnv | None = None, training: bool = False, allow_pickle: bool = False
) -> ObsNormalization | VecNormalize:
    """Saved normalisation statistics: wrapped around `venv` (frozen for inference, or updated as
    saved with `training`), or, without `venv`, what a router applies. JSON files are read as data;
    a pickle (`.pkl`, SB3's VecNormalize.save) only with `allow_pickle`, since unpickling can run
    any code."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"normalisation statistics {str(path)!r} do not exist")
    if path.suffix != ".pkl":
        stats = read_normalization(path)
        return stats if venv is None else stats.wrap(venv, training)
    if not allow_pickle:
        raise ValueError(f"{path}: a pickle, not loaded (burstgym writes statistics as JSON); {PICKLE_HINT}")
    try:
        with open(path, "rb") as f:
            norm = pickle.load(f)
    except (pickle.UnpicklingError, EOFError, AttributeError, ImportError, IndexError) as e:
        raise ValueError(f"{path}: not readable normalisation statistics ({_line(e)})") from None
    if not isinstance(norm, VecNormalize):
        raise ValueError(f"{path}: holds a {type(norm).__name__}, not VecNormalize statistics")
    if venv is not None:
        norm.set_venv(venv)
    norm.training = training
    norm.norm_reward = norm.norm_reward and training
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
        normalize: VecNormalize | ObsNormalization | None = None,
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
    allow_pickle: bool = False,
) -> Any:
    """A saved model as a router, with the normalisation statistics saved beside it
    (`vecnormalize_path`); `require_normalization` refuses a model whose statistics are missing.
    Nothing in the files runs unless `allow_pickle` (see `load_model`, `load_normalization`).
    A jax-ppo checkpoint is data and holds its statistics (`agents.jax_ppo.JaxPolicyRouter`)."""
    check_algo(algo)
    if algo in JAX_ALGOS:
        from agents.jax_ppo import JaxPolicyRouter

        router = JaxPolicyRouter.load(path, name, deterministic=deterministic)
        if router.stats is None and require_normalization:
            raise ValueError(
                f"model {str(path)!r} was trained on normalised observations but holds no statistics"
            )
        return router
    model = load_model(path, algo, device=device, allow_pickle=allow_pickle)
    stats = vecnormalize_path(path)
    if stats is None and require_normalization:
        raise FileNotFoundError(
            f"model {str(path)!r} was trained on normalised observations but no statistics "
            "(vecnormalize.json) lie beside it"
        )
    norm = load_normalization(stats, allow_pickle=allow_pickle) if stats is not None else None
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
