"""evaluation.headroom: the share's Fieller interval, the table's signs, the grouping of routers by
state size, --resume, and the refusals of the command line (no episode is run here: the table's
experiment itself runs in `python -m evaluation.headroom`, docs/headroom.md)."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pandas as pd
import pytest
from scipy import stats

from agents.routers import make_rule
from evaluation.headroom import (
    BOUND,
    Case,
    against_best,
    case_file,
    cases,
    fieller,
    groups,
    kept,
    main,
    markdown,
    state_bytes,
    table_rows,
    versus_markdown,
)
from evaluation.statistics import BASELINE


def _accepted(a: np.ndarray, b: np.ndarray, grid: np.ndarray) -> np.ndarray:
    """The ratios r of `grid` that a paired t test of mean(a - r b) = 0 does not reject at 95%:
    Fieller's set, computed from its definition."""
    t = stats.t.ppf(0.975, a.size - 1)
    d = a[None, :] - grid[:, None] * b[None, :]
    se = d.std(axis=1, ddof=1) / np.sqrt(a.size)
    return np.abs(d.mean(axis=1)) <= t * se


def test_fieller_interval_is_the_set_of_ratios_a_paired_t_test_keeps():
    rng = np.random.default_rng(0)
    b = 1.0 + 0.3 * rng.standard_normal(10)
    a = 0.6 * b + 0.1 * rng.standard_normal(10)
    ratio, lo, hi = fieller(a, b)
    assert ratio == pytest.approx(a.mean() / b.mean())
    grid = np.linspace(-2.0, 3.0, 500_001)
    inside = grid[_accepted(a, b, grid)]
    assert lo < ratio < hi
    assert lo == pytest.approx(inside.min(), abs=2e-5) and hi == pytest.approx(inside.max(), abs=2e-5)


def test_fieller_is_unbounded_where_the_denominator_is_not_resolved():
    """A bound whose gain over round-robin is not resolved from zero gives no share interval."""
    rng = np.random.default_rng(1)
    b = 0.05 + rng.standard_normal(8)
    a = 0.5 * b + 0.1 * rng.standard_normal(8)
    _, lo, hi = fieller(a, b)
    assert np.isnan(lo) and np.isnan(hi)
    # the set of kept ratios is indeed not an interval: it reaches the ends of any grid
    grid = np.linspace(-1e3, 1e3, 20_001)
    kept_ratios = _accepted(a, b, grid)
    assert kept_ratios[0] or kept_ratios[-1]


def test_table_rows_signs_and_shares():
    """Gain is positive where a router's objective is below round-robin's; round-robin's share is
    0% and the bound's 100%; a router between them has a share between."""
    rr = np.array([10.0, 12.0, 11.0, 13.0])
    bound = rr - np.array([2.0, 2.2, 1.9, 2.1])
    half = rr - np.array([1.0, 1.2, 0.9, 1.0])
    worse = rr + 0.5
    objective = {BASELINE: rr, BOUND: bound, "half": half, "worse": worse}
    family = {BASELINE: "balancing", BOUND: "bound", "half": "model-based", "worse": "balancing"}
    rows = {r["router"]: r for r in table_rows("steady", objective, family)}
    assert rows[BASELINE]["gain_pct"] == 0.0 and rows[BASELINE]["share_pct"] == 0.0
    assert rows[BOUND]["share_pct"] == pytest.approx(100.0)
    assert rows[BOUND]["gain_pct"] == pytest.approx(100 * 2.05 / rr.mean())
    assert 0 < rows["half"]["share_lo_pct"] < rows["half"]["share_pct"] < rows["half"]["share_hi_pct"] < 100
    assert rows["worse"]["gain_pct"] == pytest.approx(-100 * 0.5 / rr.mean())
    assert rows["worse"]["share_pct"] < 0
    text = markdown(pd.DataFrame(list(rows.values())))
    assert text.index("| lookahead |") < text.index("| half |") < text.index("| round-robin |")
    assert "| worse | balancing | -4.35% ± 0.00 |" in text


def test_the_model_is_compared_with_the_best_other_deployable_router_and_the_best_rule():
    """The bound and the model itself are never 'the best other'; a non-rule (marginal-cost) can be
    the best deployable but not the best rule; the sign is positive where the model is cheaper."""
    rr = np.array([10.0, 12.0, 11.0, 13.0])
    objective = {
        BASELINE: rr,
        BOUND: rr - 5.0,
        "least-tokens": rr - 1.0,
        "marginal-cost": rr - 2.0,
        "mine": rr - np.array([2.2, 2.4, 2.2, 2.4]),
    }
    row = against_best("steady", objective, "mine")
    assert row["best"] == "marginal-cost" and row["best_rule"] == "least-tokens"
    assert row["best_gain_pct"] == pytest.approx(100 * 0.3 / (rr - 2.0).mean())
    assert row["best_rule_gain_pct"] == pytest.approx(100 * 1.3 / (rr - 1.0).mean())
    assert 0 < row["best_gain_ci_pct"] < row["best_gain_pct"]  # resolved: the seeds agree
    text = versus_markdown("mine", [row])
    assert "| steady | marginal-cost | +3.16% ± " in text and "| least-tokens | +12.38% ± " in text


def test_groups_keep_every_router_once_within_the_state_budget():
    routers = [make_rule(n) for n in ("round-robin", "jsq", "sglang-cache-aware", "dynamo-kv", "least-kv")]
    n_nodes, n_seeds = 4, 8
    budget = 2 * n_seeds * state_bytes(make_rule("sglang-cache-aware"), n_nodes)
    out = groups(routers, n_nodes, n_seeds, budget)
    assert sorted(r.name for g in out for r in g) == sorted(r.name for r in routers)
    for g in out:
        total = len(g) * n_seeds * sum(state_bytes(r, n_nodes) for r in g)
        assert len(g) == 1 or total <= budget
    assert len(out) > 1  # the two indexed routers do not fit one call together with the rest


