"""A training run's directory: its `config.json`, the run a model file belongs to, atomic saves,
checkpoints, resuming, and stopping cleanly on SIGINT / SIGTERM.

`config.json` is written when a run starts (`"status": "running"`) with everything a resumed run
needs (algorithm, scenario and settings, seed, clusters, hyperparameters, normalisation), updated
at every checkpoint and when the run ends (`"finished"` or `"interrupted"`). It is the only source
of a resumed run's task, and of the network a model file is rebuilt into when it is loaded
without unpickling (`agents.learners.load_model`). Files are replaced atomically (written beside
the target, then renamed), so a run killed mid-save leaves the previous file whole. A run
directory that holds anything is never written into (`check_run_dir`, `create_run_dir`).
"""

from __future__ import annotations

import json
import math
import os
import signal
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any

CONFIG = "config.json"
CHECKPOINTS = "checkpoints"


def run_dir_of(model: str | Path) -> Path:
    """The run directory a model file belongs to: `<run>/checkpoints/x` or `<run>/x`."""
    parent = Path(model).resolve().parent
    return parent.parent if parent.name == CHECKPOINTS else parent


def read_config(path: str | Path) -> dict[str, Any]:
    """A run's `config.json` (`path` is the file or its run directory) as a mapping; a missing,
    unreadable or malformed file is refused in one line naming it."""
    path = Path(path)
    if path.is_dir():
        path = path / CONFIG
    if not path.is_file():
        raise FileNotFoundError(f"run configuration {str(path)!r} does not exist")
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError as e:
        raise ValueError(f"{path}: not UTF-8 text ({e.reason})") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON (line {e.lineno}, column {e.colno}: {e.msg})") from None
    if not isinstance(config, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(config).__name__}")
    return config


def find_config(model: str | Path) -> tuple[Path, dict[str, Any]] | None:
    """(path, contents) of the `config.json` of the run `model` belongs to, or None if it has none
    (a malformed one is refused, naming it)."""
    path = run_dir_of(model) / CONFIG
    return (path, read_config(path)) if path.is_file() else None


def require(config: dict[str, Any], path: Path, *keys: str) -> None:
    """Refuse a configuration that lacks one of `keys`, naming the file and the key."""
    missing = [k for k in keys if k not in config]
    if missing:
        raise ValueError(f"{path}: no {missing[0]!r} (not a configuration train.py wrote)")


@contextmanager
def atomic(path: str | Path) -> Iterator[Path]:
    """A temporary path beside `path` to write to; it replaces `path` only if the block succeeds."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.partial")
    try:
        yield tmp
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


def write_config(run_dir: str | Path, config: dict[str, Any]) -> None:
    """Write `config` as the run's `config.json`, atomically."""
    with atomic(Path(run_dir) / CONFIG) as tmp:
        tmp.write_text(json.dumps(config, indent=2, default=str) + "\n")


def check_run_dir(run_dir: str | Path, hint: str = "") -> Path:
    """Refuse (naming it) a run directory that exists and holds anything, so that a run never
    overwrites or mixes with another. `hint` says what to do instead."""
    run_dir = Path(run_dir)
    if run_dir.exists() and (not run_dir.is_dir() or any(run_dir.iterdir())):
        what = "holds a run" if (run_dir / CONFIG).exists() else "exists and is not empty"
        raise ValueError(f"run directory {str(run_dir)!r} {what}; {hint or 'choose another'}")
    return run_dir


def create_run_dir(run_dir: str | Path, hint: str = "") -> Path:
    """Create `run_dir`, refused as `check_run_dir` refuses."""
    run_dir = check_run_dir(run_dir, hint)
    run_dir.mkdir(parents=True, exist_ok=True)
    return run_dir


class Stopped(Exception):
    """A second SIGINT / SIGTERM: stop now, without saving."""


