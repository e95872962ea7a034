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
from stable_baselines3.common.utils import get_device
from stable_baselines3.common.vec_env import VecEnv, VecNormalize

from agents import model, warm_start
from agents.hyperparams import load, model_kwargs
from agents.warm_start import BC_BATCH, BC_EPOCHS, TeacherData
from burstgym.observation import GLOBAL_FEATURES, NODE_FEATURES, obs_size

ALGOS: dict[str, type[BaseAlgorithm]] = {"ppo": PPO, "a2c": A2C, "dqn": DQN, "maskable-ppo": MaskablePPO}
JAX_ALGOS = ("jax-ppo",)  # learners written in JAX (agents.jax_ppo)
DEVICES = ("auto", "cpu", "cuda")


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
    """SB3's face of `agents.model.ObsStats` (NumPy float64): the statistics of `n_nodes`-node
    observations with each node feature pooled over the nodes, and, as VecNormalize reads a
    RunningMeanStd, the mean and variance of every observation value."""

    def __init__(self, n_nodes: int):
        self.n_nodes = n_nodes
        super().__init__(model.STATS_EPS, shape=(obs_size(n_nodes),))
        self.set(model.ObsStats.empty(np, np.float64))

    def set(self, stats: model.ObsStats) -> None:
        """Take `stats` (NumPy arrays) as these statistics."""
        self.stats = stats
        self.mean, self.var = stats.mean_var(self.n_nodes)
        self.count = float(stats.glob.count)

    def update(self, arr: np.ndarray) -> None:
        self.set(self.stats.update(np.asarray(arr, dtype=np.float64)))

    def copy(self) -> NodePooledRunningMeanStd:
        out = NodePooledRunningMeanStd(self.n_nodes)
        out.set(self.stats)  # NamedTuples of arrays that are replaced, never written to
        return out

    def combine(self, other: NodePooledRunningMeanStd) -> None:
        self.set(model.ObsStats(*(a.merge(*b) for a, b in zip(self.stats, other.stats, strict=True))))

    def __setstate__(self, state: dict[str, Any]) -> None:
        """Unpickle (`--allow-pickle`) statistics pickled before `stats`, as the RunningMeanStd
        `node` and `glob` (train.py's vecnormalize.pkl of 2026-12-03), too."""
        if "stats" not in state:
            parts = (state.pop(k) for k in ("node", "glob"))
            state["stats"] = model.ObsStats(
                *(model.Moments(m.mean, m.var, np.float64(m.count)) for m in parts)
            )
            for k in ("n_feats", "n_global"):
                state.pop(k, None)
        self.__dict__.update(state)


class NodeVecNormalize(VecNormalize):
    """SB3's VecNormalize with the node features' statistics pooled over nodes
    (`NodePooledRunningMeanStd`), normalising by `agents.model.normalize`; saved and loaded as
    VecNormalize is (`save`, `VecNormalize.load`)."""

    def __init__(self, venv: VecEnv, **kwargs: Any):
        super().__init__(venv, **kwargs)
        n_nodes = model.n_nodes_of(int(np.prod(self.observation_space.shape)))
        if self.norm_obs:
            self.obs_rms = NodePooledRunningMeanStd(n_nodes)

    def _normalize_obs(self, obs: np.ndarray, obs_rms: RunningMeanStd) -> np.ndarray:
        return model.normalize(np.asarray(obs), obs_rms.mean, obs_rms.var, self.epsilon, self.clip_obs)


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


def statistics_path(model_path: str | Path) -> Path:
    """Where train.py writes the normalisation statistics of the model file `model_path`, the first
    place `vecnormalize_path` looks for them: `<prefix>_vecnormalize_<N>_steps.json` beside a
    checkpoint `<prefix>_<N>_steps.zip`, `vecnormalize.json` beside `model.zip`, and
    `<stem>_vecnormalize.json` beside any other model."""
    path = Path(model_path)
    m = re.fullmatch(r"(.*)_(\d+)_steps", path.stem)
    if m:
        return path.with_name(f"{m.group(1)}_vecnormalize_{m.group(2)}_steps.json")
    return path.with_name(
        "vecnormalize.json" if path.name == "model.zip" else f"{path.stem}_vecnormalize.json"
    )


