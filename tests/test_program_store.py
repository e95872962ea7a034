"""burstgym.program_store: a second process compiles the rollout engine's stored programs without
tracing them and gets the same episodes; the fingerprint changes with the key, the arguments'
shapes and the code; a key it cannot fingerprint, or a damaged file, falls back to tracing."""

from __future__ import annotations

import dataclasses
import importlib
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from burstgym import program_store as ps
from burstgym import rollout as ro
from burstgym import scenarios

PROGRAM = textwrap.dedent(
    """
    import json
    import numpy as np
    from burstgym import rollout as ro, scenarios
    from agents.routers import make_rule
    traced = []
    episode_fn = ro._episode_fn
    ro._episode_fn = lambda *a: traced.append(1) or episode_fn(*a)
    cfg, params = scenarios.make("prefix", episode_length=24)
    batch = ro.rollout(cfg, params, [make_rule("round-robin"), make_rule("least-tokens")], [0, 1])
    print(json.dumps({"traced": len(traced), "objective": batch.objective.tolist(),
                      "ttft": np.nan_to_num(batch.ttft, nan=-1.0).tolist(), "node": batch.node.tolist()}))
    """
)


def _run(folder: Path) -> dict:
    """PROGRAM in a fresh process with JAX's cache (and so the store) in `folder`."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_COMPILATION", "BURSTGYM_JAX"))}
    env.update(BURSTGYM_JAX_CACHE=str(folder), JAX_PLATFORMS="cpu")
    out = subprocess.run(
        [sys.executable, "-c", PROGRAM], env=env, capture_output=True, text=True, timeout=600, check=False
    )
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_second_process_compiles_the_stored_episode_without_tracing(tmp_path: Path) -> None:
    first = _run(tmp_path)
    stored = sorted((tmp_path / ps.FOLDER).glob("*.program"))
    assert first["traced"] == 1 and len(stored) == 2  # the reset and the episode
    second = _run(tmp_path)
    assert second["traced"] == 0
    assert second["objective"] == first["objective"]
    assert second["ttft"] == first["ttft"] and second["node"] == first["node"]
    assert sorted((tmp_path / ps.FOLDER).glob("*.program")) == stored


def _args(n: int = 2) -> tuple:
    return (jnp.zeros((n, 3), jnp.float32), {"k": jnp.ones(n, jnp.int32)})


def test_fingerprint_follows_key_shapes_and_options() -> None:
    cfg, _ = scenarios.make("bursty", episode_length=16)
    base = ps.fingerprint(("x", cfg), _args(), {})
    assert ps.fingerprint(("x", cfg), _args(), {}) == base
    assert ps.fingerprint(("x", dataclasses.replace(cfg, episode_length=17)), _args(), {}) != base
    assert ps.fingerprint(("y", cfg), _args(), {}) != base
    assert ps.fingerprint(("x", cfg), _args(3), {}) != base
    assert ps.fingerprint(("x", cfg), _args(), {"xla_cpu_copy_insertion_use_region_analysis": True}) != base
    other = ps.fingerprint(("x", np.arange(1, 4)), _args(), {})
    assert ps.fingerprint(("x", np.arange(3)), _args(), {}) != other


def test_fingerprint_holds_the_packages_and_the_key_classes_code(tmp_path: Path, monkeypatch) -> None:
    package = Path(ps.__file__).parent
    code = dict(ps._code(set()))
    assert {str(p) for p in package.rglob("*.py")} <= set(code)
    module = tmp_path / "store_probe.py"
    module.write_text(
        "import dataclasses\n\n\n@dataclasses.dataclass(frozen=True)\nclass Probe:\n    a: int = 1\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    probe = importlib.import_module("store_probe")
    before = ps.fingerprint(probe.Probe(), (), {})
    module.write_text(module.read_text() + "# the traced code changed\n")
    assert ps.fingerprint(probe.Probe(), (), {}) != before
    assert str(module) in dict(ps._code({probe.Probe}))


def test_key_without_fingerprint_is_traced_and_not_stored(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(ps, "folder", lambda: tmp_path)
    with pytest.raises(ps.Unkeyable):
        ps.fingerprint(("f", lambda x: x), _args(), {})
    compiled = ps.compile_stored(("f", lambda x: x), lambda: lambda a, b: a.sum() + b["k"].sum(), _args())
    assert float(compiled(*_args())) == 2.0
    assert not list(tmp_path.glob("*"))


def test_stored_program_gives_the_same_outputs_and_checks_its_arguments(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(ps, "folder", lambda: tmp_path)

    def fn(a, b):
        return {"sum": a.sum(axis=1) + b["k"], "pair": (a * 2, None)}

    compiled = ps.compile_stored(("g",), lambda: fn, _args())
    assert isinstance(compiled, ps.StoredProgram) and len(list(tmp_path.glob("*.program"))) == 1
    again = ps.compile_stored(("g",), lambda: pytest.fail("traced again"), _args())
    out, want = again(*_args()), fn(*_args())
    assert jax.tree.structure(out) == jax.tree.structure(want)
    assert all(np.array_equal(x, y) for x, y in zip(jax.tree.leaves(out), jax.tree.leaves(want), strict=True))
    assert "HloModule" in again.as_text() and again.memory_analysis() is not None
    with pytest.raises(TypeError, match="structure"):
        again(jnp.zeros((2, 3)), jnp.ones(2, jnp.int32))


def test_damaged_file_is_reported_and_replaced(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(ps, "folder", lambda: tmp_path)
    path = tmp_path / f"{ps.fingerprint(('h',), _args(), ps.COMPILER_OPTIONS)}.program"
    path.write_bytes(b'{"format": "burstgym-program-1", "out": "leaf"}\nnot a program')
    with pytest.warns(UserWarning, match=str(path)):
        compiled = ps.compile_stored(("h",), lambda: lambda a, b: a + 1, _args())
    assert np.array_equal(compiled(*_args()), np.ones((2, 3)))
    assert json.loads(path.read_bytes().partition(b"\n")[0])["out"] == "leaf"
    assert ps._read(path) is not None


def test_episode_output_tree_round_trips() -> None:
    cfg, params = scenarios.make("prefix", episode_length=8)
    p = ro.per_cluster(params, 1)
    seeds = jnp.zeros(1, jnp.uint32)
    tree = jax.tree.structure(jax.eval_shape(ro._reset_fn(cfg), seeds, p))
    assert ps._tree(json.loads(json.dumps(ps._skeleton(tree)))) == tree
