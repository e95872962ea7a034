"""End-to-end smoke tests of train.py and evaluate.py (subprocesses, tiny budgets) and their
refusals of bad input (in-process: no JAX compile is reached)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TINY = ["--episode-length", "16"]


def load_script(name: str):
    spec = importlib.util.spec_from_file_location(f"_{name}", ROOT / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run(script: str, *args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, str(ROOT / script), *args]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("runs")
    proc = run(
        "train.py",
        *TINY,
        "--n-envs",
        "8",
        "--timesteps",
        "256",
        "--eval-every",
        "128",
        "--eval-seeds",
        "2",
        "--checkpoint-every",
        "128",
        "--bc-steps",
        "64",
        "--out",
        str(out),
        "--no-progress",
    )
    assert proc.returncode == 0, proc.stderr
    return out / "prefix-ppo-seed0"


def test_train_saves_a_loadable_model_with_config_and_checkpoints(trained):
    from agents.learners import load_model

    model = load_model(trained / "model.zip", "ppo")
    from burstgym.observation import obs_size

    assert model.observation_space.shape == (obs_size(4),)
    config = json.loads((trained / "config.json").read_text())
    assert config["algo"] == "ppo" and config["scenario"] == "prefix" and config["timesteps"] >= 256
    assert config["settings"]["episode_length"] == 16
    assert list((trained / "checkpoints").glob("*.zip"))


def test_train_logs_serving_and_eval_metrics_to_tensorboard(trained):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tags = set()
    for events in (trained / "tb").rglob("events.out.tfevents*"):
        acc = EventAccumulator(str(events))
        acc.Reload()
        tags |= set(acc.Tags()["scalars"])
    for tag in (
        "serving/e2e_p50",
        "serving/e2e_p99",
        "serving/ttft_p50",
        "serving/slo_attainment",
        "serving/drops",
        "serving/energy_per_request_j",
        "serving/skew_index",
        "serving/load_share_node0",
        "eval/objective_learned",
        "eval/objective_round_robin",
        "eval/change_vs_round_robin_pct",
        "rollout/ep_rew_mean",
    ):
        assert tag in tags, f"{tag} missing from {sorted(tags)}"


def test_train_resumes_from_a_checkpoint(trained, tmp_path):
    checkpoint = sorted((trained / "checkpoints").glob("*.zip"))[0]
    proc = run(
        "train.py",
        *TINY,
        "--n-envs",
        "8",
        "--timesteps",
        "128",
        "--eval-every",
        "0",
        "--resume",
        str(checkpoint),
        "--out",
        str(tmp_path),
        "--no-progress",
    )
    assert proc.returncode == 0, proc.stderr
    config = json.loads((tmp_path / "prefix-ppo-seed0" / "config.json").read_text())
    assert config["timesteps"] > 128 and config["resumed_from"] == str(checkpoint)


def test_evaluate_writes_table_and_plots(trained, tmp_path):
    out = tmp_path / "results"
    proc = run(
        "evaluate.py",
        "--model",
        str(trained / "model.zip"),
        "--seeds",
        "2",
        *TINY,
        "--scenarios",
        "prefix",
        "--routers",
        "jsq",
        "weighted-skew",
        "sglang-cache-aware",
        "--regime-grid",
        "tiny",
        "--regime-seeds",
        "2",
        "--regime-episode-length",
        "16",
        "--out",
        str(out),
    )
    assert proc.returncode == 0, proc.stderr
    md = (out / "results.md").read_text()
    assert "| round-robin |" in md and "| learned-ppo |" in md and "| sglang-cache-aware |" in md
    assert "## Summary" in md
    csv = (out / "results.csv").read_text().splitlines()
    assert csv[0].startswith("scenario,router,objective") and any(",round-robin," in line for line in csv)
    result = json.loads((out / "results.json").read_text())
    assert result["complete"] and result["summary"][0].startswith("prefix: best is")
    assert {"cache_hit_rate", "ttft_mean"} <= set(result["rows"][0])
    for png in ("latency_cdf_prefix.png", "load_share_prefix.png", "regime_map.png"):
        assert (out / png).stat().st_size > 1000
    assert not list(out.glob(".partial-*"))


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--scenario", "nowhere"], "unknown scenario 'nowhere'"),
        (["--algo", "sarsa"], "unknown algorithm 'sarsa'"),
        (["--bc-teacher", "oracle"], "unknown router 'oracle'"),
        (["--resume", "missing.zip"], "checkpoint 'missing.zip' does not exist"),
        (["--set", "n_nodes=0"], "'n_nodes' must be a positive integer"),
    ],
)
def test_train_refuses_bad_input(argv, message, tmp_path, capsys):
    code = load_script("train").main([*argv, "--out", str(tmp_path), "--no-progress"])
    assert code != 0
    assert message in capsys.readouterr().err
    assert not list(tmp_path.rglob("model.zip"))


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--scenarios", "nowhere"], "unknown scenario 'nowhere'"),
        (["--routers", "psychic"], "unknown router 'psychic'"),
        (["--model", "missing.zip"], "checkpoint 'missing.zip' does not exist"),
        (["--algo", "sarsa"], "unknown algorithm 'sarsa'"),
        (["--trace", "BAD"], "line 2"),
    ],
)
def test_evaluate_refuses_bad_input(argv, message, tmp_path, capsys):
    bad = tmp_path / "bad.csv"
    bad.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46,12,34,56,78\n")
    argv = [str(bad) if a == "BAD" else a for a in argv]
    out = tmp_path / "results"
    extra = [] if "--model" in argv else ["--no-model"]
    code = load_script("evaluate").main([*argv, *extra, "--out", str(out)])
    assert code != 0
    assert message in capsys.readouterr().err
    assert not out.exists()