def _settings() -> dict:
    return {
        "seeds": [10, 11],
        "warm_seeds": [20, 21],
        "episode_length": 8,
        "routers": [BASELINE],
        "model": None,
    }


def _write_case(folder, case: Case, settings: dict) -> None:
    objective = {BASELINE: [10.0, 12.0], "marginal-cost": [9.0, 11.5], BOUND: [8.0, 10.0]}
    family = {BASELINE: "balancing", "marginal-cost": "model-based", BOUND: "bound"}
    record = {
        "case": case.label,
        "objective": objective,
        "family": family,
        "seconds": {"rules": 1.0},
        "settings": {**settings, "case": dataclasses.asdict(case)},
    }
    case_file(folder, case).write_text(json.dumps(record))


def test_resume_keeps_only_cases_run_with_the_same_settings(tmp_path):
    steady, bursty, energy = cases(["steady", "bursty", "energy"], [], None)
    settings = _settings()
    _write_case(tmp_path, steady, settings)
    _write_case(tmp_path, bursty, {**settings, "episode_length": 16})
    assert set(kept([steady, bursty, energy], settings, tmp_path)) == {"steady"}
    case_file(tmp_path, energy).write_text('{"case": "ener')
    with pytest.raises(ValueError, match="energy.json"):
        kept([energy], settings, tmp_path)


def test_resumed_run_writes_the_table_from_the_kept_cases(tmp_path, capsys):
    (steady,) = cases(["steady"], [], None)
    (tmp_path / "cases").mkdir()
    _write_case(tmp_path / "cases", steady, _settings())
    argv = ["--scenarios", "steady", "--routers", BASELINE, "--seeds", "2", "--seed-base", "10"]
    argv += ["--warm-seed-base", "20", "--episode-length", "8", "--out", str(tmp_path), "--resume"]
    assert main(argv) == 0
    md = (tmp_path / "headroom.md").read_text()
    assert "### steady" in md and "| marginal-cost | model-based |" in md
    record = json.loads((tmp_path / "headroom.json").read_text())
    assert record["command"].startswith("python -m evaluation.headroom --scenarios steady")
    assert {r["router"] for r in record["rows"]} == {BASELINE, "marginal-cost", BOUND}
    assert "kept from" in capsys.readouterr().out


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--scenarios", "stedy"], "unknown named scenario 'stedy'"),
        (["--scenarios", "trace"], "unknown named scenario 'trace'"),
        (["--trace", "/nonexistent/trace.jsonl"], "'/nonexistent/trace.jsonl' does not exist"),
        (["--seeds", "1"], "--seeds must be >= 2"),
        (["--episode-length", "0"], "--episode-length must be >= 1"),
        (["--jobs", "0"], "--jobs must be >= 1"),
        (["--routers", "round-robin", "rr"], "unknown router 'rr'"),
    ],
)
def test_bad_arguments_are_refused_in_one_line(argv, message, tmp_path, capsys):
    assert main([*argv, "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1 and "Traceback" not in err


def test_out_that_is_a_file_is_refused(tmp_path, capsys):
    path = tmp_path / "headroom"
    path.write_text("")
    assert main(["--scenarios", "steady", "--out", str(path)]) == 2
    assert "is a file" in capsys.readouterr().err


def test_resume_with_a_model_runs_only_the_model_on_a_kept_case(tmp_path, capsys):
    """A case kept from a run without a model gains the model's column; nothing else runs again."""
    from agents.hyperparams import load
    from agents.jax_ppo import JaxPPO, PPOConfig
    from burstgym import scenarios

    (steady,) = cases(["steady"], [], None)
    (tmp_path / "cases").mkdir()
    _write_case(tmp_path / "cases", steady, _settings())
    cfg, params = scenarios.make("steady", episode_length=8)
    learner = JaxPPO(cfg, params, PPOConfig.from_entry(load("ppo", "prefix")), n_envs=2, total_timesteps=16)
    learner.setup(0)
    model = tmp_path / "model.msgpack"
    learner.save(model)
    argv = ["--scenarios", "steady", "--routers", BASELINE, "--seeds", "2", "--seed-base", "10"]
    argv += ["--warm-seed-base", "20", "--episode-length", "8", "--out", str(tmp_path), "--resume"]
    assert main([*argv, "--model", str(model), "--algo", "jax-ppo"]) == 0
    record = json.loads(case_file(tmp_path / "cases", steady).read_text())
    assert record["objective"][BASELINE] == [10.0, 12.0]  # kept, not run again
    (learned,) = set(record["objective"]) - {BASELINE, "marginal-cost", BOUND}
    assert len(record["objective"][learned]) == 2 and record["settings"]["model"] == str(model)
    assert set(record["seconds"]) == {"rules", "model"}
    assert "kept from" in capsys.readouterr().out
    (versus,) = json.loads((tmp_path / "headroom.json").read_text())["model_versus_best"]
    assert versus["case"] == "steady" and versus["best"] in {BASELINE, "marginal-cost"}
    assert f"### {learned} against the best other router" in (tmp_path / "headroom.md").read_text()
    assert main([*argv, "--model", str(model), "--algo", "jax-ppo"]) == 0  # now kept whole
    assert json.loads(case_file(tmp_path / "cases", steady).read_text()) == record
