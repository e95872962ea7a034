"""Hyperparameters per algorithm and scenario, read from rl-zoo3-format YAML files in `agents/`.

One file per algorithm, as rl-zoo3's `--conf-file` expects, keyed by the environment id
`BurstBalance-v0`: `hyperparams.yml` (PPO), `hyperparams-a2c.yml`, `hyperparams-dqn.yml`,
`hyperparams-maskable-ppo.yml`. The same file trains with `train.py` and with

    python -m rl_zoo3.train --algo ppo --env BurstBalance-v0 --gym-packages burstgym \
        --conf-file agents/hyperparams.yml

An entry holds what rl-zoo3 reads itself (`n_timesteps`, `n_envs`, `env_kwargs`, `normalize`:
VecNormalize's keyword arguments) and the algorithm's constructor arguments: `policy` (an SB3
name such as "MlpPolicy", or a dotted path such as "agents.policies.NodeScoringPolicy"),
`policy_kwargs` (a mapping, or a string evaluated as rl-zoo3 does), `learning_rate` /
`clip_range` ("lin_<value>": linear decay to 0 over training, rl-zoo3's syntax). A top-level
`scenario_overrides: {<scenario>: {...}}` (train.py only; rl-zoo3 ignores it) is merged over the
`BurstBalance-v0` entry when that scenario is trained.
"""

from __future__ import annotations

import copy
import importlib
from pathlib import Path
from typing import Any

import yaml

ENV_ID = "BurstBalance-v0"
HERE = Path(__file__).resolve().parent
FILES = {
    "ppo": HERE / "hyperparams.yml",
    "a2c": HERE / "hyperparams-a2c.yml",
    "dqn": HERE / "hyperparams-dqn.yml",
    "maskable-ppo": HERE / "hyperparams-maskable-ppo.yml",
    "jax-ppo": HERE / "hyperparams.yml",  # agents.jax_ppo reads PPO's entry: the same model and settings
}
# Keys that configure the run (rl-zoo3 reads them), not the algorithm's constructor.
RUN_KEYS = ("n_timesteps", "n_envs", "env_kwargs", "normalize")
# rl-zoo3 keys that need per-environment Gymnasium wrappers or its own callbacks; train.py steps
# the clusters in one JaxVecEnv and refuses them rather than ignore them.
UNSUPPORTED = ("env_wrapper", "vec_env_wrapper", "frame_stack", "callback", "monitor_kwargs")
SCHEDULED = ("learning_rate", "clip_range", "clip_range_vf")


def conf_file(algo: str) -> Path:
    """The hyperparameter file of `algo`."""
    if algo not in FILES:
        raise ValueError(f"no hyperparameter file for algorithm {algo!r}; known: {', '.join(FILES)}")
    return FILES[algo]


def load(algo: str, scenario: str | None = None, path: str | Path | None = None) -> dict[str, Any]:
    """The `BurstBalance-v0` entry of `path` (default: `algo`'s file) with `scenario`'s overrides
    merged over it (a fresh copy, as written in the file: JSON-serialisable)."""
    path = Path(path) if path is not None else conf_file(algo)
    if not path.is_file():
        raise FileNotFoundError(f"hyperparameter file {str(path)!r} does not exist")
    try:
        doc = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    except UnicodeDecodeError as e:
        raise ValueError(f"{path}: not UTF-8 text ({e.reason})") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else ""
        raise ValueError(f"{path}: not valid YAML ({where}{getattr(e, 'problem', None) or e})") from None
    if not isinstance(doc, dict):
        raise ValueError(f"{path}: expected a mapping of environment ids, got {type(doc).__name__}")
    if ENV_ID not in doc:
        raise ValueError(f"{path}: no entry for {ENV_ID!r} (top-level keys: {', '.join(map(str, doc))})")
    entry = copy.deepcopy(doc[ENV_ID])
    all_overrides = doc.get("scenario_overrides") or {}
    if not isinstance(entry, dict) or not isinstance(all_overrides, dict):
        raise ValueError(f"{path}: {ENV_ID!r} and 'scenario_overrides' must be mappings")
    overrides = all_overrides.get(scenario) or {}
    if not isinstance(overrides, dict):
        raise ValueError(f"{path}: scenario_overrides of {scenario!r} must be a mapping")
    for key, value in copy.deepcopy(overrides).items():
        if isinstance(value, dict) and isinstance(entry.get(key), dict):
            entry[key] = {**entry[key], **value}  # env_kwargs, normalize, policy_kwargs: merged
        else:
            entry[key] = value
    bad = [k for k in UNSUPPORTED if k in entry]
    if bad:
        raise ValueError(f"{path}: train.py does not support {', '.join(bad)} (rl-zoo3-only keys)")
    return entry


