"""End-to-end smoke tests of train.py and evaluate.py (subprocesses, tiny budgets) and their
refusals of bad input (in-process: no JAX compile is reached)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import load_script

ROOT = Path(__file__).resolve().parents[1]
TINY = ["--episode-length", "16"]


def run(script: str, *args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, str(ROOT / script), *args]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)


# Tests that read the one training run share a worker under pytest-xdist (`--dist loadgroup`), and
# the run is session-scoped (a worker may run other modules' tests between them), so it is trained
# once.
SAME_RUN = pytest.mark.xdist_group("trained-run")


@pytest.fixture(scope="session")
def trained(tmp_path_factory) -> Path:
    if os.environ.get("PYTEST_XDIST_WORKER"):
        # Under pytest-xdist every worker's base folder sits in the run's own folder: a second
        # worker that gets here means the xdist_group did not keep the tests together.
        claim = tmp_path_factory.getbasetemp().parent / "trained-run.claimed"
        try:
            claim.touch(exist_ok=False)
        except FileExistsError:
            pytest.fail("a second worker trains the shared run: --dist loadgroup did not group SAME_RUN")
    out = tmp_path_factory.mktemp("runs")
    proc = run(
        "train.py",
        *TINY,
        "--scenario",
        "prefix",
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


@SAME_RUN
def test_train_saves_a_loadable_model_with_config_and_checkpoints(trained):
    from agents.learners import load_model

    model = load_model(trained / "model.zip", "ppo")
    from burstgym.observation import obs_size

    assert model.observation_space.shape == (obs_size(4),)
    config = json.loads((trained / "config.json").read_text())
    assert config["algo"] == "ppo" and config["scenario"] == "prefix" and config["timesteps"] >= 256
    assert config["status"] == "finished" and config["timesteps_planned"] == 256
    assert config["settings"]["episode_length"] == 16
    assert config["hyperparams"]["target_kl"] == 0.02 and config["stagger"] is True
    assert config["normalize"] == {"norm_obs": True, "norm_reward": False}
    assert {"agreement", "value_explained_variance"} <= set(config["bc"])
    assert list((trained / "checkpoints").glob("*_steps.zip"))
    for stats in ("vecnormalize.json", "best_model_vecnormalize.json"):
        assert (trained / stats).is_file(), stats
    assert list((trained / "checkpoints").glob("*_vecnormalize_*_steps.json"))
    assert not list(trained.rglob("*.pkl"))  # statistics are data, not pickles


def _events(run: Path):
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader

    for path in (run / "tb").rglob("events.out.tfevents*"):
        yield from EventFileLoader(str(path)).Load()


@SAME_RUN
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
        "eval/objective_learned_deterministic",
        "eval/objective_learned_stochastic",
        "eval/objective_round_robin",
        "eval/change_vs_round_robin_pct_deterministic",
        "eval/change_vs_round_robin_pct_stochastic",
        "bc/agreement",
        "bc/value_explained_variance",
        "rollout/ep_rew_mean",
    ):
        assert tag in tags, f"{tag} missing from {sorted(tags)}"


@SAME_RUN
def test_train_writes_a_custom_scalars_layout_once(trained):
    from tensorboard.plugins.custom_scalar import layout_pb2

    layouts = [
        v.tensor.string_val[0]
        for event in _events(trained)
        for v in event.summary.value
        if v.tag == "custom_scalars__config__"
    ]
    assert len(layouts) == 1
    layout = layout_pb2.Layout()
    layout.ParseFromString(layouts[0])
    charts = {c.title: list(c.multiline.tag) for cat in layout.category for c in cat.chart}
    assert any("eval/objective_" in t for tags in charts.values() for t in tags)
    assert any("serving/" in t for tags in charts.values() for t in tags)
    assert any("rollout/ep_rew_mean" in t for tags in charts.values() for t in tags)


def _digest(path: Path) -> str:
    import hashlib

    return hashlib.sha256(path.read_bytes()).hexdigest()


@SAME_RUN
def test_train_resumes_from_a_checkpoint_into_a_new_run(trained):
    checkpoint = sorted((trained / "checkpoints").glob("*_steps.zip"))[0]
    kept = {name: _digest(trained / name) for name in ("best_model.zip", "model.zip", "config.json")}
    proc = run(
        "train.py",
        "--n-envs",
        "8",
        "--timesteps",
        "128",
        "--eval-every",
        "128",
        "--eval-seeds",
        "2",
        "--resume",
        str(checkpoint),
        "--out",
        str(trained.parent),
        "--no-progress",
    )
    assert proc.returncode == 0, proc.stderr
    assert {name: _digest(trained / name) for name in kept} == kept  # the old run is untouched
    resumed = trained.parent / f"{trained.name}-resumed"
    config = json.loads((resumed / "config.json").read_text())
    assert config["timesteps"] > 128 and config["resumed_from"] == str(checkpoint)
    # the old run's algorithm, scenario and settings, without repeating them
    assert config["algo"] == "ppo" and config["scenario"] == "prefix"
    assert config["settings"]["episode_length"] == 16
    for name in ("model.zip", "best_model.zip", "vecnormalize.json", "best_model_vecnormalize.json"):
        assert (resumed / name).is_file(), name


def test_resume_never_writes_into_the_checkpoints_run(tmp_path):
    from agents.runs import resumed_dir, run_dir_of

    old = tmp_path / "runs" / "prefix-ppo-seed0"
    (old / "checkpoints").mkdir(parents=True)
    checkpoint = old / "checkpoints" / "rl_model_64_steps.zip"
    assert run_dir_of(checkpoint) == old.resolve()
    assert run_dir_of(old / "best_model.zip") == old.resolve()
    assert resumed_dir(tmp_path / "runs", old, None) == tmp_path / "runs" / "prefix-ppo-seed0-resumed"
    (tmp_path / "runs" / "prefix-ppo-seed0-resumed").mkdir()
    assert resumed_dir(tmp_path / "runs", old, None).name == "prefix-ppo-seed0-resumed-2"
    with pytest.raises(ValueError, match="own run"):
        resumed_dir(tmp_path / "runs", old, "prefix-ppo-seed0")


@SAME_RUN
def test_evaluate_uses_the_runs_scenario_and_settings(trained, tmp_path, monkeypatch):
    """The training scenario runs with every setting of config.json (--set and --load still
    override); the other scenarios keep their own settings but the model's cluster and episodes."""
    import shutil

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    for name in ("model.zip", "vecnormalize.json"):
        shutil.copy(trained / name, run_dir / name)
    config = json.loads((trained / "config.json").read_text())
    config["scenario"] = "bursty"
    config["settings"] = {"episode_length": 16, "load": 0.3, "burst_ratio": 4.0, "queue_capacity": 32}
    (run_dir / "config.json").write_text(json.dumps(config))
    evaluate = load_script("evaluate")
    seen = {}

    class Stop(Exception):
        pass

    def capture(fn, tasks, *rest):
        seen.update({t["name"]: t["settings"] for t in tasks})
        seen["learned"] = tasks[0]["learned"]
        raise Stop

    monkeypatch.setattr(evaluate, "run_tasks", capture)
    argv = ["--model", str(run_dir / "model.zip"), "--scenarios", "bursty", "steady", "--seeds", "2"]
    with pytest.raises(Stop):
        evaluate.main(
            [*argv, "--set", "queue_capacity=16", "--regime-grid", "none", "--out", str(tmp_path / "r")]
        )
    assert seen["bursty"] == {"episode_length": 16, "load": 0.3, "burst_ratio": 4.0, "queue_capacity": 16}
    assert seen["steady"] == {"episode_length": 16, "queue_capacity": 16}
    assert seen["learned"].obs_rms is not None  # the statistics beside the model are applied
    seen.clear()
    with pytest.raises(Stop):
        evaluate.main([*argv, "--load", "0.5", "--regime-grid", "none", "--out", str(tmp_path / "r")])
    assert seen["bursty"]["load"] == 0.5 and seen["bursty"]["burst_ratio"] == 4.0