def _moments(rms: RunningMeanStd | model.Moments) -> dict[str, Any]:
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
        obs = {"nodes": rms.n_nodes, "node": _moments(rms.stats.node), "global": _moments(rms.stats.glob)}
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
        node = _read_moments(obs["node"], f"{path}: obs_rms.node", len(NODE_FEATURES))
        glob = _read_moments(obs["global"], f"{path}: obs_rms.global", len(GLOBAL_FEATURES))
        obs_rms.set(model.ObsStats(*(model.Moments(m.mean, m.var, m.count) for m in (node, glob))))
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
            rms = self.obs_rms
            obs = model.normalize(obs, rms.mean, rms.var, self.epsilon, self.clip_obs).astype(np.float32)
        return obs

    def jax_router(self) -> Any:
        """The policy as an `agents.jax_ppo.JaxPolicyRouter` (the current weights and statistics,
        copied), so that it runs in the JAX rollout engine; None for what that network does not
        express: a policy other than `NodeScoringPolicy` (MlpPolicy, DQN, the masked policy), or
        statistics other than the node-pooled ones with VecNormalize's default epsilon and clip.
        Both run `agents.model`'s network on the same weights; torch and XLA round differently,
        so their logits agree to float32 rounding, not bit for bit."""
        import jax

        from agents import jax_ppo
        from agents.policies import NodeScorer

        extractor = getattr(self.model.policy, "mlp_extractor", None)
        if self.masked or not isinstance(extractor, NodeScorer):
            return None
        stats = None
        if self.obs_rms is not None:
            rms = self.obs_rms
            if not isinstance(rms, NodePooledRunningMeanStd) or (self.epsilon, self.clip_obs) != (
                model.NORM_EPS,
                model.CLIP_OBS,
            ):
                return None
            stats = jax.tree.map(lambda x: np.asarray(x, np.float32), rms.stats)
        params = {"params": extractor.numpy_params()}
        hidden = int(params["params"]["score_0"]["kernel"].shape[1])
        return jax_ppo.JaxPolicyRouter(
            params, stats, extractor.n_nodes, hidden, self.name, self.deterministic
        )

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


def collect_teacher(env: VecEnv, teacher: Any, steps: int) -> TeacherData:
    """`teacher`'s rollout on `env` for `steps` environment steps, observations raw (a
    VecNormalize `env` keeps updating its statistics; raw observations and rewards are kept)."""
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
        np.stack(rs),
        np.stack(ds),
        np.stack(cuts),
        np.stack(terms),
        np.asarray(obs),
    )


def behaviour_clone(
    model: BaseAlgorithm,
    env: VecEnv,
    teacher: Any,
    steps: int,
    epochs: int = BC_EPOCHS,
    batch_size: int = BC_BATCH,
) -> dict[str, float]:
    """Warm-start a node-scoring `model` on the heuristic `teacher`'s rollouts on `env` for
    `steps` environment steps (`collect_teacher`, then `agents.warm_start.fit` of the policy's
    parameters, which are then loaded back). With a VecNormalize `env`, statistics are gathered
    during the collection and every observation is normalised with the final ones. Returns
    `agents.warm_start.fit`'s records."""
    import jax

    from agents.policies import NodeScorer

    extractor = getattr(model.policy, "mlp_extractor", None)
    if not isinstance(extractor, NodeScorer):
        raise ValueError(
            "behaviour cloning fits the node-scoring network (agents.policies.NodeScoringPolicy, "
            f"MaskableNodeScoringPolicy), not {type(model.policy).__name__}"
        )
    data = collect_teacher(env, teacher, steps)
    if isinstance(env, VecNormalize):
        dim = data.obs.shape[-1]

        def observe(a: np.ndarray) -> np.ndarray:
            return env.normalize_obs(a.reshape(-1, dim)).reshape(a.shape)

        data = data._replace(
            obs=observe(data.obs), terminal_obs=observe(data.terminal_obs), last_obs=observe(data.last_obs)
        )
    key = jax.random.key(int(torch.randint(2**31 - 1, ())))  # torch's generator, which SB3 seeds
    gamma = float(getattr(model, "gamma", 0.99))
    params, out = warm_start.fit(extractor.numpy_params(), data, gamma, key, epochs, batch_size)
    extractor.load_params(jax.device_get(params))
    return out