def hyperparams(algo: str, scenario: str, path: str | Path | None = None) -> dict[str, Any]:
    """`load(...)` (kept for callers of the former Python table)."""
    return load(algo, scenario, path)


def linear_schedule(initial: float):
    """Progress-remaining schedule from `initial` down to 0 (rl-zoo3's "lin_<value>")."""

    def schedule(progress_remaining: float) -> float:
        return progress_remaining * initial

    return schedule


# The policies a model file's own configuration may name (`trusted=False`): SB3's names and the
# classes of `agents.policies`; importing any other module could run its code.
SAFE_POLICY_MODULE = "agents.policies"


def resolve_policy(name: str, trusted: bool = True) -> Any:
    """An SB3 policy name ("MlpPolicy") as is; a dotted path imported (as rl-zoo3 does). Untrusted
    names (from a model's run configuration) may only name a policy class of `agents.policies`."""
    if not isinstance(name, str):
        raise ValueError(f"policy must be a name or a dotted path, got {name!r}")
    if "." not in name:
        return name
    module, _, attr = name.rpartition(".")
    if not trusted and module != SAFE_POLICY_MODULE:
        raise ValueError(
            f"policy {name!r} is not one of {SAFE_POLICY_MODULE}; importing it could run code "
            "(load it with allow_pickle=True / --allow-pickle only if you trust the file)"
        )
    try:
        policy = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"policy {name!r} cannot be imported: {e}") from e
    if not trusted:
        from stable_baselines3.common.policies import BasePolicy

        if not (isinstance(policy, type) and issubclass(policy, BasePolicy)):
            raise ValueError(f"policy {name!r} is not an SB3 policy class")
    return policy


def _policy_kwargs(value: Any, trusted: bool = True) -> dict[str, Any]:
    if isinstance(value, str) and not trusted:
        raise ValueError(
            f"policy_kwargs {value!r} is a string that would be evaluated; a model's configuration "
            "must give a mapping (load it with allow_pickle=True / --allow-pickle only if you trust it)"
        )
    if isinstance(value, str):  # rl-zoo3 evaluates strings such as "dict(net_arch=[64, 64])"
        from torch import nn

        value = eval(value, {"__builtins__": {}}, {"dict": dict, "nn": nn})  # noqa: S307 (user config)
    if not isinstance(value, dict):
        raise ValueError(f"policy_kwargs must be a mapping, got {value!r}")
    return dict(value)


def model_kwargs(entry: dict[str, Any], trusted: bool = True) -> dict[str, Any]:
    """The constructor arguments of an entry: run keys removed, schedules and the policy resolved.
    `trusted=False` (an entry read from a model's run, not the user's own file) evaluates nothing
    and imports only `agents.policies` (`resolve_policy`)."""
    if not isinstance(entry, dict):
        raise ValueError(f"hyperparameters must be a mapping, got {type(entry).__name__}")
    kwargs = {k: copy.deepcopy(v) for k, v in entry.items() if k not in RUN_KEYS}
    for key in SCHEDULED:
        value = kwargs.get(key)
        if isinstance(value, str):
            kind, _, initial = value.partition("_")
            if kind != "lin":
                raise ValueError(f"{key}: unknown schedule {value!r} (use 'lin_<value>' or a number)")
            kwargs[key] = linear_schedule(float(initial))
    if "policy" in kwargs:
        kwargs["policy"] = resolve_policy(kwargs["policy"], trusted)
    if "policy_kwargs" in kwargs:
        kwargs["policy_kwargs"] = _policy_kwargs(kwargs["policy_kwargs"], trusted)
    if isinstance(kwargs.get("train_freq"), list):
        kwargs["train_freq"] = tuple(kwargs["train_freq"])
    return kwargs


def normalize_kwargs(entry: dict[str, Any]) -> dict[str, Any] | None:
    """VecNormalize's keyword arguments of an entry (None: no normalisation), as rl-zoo3 reads
    `normalize` (true, a mapping, or a string it evaluates); gamma taken from the entry."""
    value = entry.get("normalize", False)
    if isinstance(value, str):
        value = eval(value, {"__builtins__": {}}, {"dict": dict})  # noqa: S307 (user config)
    if value is False or value is None:
        return None
    kwargs = {} if value is True else dict(value)
    if "gamma" in entry:
        kwargs.setdefault("gamma", entry["gamma"])
    return kwargs
