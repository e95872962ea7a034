"""Runs are never lost or mixed, model files never run code, and bad files are refused in one line:
train.py's run directory, config.json, resuming, SIGINT / SIGTERM and checkpoints; loading SB3 and
jax-ppo models and their statistics without unpickling; the environment alone without the
training stack."""

from __future__ import annotations

import base64
import json
import os
import pickle
import signal
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import numpy as np
import pytest
from conftest import load_script

ROOT = Path(__file__).resolve().parents[1]


def one_line(text: str) -> str:
    """The single line of a message (fails if there is more than one)."""
    lines = text.strip().splitlines()
    assert len(lines) == 1, text
    return lines[0]


class Touch:
    """A pickle that creates a file when it is loaded: what a crafted model file can carry."""

    def __init__(self, path: Path):
        self.path = path

    def __reduce__(self):
        return (Path.touch, (Path(self.path),))


def armed(path: Path) -> bytes:
    """A malicious pickle, checked to work: loading it with pickle creates `path`."""
    payload = pickle.dumps(Touch(path))
    pickle.loads(payload)
    assert path.exists()
    path.unlink()
    return payload


# ------------------------------------------------------------------------------ a saved model


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    """A small PPO model saved as train.py saves it: model.zip, vecnormalize.json, config.json."""
    from agents.hyperparams import load
    from agents.learners import make_model, normalize_env, save_normalization
    from agents.runs import write_config
    from agents.sb3_vec_env import JaxVecEnv

    run = tmp_path_factory.mktemp("run")
    env = normalize_env(JaxVecEnv(2, "steady", seed=0, episode_length=16), {"norm_reward": False})
    entry = {**load("ppo", "steady"), "n_steps": 16, "batch_size": 32}
    model = make_model("ppo", env, "steady", seed=0, tensorboard_log=None, entry=entry)
    model.learn(32)
    model.save(run / "model.zip")
    save_normalization(env, run / "vecnormalize.json")
    settings = {"episode_length": 16}
    write_config(run, {"algo": "ppo", "scenario": "steady", "settings": settings, "hyperparams": entry})
    obs = env.get_original_obs()
    np.save(run / "obs.npy", obs)
    np.save(run / "actions.npy", model.predict(env.normalize_obs(obs), deterministic=True)[0])
    env.close()
    return run


def copy_run(saved: Path, to: Path) -> Path:
    import shutil

    shutil.copytree(saved, to)
    return to


def test_a_model_loads_as_data_and_acts_as_trained(saved):
    """The weights are read with torch.load(weights_only=True) into a network rebuilt from
    config.json, the statistics from JSON; the router takes the trained policy's actions."""
    from agents.learners import load_router

    router = load_router(saved / "model.zip", "ppo", require_normalization=True)
    obs = np.load(saved / "obs.npy")
    np.testing.assert_array_equal(router(obs), np.load(saved / "actions.npy"))
    assert router.model.num_timesteps >= 32


def test_a_model_saved_with_the_earlier_layer_names_loads_and_acts_as_trained(saved, tmp_path):
    """Models saved before the network was shared (`agents.model`) name their layers
    mlp_extractor.score.<i>, mlp_extractor.value.<i> and value_net; they load with and without
    SB3's own loader and take the actions they took."""
    import io
    import zipfile

    import torch

    from agents.learners import load_router

    old = {
        "layers.score_0": "score.0",
        "layers.score_1": "score.2",
        "layers.score_out": "score.4",
        "layers.value_0": "value.0",
        "layers.value_1": "value.2",
    }
    run = copy_run(saved, tmp_path / "run")
    with zipfile.ZipFile(saved / "model.zip") as z:
        files = {name: z.read(name) for name in z.namelist()}
    state = torch.load(io.BytesIO(files["policy.pth"]), weights_only=True)
    renamed = {}
    for key, value in state.items():
        for new_name, old_name in old.items():
            key = key.replace(f"mlp_extractor.{new_name}.", f"mlp_extractor.{old_name}.")
        renamed[key.replace("mlp_extractor.layers.value_out.", "value_net.")] = value
    assert "value_net.weight" in renamed and "mlp_extractor.score.4.bias" in renamed
    buffer = io.BytesIO()
    torch.save(renamed, buffer)
    files["policy.pth"] = buffer.getvalue()
    with zipfile.ZipFile(run / "model.zip", "w") as z:
        for name, content in files.items():
            z.writestr(name, content)
    obs = np.load(saved / "obs.npy")
    for allow_pickle in (False, True):
        router = load_router(run / "model.zip", "ppo", allow_pickle=allow_pickle)
        np.testing.assert_array_equal(router(obs), np.load(saved / "actions.npy"))