@SAME_RUN
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
        "none",
        "--max-seeds",
        "2",
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
    for png in ("latency_cdf_prefix.png", "load_share_prefix.png"):  # the regime map: test_evaluate_stats
        assert (out / png).stat().st_size > 1000
    assert result["run"]["id"] and result["run"]["command"][0].endswith("evaluate.py")
    assert f"Run `{result['run']['id']}`" in md
    assert sorted(p.name for p in out.parent.iterdir()) == ["results"]  # no staging folder left


def test_jax_ppo_trains_through_train_py_and_evaluate_judges_it(tmp_path, monkeypatch):
    """train.py --algo jax-ppo writes the run (checkpoints, config.json, TensorBoard), and
    evaluate.py loads its checkpoint with the run's settings as the learned router."""
    out = tmp_path / "runs"
    proc = run(
        "train.py",
        *TINY,
        "--algo",
        "jax-ppo",
        "--n-envs",
        "4",
        "--timesteps",
        "256",
        "--eval-every",
        "0",
        "--checkpoint-every",
        "128",
        "--bc-steps",
        "32",
        "--out",
        str(out),
        "--no-progress",
    )
    assert proc.returncode == 0, proc.stderr
    run_dir = out / "prefix-jax-ppo-seed0"
    for name in (
        "model.msgpack",
        "checkpoints/rl_model_128_steps.msgpack",
        "checkpoints/rl_model_256_steps.msgpack",
    ):
        assert (run_dir / name).stat().st_size > 1000
    config = json.loads((run_dir / "config.json").read_text())
    assert config["algo"] == "jax-ppo" and config["timesteps"] == 256 and config["normalize"]["norm_obs"]
    assert config["bc"]["samples"] == 32 and config["steps_per_second_compiled"] > 0
    assert list((run_dir / "tb").rglob("events.out.tfevents.*"))
    evaluate = load_script("evaluate")
    seen = {}

    class Stop(Exception):
        pass

    def capture(fn, tasks, *rest):
        seen.update(tasks[0])
        raise Stop

    monkeypatch.setattr(evaluate, "run_tasks", capture)
    with pytest.raises(Stop):
        evaluate.main(
            ["--model", str(run_dir / "model.msgpack"), "--regime-grid", "none", "--out", str(tmp_path / "r")]
        )
    assert seen["name"] == "prefix" and seen["settings"]["episode_length"] == 16
    assert seen["learned"].name == "learned-jax-ppo" and seen["learned"].stats is not None