class StopOnSignal:
    """While active, SIGINT and SIGTERM ask the run to stop instead of killing it: the first sets
    `signal` (a name, checked by the training loop between steps, which then saves and exits); a
    second raises `Stopped` at once. The previous handlers come back on exit."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self, program: str):
        self.program = program
        self.signal: str | None = None
        self._previous: dict[int, Any] = {}

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        name = signal.Signals(signum).name
        if self.signal is not None:
            raise Stopped(f"{name} again: stopped without saving")
        self.signal = name
        print(
            f"{self.program}: {name}: saving the model, its statistics and config.json at the next step "
            f"({name} again stops without saving)",
            file=sys.stderr,
            flush=True,
        )

    def __enter__(self) -> StopOnSignal:
        for s in self.SIGNALS:
            self._previous[s] = signal.signal(s, self._handle)
        return self

    def __exit__(self, *exc: Any) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)

    @property
    def exit_code(self) -> int:
        """128 + the signal's number, the shell's convention for a process ended by a signal."""
        return 128 + int(signal.Signals[self.signal]) if self.signal else 0


def resumed_dir(out: Path, old_run: Path, run_name: str | None) -> Path:
    """A new run directory for a resumed run: `run_name`, else `<old>-resumed` (then -2, -3, ...
    while taken); never the old run's directory."""
    if run_name:
        run_dir = out / run_name
    else:
        run_dir = out / f"{old_run.name}-resumed"
        k = 2
        while run_dir.exists():
            run_dir = out / f"{old_run.name}-resumed-{k}"
            k += 1
    if run_dir.resolve() == old_run.resolve():
        raise ValueError(
            f"--resume would write into the checkpoint's own run {str(old_run)!r}; give another --run-name"
        )
    return run_dir


@dataclass
class Run:
    """A run being trained: what it trains (`config`, the contents of its config.json) and where.
    Its directory is made by `begin`, once what it starts from (a checkpoint to resume, the
    environments) has loaded, so that a run refused on the way leaves nothing behind; `hint` is
    what the refusal of an occupied directory suggests instead."""

    dir: Path
    config: dict[str, Any]
    hint: str = ""
    seconds: float = 0.0
    start: float = field(default_factory=time.time)

    def begin(self) -> None:
        """Create the run directory (refusing an occupied one) and write config.json."""
        create_run_dir(self.dir, self.hint)
        write_config(self.dir, self.config)

    def update(self, **changes: Any) -> None:
        """Change config.json (rewritten atomically)."""
        self.config.update(changes)
        write_config(self.dir, self.config)

    @property
    def algo(self) -> str:
        return self.config["algo"]


RESUME_KEYS = ("algo", "scenario", "settings", "seed", "n_envs", "stagger", "hyperparams", "normalize")


def resume_config(checkpoint: str | Path) -> tuple[Path, dict[str, Any]]:
    """The run a checkpoint belongs to and its config.json, which a resumed run continues; refused
    in one line if there is none or it lacks what resuming needs."""
    path = Path(checkpoint)
    if not path.is_file():
        raise FileNotFoundError(f"checkpoint {checkpoint!r} does not exist")
    old_run = run_dir_of(path)
    config_path = old_run / CONFIG
    if not config_path.is_file():
        raise ValueError(
            f"checkpoint {checkpoint!r} belongs to run {str(old_run)!r}, which has no config.json "
            "(written when a run starts), so what it trained on is unknown; start a new run instead"
        )
    old = read_config(config_path)
    require(old, config_path, *RESUME_KEYS)
    return old_run, old


class Checkpoints:
    """Checkpoints at least every tenth of the budget (`--checkpoint-every` if more often), each
    recorded in config.json, for both learners: `due(steps)` says when, `save(steps, write)`
    writes one with the learner's `write(path)` and notes it in the run's configuration."""

    def __init__(self, run: Run, every: int, budget: int, start: int, ext: str):
        tenth = math.ceil(budget / 10)
        self.every = min(every, tenth) if every > 0 else tenth
        self.next_at = start + self.every
        self.run, self.ext = run, ext
        (run.dir / CHECKPOINTS).mkdir(exist_ok=True)

    def due(self, steps: int) -> bool:
        return steps >= self.next_at

    def save(self, steps: int, write: Callable[[Path], None]) -> None:
        while self.next_at <= steps:
            self.next_at += self.every
        path = self.run.dir / CHECKPOINTS / f"rl_model_{steps}_steps.{self.ext}"
        write(path)
        self.run.update(timesteps=steps, last_checkpoint=str(path))