def test_a_crafted_model_zip_runs_no_code(saved, tmp_path):
    """SB3's model.zip keeps cloudpickled entries in its `data` JSON and torch pickles in its .pth
    files; a crafted one ran a shell command when evaluate.py --model loaded it. Loading never
    unpickles `data`, and refuses a policy.pth that holds anything but tensors, in one line."""
    from agents.learners import load_router

    marker = tmp_path / "pwned"
    run = copy_run(saved, tmp_path / "run")
    path = run / "model.zip"
    with zipfile.ZipFile(saved / "model.zip") as z:
        parts = {name: z.read(name) for name in z.namelist()}
    data = json.loads(parts["data"])
    data["policy_class"][":serialized:"] = base64.b64encode(armed(marker)).decode()
    data["observation_space"][":serialized:"] = base64.b64encode(armed(marker)).decode()
    parts["data"] = json.dumps(data).encode()
    with zipfile.ZipFile(path, "w") as z:
        for name, blob in parts.items():
            z.writestr(name, blob)
    router = load_router(path, "ppo")  # the cloudpickled entries are never decoded
    assert not marker.exists() and router.model.policy is not None

    import torch

    evil = tmp_path / "policy.pth"
    torch.save(Touch(marker), evil)
    parts["policy.pth"] = evil.read_bytes()
    with zipfile.ZipFile(path, "w") as z:
        for name, blob in parts.items():
            z.writestr(name, blob)
    with pytest.raises(ValueError) as e:
        load_router(path, "ppo")
    assert not marker.exists()
    message = one_line(str(e.value))
    assert message.startswith(str(path)) and "policy.pth holds objects other than tensors" in message
    assert "allow_pickle" in message


def test_evaluate_refuses_a_crafted_model_in_one_line_and_runs_nothing(saved, tmp_path, capsys):
    """evaluate.py --model with statistics only a pickle holds (a crafted vecnormalize.pkl): refused
    without unpickling, in one line naming the file and the opt-in flag; nothing is written."""
    marker = tmp_path / "pwned"
    run = copy_run(saved, tmp_path / "run")
    (run / "vecnormalize.json").unlink()
    (run / "vecnormalize.pkl").write_bytes(armed(marker))
    out = tmp_path / "results"
    argv = ["--model", str(run / "model.zip"), "--scenarios", "steady", "--regime-grid", "none"]
    code = load_script("evaluate").main([*argv, "--seeds", "2", "--max-seeds", "2", "--out", str(out)])
    assert code == 2 and not marker.exists() and not out.exists()
    message = one_line(capsys.readouterr().err)
    assert "vecnormalize.pkl: a pickle, not loaded" in message and "--allow-pickle" in message


def test_evaluate_refuses_a_broken_run_configuration_naming_it(saved, tmp_path, capsys):
    run = copy_run(saved, tmp_path / "run")
    (run / "config.json").write_text('{"algo": "ppo", "scenario": ')
    out = tmp_path / "results"
    code = load_script("evaluate").main(["--model", str(run / "model.zip"), "--out", str(out)])
    assert code == 2 and not out.exists()
    message = one_line(capsys.readouterr().err)
    assert f"{run.resolve() / 'config.json'}: not valid JSON" in message


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"policy": "os.system"}, "not one of agents.policies"),
        ({"policy": "agents.heuristics.RoundRobin"}, "not one of agents.policies"),
        ({"policy_kwargs": "dict(net_arch=[64, 64])"}, "would be evaluated"),
    ],
)
def test_a_run_configuration_cannot_import_or_evaluate_code(saved, tmp_path, change, match):
    """The network is rebuilt from config.json, so its hyperparameters may name only the project's
    policies and hold no strings to evaluate (rl-zoo3's files may; the user's own file is trusted)."""
    from agents.learners import load_router
    from agents.runs import read_config, write_config

    run = copy_run(saved, tmp_path / "run")
    config = read_config(run)
    config["hyperparams"].update(change)
    write_config(run, config)
    with pytest.raises(ValueError, match=match) as e:
        load_router(run / "model.zip", "ppo")
    assert one_line(str(e.value)).startswith(str(run / "config.json"))