def test_train_mixture_trains_one_model_across_drawn_groups(tmp_path, capsys):
    """--scenario mixture: the run records its drawn groups and held-out groups, warm-starts from
    the teacher built for each group, trains on all of them and evaluates on the held-out ones."""
    out = tmp_path / "runs"
    proc = run(
        "train.py",
        *TINY,
        "--scenario",
        "mixture",
        "--mixture-groups",
        "2",
        "--mixture-held-out",
        "1",
        "--n-envs",
        "4",
        "--timesteps",
        "128",
        "--eval-every",
        "128",
        "--eval-seeds",
        "4",
        "--bc-steps",
        "32",
        "--out",
        str(out),
        "--no-progress",
    )
    assert proc.returncode == 0, proc.stderr
    run_dir = out / "mixture-ppo-seed0"
    config = json.loads((run_dir / "config.json").read_text())
    assert config["scenario"] == "bursty" and len(config["mixture"]["groups"]) == 2
    assert (
        len(config["mixture"]["held_out"]) == 1
        and config["mixture"]["held_out"][0] not in config["mixture"]["groups"]
    )
    assert config["bc"]["samples"] == 32 and config["timesteps"] == 128
    assert config["final_eval"]["eval/objective_round_robin"] > 0
    assert (run_dir / "model.zip").stat().st_size > 1000 and (run_dir / "best_model.zip").is_file()
    # evaluate.py refuses to judge it on the groups it trained on (seed 0's draws)
    evaluate = load_script("evaluate")
    argv = ["--model", str(run_dir / "best_model.zip"), "--mixture-draws", "2", "--mixture-seed", "0"]
    assert evaluate.main([*argv, "--out", str(tmp_path / "r")]) == 2
    assert "--mixture-seed 0 draws groups the model trained on" in capsys.readouterr().err
    assert not (tmp_path / "r").exists()


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--scenario", "nowhere"], "unknown scenario 'nowhere'"),
        (["--algo", "sarsa"], "unknown algorithm 'sarsa'"),
        (["--bc-teacher", "oracle"], "unknown router 'oracle'"),
        (["--bc-teacher", "lookahead"], "only --algo jax-ppo can imitate it"),
        (["--resume", "missing.zip"], "checkpoint 'missing.zip' does not exist"),
        (["--set", "n_nodes=0"], "'n_nodes' must be a positive integer"),
        (["--set", "max_num_seqs=4294967301"], "'max_num_seqs' must be a positive integer <= 2,147,483,647"),
        (["--set", "system_tokens=1024.0"], "'system_tokens' must be an integer"),
        (["--set", "speed=inf"], "'speed' must be a finite number, got inf"),
        (["--set", "load='0.5'"], "'load' must be a number, got \"'0.5'\" (str)"),
        (["--scenario", "trace", "--trace", "DIR"], "a directory, not a trace file"),
        (["--eval-seeds", "0"], "--eval-seeds must be at least 1"),
        (["--seed", "-1"], "--seed must be in [0, 2**32)"),
        (["--device", "tpu"], "unknown device 'tpu'"),
        (["--conf-file", "missing.yml"], "hyperparameter file 'missing.yml' does not exist"),
        (["--conf-file", "BROKEN.yml"], "BROKEN.yml: not valid YAML (line 2, column 1"),
        (["--conf-file", "LIST.yml"], "LIST.yml: expected a mapping of environment ids, got list"),
        (["--conf-file", "MLP.yml"], "--bc-teacher fits the node-scoring network"),
        (["--scenario", "mixture", "--algo", "jax-ppo"], "the JAX learner steps one configuration"),
        (["--scenario", "mixture", "--load", "0.5"], "draws each group's load and workload"),
        (["--load", "0.5"], "--scenario mixture (the default) draws each group's load"),
        (["--scenario", "mixture", "--set", "prefix_share=0.5"], "draws setting 'prefix_share' per group"),
        (["--scenario", "mixture", "--mixture-groups", "0"], "--mixture-groups must be at least 1"),
        (["--mixture-held-out", "0"], "--mixture-held-out must be at least 1"),
        (["--seed", "5000"], "--seed 5000 would train on the mixture's held-out groups"),
        (["--scenario", "mixture", "--n-envs", "4"], "n_envs (4) must be at least the mixture's groups (8)"),
    ],
)
def test_train_refuses_bad_input(argv, message, tmp_path, capsys):
    files = {
        "BROKEN.yml": "BurstBalance-v0: [n_envs: 4\n",
        "LIST.yml": "- BurstBalance-v0\n",
        "MLP.yml": "BurstBalance-v0:\n  policy: MlpPolicy\n",
    }
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    argv = [str(tmp_path) if a == "DIR" else str(tmp_path / a) if a in files else a for a in argv]
    code = load_script("train").main([*argv, "--out", str(tmp_path / "runs"), "--no-progress"])
    assert code != 0
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1, err  # one line, no traceback
    assert not (tmp_path / "runs").exists()  # refused before anything is written


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--scenarios", "nowhere"], "unknown scenario 'nowhere'"),
        (["--routers", "psychic"], "unknown router 'psychic'"),
        (["--routers", "all", "psychic"], "unknown router 'all'"),
        (["--model", "missing.zip"], "checkpoint 'missing.zip' does not exist"),
        (["--algo", "sarsa"], "unknown algorithm 'sarsa'"),
        (["--trace", "BAD"], "line 2"),
        (["--device", "tpu"], "unknown device 'tpu'"),
        (["--mixture-draws", "-1"], "--mixture-draws must be >= 0, got -1"),
        (["--mixture-draws", "2", "--load", "0.5"], "draws setting 'load' per group"),
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


def test_evaluate_mixture_draws_are_scenarios_of_their_own(tmp_path, monkeypatch):
    """--mixture-draws K adds K cases drawn from burstgym.mixture with --mixture-seed (alone: only
    those), each the base scenario with its group's settings."""
    from burstgym import mixture

    evaluate = load_script("evaluate")
    seen = []

    class Stop(Exception):
        pass

    def capture(fn, tasks, *rest):
        seen.extend(tasks)
        raise Stop

    monkeypatch.setattr(evaluate, "run_tasks", capture)
    with pytest.raises(Stop):
        evaluate.main(
            ["--no-model", "--mixture-draws", "3", "--mixture-seed", "7", "--out", str(tmp_path / "r")]
        )
    draws = mixture.draw(7, 3)
    assert [t["name"] for t in seen] == [mixture.BASE] * 3
    assert [{k: t["settings"][k] for k in g} for t, g in zip(seen, draws, strict=True)] == draws
    assert all(t["settings"]["episode_length"] == 256 for t in seen)


def test_evaluate_runs_the_default_routers_or_all_of_them():
    evaluate = load_script("evaluate")
    assert evaluate.router_names(list(evaluate.DEFAULT_ROUTERS)) == list(evaluate.DEFAULT_ROUTERS)
    assert evaluate.router_names(["all"]) == list(evaluate.ALL_ROUTERS)  # round-robin is the first rule
    assert evaluate.router_names(["marginal-cost", "round-robin"]) == ["round-robin", "marginal-cost"]
    assert set(evaluate.DEFAULT_ROUTERS) < set(evaluate.ALL_ROUTERS)