@pytest.mark.parametrize(
    ("name", "damage", "match"),
    [
        ("model.zip", lambda b: b[: len(b) // 2], "not a readable SB3 model file"),
        ("model.zip", lambda b: b"", "not a readable SB3 model file"),
        ("vecnormalize.json", lambda b: b[: len(b) // 2], "not readable normalisation statistics"),
        ("vecnormalize.json", lambda b: b'{"format": "x"}', "not normalisation statistics"),
        ("config.json", lambda b: b[: len(b) // 2], "not valid JSON"),
        ("config.json", lambda b: b"[1, 2]", "expected a JSON object"),
    ],
)
def test_damaged_files_are_refused_in_one_line_naming_the_file(saved, tmp_path, name, damage, match):
    """A truncated model.zip raised AssertionError / BadZipFile, truncated statistics
    UnpicklingError / EOFError, a broken config.json an error without its name."""
    from agents.learners import load_router

    run = copy_run(saved, tmp_path / "run")
    (run / name).write_bytes(damage((run / name).read_bytes()))
    with pytest.raises(ValueError) as e:
        load_router(run / "model.zip", "ppo")
    message = one_line(str(e.value))
    assert message.startswith(str(run / name)) and match in message


def test_a_pickled_model_needs_the_opt_in(saved, tmp_path):
    """Without a burstgym run configuration the network cannot be rebuilt from data: refused unless
    allow_pickle, which uses SB3's own loader."""
    from agents.learners import load_router

    run = copy_run(saved, tmp_path / "run")
    (run / "config.json").unlink()
    with pytest.raises(ValueError, match="no config.json .* allow_pickle=True") as e:
        load_router(run / "model.zip", "ppo")
    one_line(str(e.value))
    router = load_router(run / "model.zip", "ppo", allow_pickle=True)
    np.testing.assert_array_equal(router(np.load(run / "obs.npy")), np.load(saved / "actions.npy"))


def test_jax_checkpoints_are_data_and_damaged_ones_are_refused(tmp_path):
    """A jax-ppo checkpoint is flax msgpack: arrays (numeric dtypes only) and plain values. Damaged,
    foreign or object-typed content is refused in one line naming the file."""
    import flax.serialization
    import jax

    from agents.jax_ppo import init_variables, load_checkpoint, save_checkpoint

    params = jax.device_get(init_variables(jax.random.key(0), 2, 8))
    good = tmp_path / "good.msgpack"
    save_checkpoint(good, params, None, 8)
    ck = load_checkpoint(good)
    assert (ck.n_nodes, ck.hidden, ck.stats, ck.train) == (2, 8, None, None)
    blob = good.read_bytes()
    cases = {
        "truncated": (blob[: len(blob) // 2], "not a jax-ppo checkpoint"),
        "foreign": (flax.serialization.msgpack_serialize({"a": 1}), "not a jax-ppo checkpoint"),
        "wrong shape": (
            flax.serialization.msgpack_serialize(
                {"params": jax.tree.map(lambda x: np.zeros(x.shape + (1,), x.dtype), params), "hidden": 8}
            ),
            "params",
        ),
    }
    for name, (content, match) in cases.items():
        path = tmp_path / f"{name}.msgpack"
        path.write_bytes(content)
        with pytest.raises(ValueError) as e:
            load_checkpoint(path)
        message = one_line(str(e.value))
        assert message.startswith(str(path)) and match in message, name
    # an array whose dtype asks for Python objects: numpy refuses to build it from bytes
    blob = flax.serialization.msgpack_serialize({"params": params, "hidden": 8})
    obj = blob.replace(b"float32", b"O,f4,f4", 1)
    path = tmp_path / "object.msgpack"
    path.write_bytes(obj)
    with pytest.raises(ValueError, match="not a jax-ppo checkpoint"):
        load_checkpoint(path)


# ------------------------------------------------------------------------------------ train.py


def test_a_run_directory_that_holds_anything_is_never_written_into(tmp_path, capsys, monkeypatch):
    """Re-running train.py with an existing run name replaced model.zip and config.json beside the
    old best model and checkpoints; now it is refused in one line, the old files untouched, before
    any of the mixture's scenarios is built (seconds each)."""
    run = tmp_path / "mixture-ppo-seed0"  # the default run's directory
    run.mkdir()
    (run / "config.json").write_text('{"status": "finished"}')
    (run / "model.zip").write_bytes(b"old")
    train = load_script("train")

    def built(*args, **kwargs):
        raise AssertionError("a scenario was built before the run directory was checked")

    monkeypatch.setattr(train.scenarios, "make", built)
    code = train.main(["--episode-length", "16", "--out", str(tmp_path), "--no-progress"])
    assert code == 2
    message = one_line(capsys.readouterr().err)
    assert f"run directory '{run}' holds a run" in message and f"--resume {run / 'model.zip'}" in message
    assert (run / "config.json").read_text() == '{"status": "finished"}'
    assert (run / "model.zip").read_bytes() == b"old"


@pytest.mark.parametrize(
    ("config", "match"),
    [
        (None, "has no config.json"),
        ("{not json", "config.json: not valid JSON"),
        ('{"algo": "ppo"}', "config.json: no 'scenario'"),
    ],
)
def test_resume_refuses_a_checkpoint_whose_run_it_cannot_read(tmp_path, capsys, config, match):
    """Without the run's config.json a resumed run fell back to the hyperparameter file's task
    (another scenario, episode length and cluster count, silently); now it is refused."""
    old = tmp_path / "runs" / "steady-ppo-seed0"
    (old / "checkpoints").mkdir(parents=True)
    checkpoint = old / "checkpoints" / "rl_model_64_steps.zip"
    checkpoint.write_bytes(b"PK")
    if config is not None:
        (old / "config.json").write_text(config)
    code = load_script("train").main(["--resume", str(checkpoint), "--out", str(tmp_path / "runs")])
    assert code == 2
    assert match in one_line(capsys.readouterr().err)
    assert sorted(p.name for p in (tmp_path / "runs").iterdir()) == ["steady-ppo-seed0"]


@pytest.mark.parametrize("algo, name", [("ppo", "rl_model_64_steps.zip"), ("jax-ppo", "model.msgpack")])
def test_resume_from_a_damaged_checkpoint_creates_no_run(tmp_path, capsys, algo, name):
    """A checkpoint that cannot be read is refused in one line naming it, before the resumed run's
    directory exists: a failed --resume leaves no half-made run behind."""
    from agents.hyperparams import load

    old = tmp_path / "runs" / f"steady-{algo}-seed0"
    checkpoint = old / ("checkpoints" if name.startswith("rl_model") else "") / name
    checkpoint.parent.mkdir(parents=True)
    checkpoint.write_bytes(b"PK\x03\x04 truncated")
    config = {
        "algo": algo,
        "scenario": "steady",
        "settings": {"episode_length": 16},
        "seed": 0,
        "n_envs": 2,
        "stagger": True,
        "hyperparams": load("ppo", "steady"),
        "normalize": None,
        "conf_file": "agents/hyperparams.yml",
    }
    (old / "config.json").write_text(json.dumps(config))
    code = load_script("train").main(["--resume", str(checkpoint), "--out", str(tmp_path / "runs")])
    assert code == 2
    message = one_line(capsys.readouterr().err)
    assert str(checkpoint) in message
    assert ("not a readable SB3 model" if algo == "ppo" else "not a jax-ppo checkpoint") in message
    assert sorted(p.name for p in (tmp_path / "runs").iterdir()) == [old.name]


def test_checkpoints_come_at_least_every_tenth_of_the_budget(tmp_path):
    from agents.runs import Checkpoints, Run

    run = Run(tmp_path, {})
    assert Checkpoints(run, 32_768, 20_000, 0, "zip").every == 2_000  # none before: 32,768 > 20k
    assert Checkpoints(run, 1_000, 20_000, 0, "zip").every == 1_000
    assert Checkpoints(run, 0, 65_536, 0, "zip").every == 6_554
    resumed = Checkpoints(run, 0, 1_000, 5_000, "zip")
    assert not resumed.due(5_099) and resumed.due(5_100)


def _wait_for(predicate, proc: subprocess.Popen, seconds: float) -> None:
    deadline = time.time() + seconds
    while not predicate():
        assert proc.poll() is None, proc.communicate()
        assert time.time() < deadline, "timed out"
        time.sleep(0.5)


@pytest.mark.slow
def test_sigint_saves_the_run_and_resume_continues_its_task(tmp_path):
    """The issue's run (steady, load 0.8, 64-request episodes, 16 clusters, 20k steps): config.json
    holds its task while it runs (so a kill cannot lose it), a checkpoint comes within a tenth of
    the budget, Ctrl-C saves model, statistics and config and exits 130 with one line (it was a
    113-line traceback and nothing saved), and --resume of the checkpoint trains the same task."""
    out = tmp_path / "runs"
    task = ["--scenario", "steady", "--load", "0.8", "--episode-length", "64", "--n-envs", "16"]
    cmd = [sys.executable, str(ROOT / "train.py"), *task, "--timesteps", "20000", "--eval-every", "0"]
    cmd += ["--bc-steps", "64", "--out", str(out), "--no-progress"]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    run = out / "steady-ppo-seed0"
    try:
        _wait_for(lambda: (run / "config.json").is_file(), proc, 240)
        started = json.loads((run / "config.json").read_text())
        assert started["status"] == "running" and started["settings"] == {"episode_length": 64, "load": 0.8}
        _wait_for(lambda: list((run / "checkpoints").glob("*_steps.zip")), proc, 240)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 128 + signal.SIGINT, err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 2, err  # the notice, the last word
    assert "stopped at" in err.splitlines()[-1] and "--resume" in err.splitlines()[-1]
    config = json.loads((run / "config.json").read_text())
    assert config["status"] == "interrupted" and 0 < config["timesteps"] < 20_000
    assert (run / "model.zip").is_file() and (run / "vecnormalize.json").is_file()
    first = min((run / "checkpoints").glob("*_steps.zip"), key=lambda p: int(p.stem.split("_")[2]))
    assert int(first.stem.split("_")[2]) <= 2_000  # a tenth of the budget

    cmd = [sys.executable, str(ROOT / "train.py"), "--resume", str(first), "--timesteps", "16"]
    resumed = subprocess.run(
        [*cmd, "--eval-every", "0", "--out", str(out), "--no-progress"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert resumed.returncode == 0, resumed.stderr
    again = json.loads((out / "steady-ppo-seed0-resumed" / "config.json").read_text())
    for key in ("algo", "scenario", "settings", "seed", "n_envs", "hyperparams", "normalize"):
        assert again[key] == config[key], key
    assert again["resumed_from"] == str(first) and again["timesteps"] > again["resumed_at"] > 0


def test_sigterm_saves_a_jax_ppo_run_and_resume_continues_it(tmp_path, monkeypatch, capsys):
    """jax-ppo: SIGTERM after the first update saves model.msgpack (with its optimiser state) and
    config.json, exit status 143; --resume continues from the saved step count."""
    import agents.jax_ppo as jax_ppo

    update = jax_ppo.JaxPPO.update

    def update_then_sigterm(self):
        logs = update(self)
        os.kill(os.getpid(), signal.SIGTERM)
        return logs

    monkeypatch.setattr(jax_ppo.JaxPPO, "update", update_then_sigterm)
    out = tmp_path / "runs"
    argv = ["--algo", "jax-ppo", "--scenario", "steady", "--episode-length", "16", "--n-envs", "4"]
    argv += ["--eval-every", "0"]
    argv += ["--bc-teacher", "none", "--out", str(out), "--no-progress"]
    train = load_script("train")
    assert train.main([*argv, "--timesteps", "1024"]) == 128 + signal.SIGTERM
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and "SIGTERM: stopped at 128 of 1,024 steps" in err[-1], err
    run = out / "steady-jax-ppo-seed0"
    config = json.loads((run / "config.json").read_text())
    assert (config["status"], config["timesteps"]) == ("interrupted", 128)
    ck = jax_ppo.load_checkpoint(run / "model.msgpack")
    assert ck.num_timesteps == 128 and ck.optimizer_steps > 0
    monkeypatch.setattr(jax_ppo.JaxPPO, "update", update)
    # the same budget and settings: the resumed run reuses the compiled update
    resume = ["--resume", str(run / "model.msgpack"), "--timesteps", "1024", "--no-progress"]
    assert train.main([*resume, "--eval-every", "0", "--out", str(out)]) == 0
    again = json.loads((out / "steady-jax-ppo-seed0-resumed" / "config.json").read_text())
    assert (again["status"], again["resumed_at"], again["timesteps"]) == ("finished", 128, 1152)
    assert again["settings"] == config["settings"] and again["n_envs"] == 4


# ------------------------------------------------------------------------ the environment alone


def test_the_environment_needs_none_of_the_training_stack():
    """`import burstgym; gym.make(...)` and a step import no torch, SB3, pandas, matplotlib, flax,
    optax or yaml: what `pip install burstgym` (without [train]) provides is enough."""
    code = (
        "import sys, gymnasium as gym, burstgym\n"
        "env = gym.make('BurstBalance-v0', scenario='steady', episode_length=8)\n"
        "env.reset(seed=0); env.step(0)\n"
        "heavy = {'torch', 'stable_baselines3', 'sb3_contrib', 'pandas', 'matplotlib', 'flax', 'optax',\n"
        "         'yaml', 'tensorboard', 'rich', 'tqdm'}\n"
        "print(sorted(heavy & {m.split('.')[0] for m in sys.modules}))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().splitlines()[-1] == "[]"