@pytest.mark.parametrize(
    "make_out, message",
    [
        (lambda tmp: (tmp / "afile").write_text("x") and tmp / "afile", "exists and is not a folder"),
        (lambda tmp: (tmp / "afile").write_text("x") and tmp / "afile" / "results", "cannot write into"),
        (lambda tmp: (tmp / "mine").mkdir() or (tmp / "mine" / "a.txt").write_text("x") and tmp / "mine",
         "holds files evaluate.py did not write"),
    ],
)  # fmt: skip
def test_evaluate_checks_out_before_any_work(make_out, message, tmp_path, capsys, monkeypatch):
    """An unusable --out is refused at once (exit 2, one line naming it), before any episode runs."""
    evaluate = load_script("evaluate")

    def work(*args, **kwargs):
        raise AssertionError("episodes ran before --out was checked")

    monkeypatch.setattr(evaluate, "run_tasks", work)
    out = make_out(tmp_path)
    argv = ["--no-model", "--scenarios", "steady", "--regime-grid", "tiny", "--out", str(out)]
    assert evaluate.main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and str(out) in err and err.count("\n") == 1
    assert not list(tmp_path.glob(".*partial*"))


@pytest.mark.slow
def test_rl_zoo3_trains_from_the_same_hyperparameter_file(tmp_path):
    """`python -m rl_zoo3.train --algo ppo --env BurstBalance-v0 --gym-packages burstgym
    --conf-file agents/hyperparams.yml -n 256` works (4 clusters of 16-request episodes through
    rl-zoo3's --hyperparams, to keep it short), and its model loads as a router with its
    normalisation statistics."""
    pytest.importorskip("rl_zoo3", reason="rl-zoo3 is not installed (pip install -e '.[dev]')")
    from agents.learners import load_router, vecnormalize_path

    cmd = [sys.executable, "-m", "rl_zoo3.train", "--algo", "ppo", "--env", "BurstBalance-v0"]
    cmd += ["--gym-packages", "burstgym", "--conf-file", "agents/hyperparams.yml", "-n", "256"]
    cmd += ["-f", str(tmp_path), "--seed", "0", "--hyperparams", "n_envs:4"]
    cmd += ["env_kwargs:dict(scenario='prefix', episode_length=16)"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    (model,) = tmp_path.glob("ppo/BurstBalance-v0_*/BurstBalance-v0.zip")
    assert vecnormalize_path(model) == model.parent / "BurstBalance-v0" / "vecnormalize.pkl"
    with pytest.raises(ValueError, match="allow_pickle"):  # rl-zoo3 writes pickles and no config.json
        load_router(model, "ppo", require_normalization=True)
    router = load_router(model, "ppo", require_normalization=True, allow_pickle=True)
    assert type(router.model.policy).__name__ == "NodeScoringPolicy"
    obs = np.zeros((2, router.model.observation_space.shape[0]), dtype=np.float32)
    assert router(obs).shape == (2,)


def test_scenario_rule_names_marginal_cost_or_a_rule_and_refuses_others():
    from agents.marginal_cost import MarginalCost
    from agents.routers import scenario_rule
    from burstgym import scenarios

    cfg, params = scenarios.make("bursty-dynamic", episode_length=16)
    mc = scenario_rule("marginal-cost", cfg, params)
    assert isinstance(mc, MarginalCost) and mc.scheduler == "dynamic"
    assert scenario_rule("jsq", cfg, params).name == "jsq"
    with pytest.raises(ValueError, match="unknown router 'oracle'; valid routers: .*marginal-cost"):
        scenario_rule("oracle", cfg, params)


def test_set_reads_json_and_python_spellings() -> None:
    """--set values: JSON numbers, booleans and lists (as tuples), Python's True/False/None, else strings;
    what it gives passes the scenario's own validation (padding=True is the boolean)."""
    from agents.cli import parse_settings
    from burstgym import scenarios

    got = parse_settings(
        [
            "padding=True",
            "prefix_caching=false",
            "slots=None",
            "slot_widths=[32]",
            "load=0.9",
            "power=flat",
            "speed=[1, 0.5]",
            "sleep_timeout=inf",
        ]
    )
    assert got == {
        "padding": True,
        "prefix_caching": False,
        "slots": None,
        "slot_widths": (32,),
        "load": 0.9,
        "power": "flat",
        "speed": (1, 0.5),
        "sleep_timeout": float("inf"),
    }
    scenarios.Settings(**{**got, "n_nodes": 2}).validate()
    with pytest.raises(ValueError, match="key=value"):
        parse_settings(["padding"])
