"""The evaluation modules (`evaluation/`): pooled percentiles with seed-bootstrap CIs, the paired TTFT
and hit-rate columns, the prefix-sharing axis and the families of the regime map (read from the
routers), cells whose CI includes zero left uncoloured, seeds added until CIs resolve, Ray tasks equal
to local ones, and the results folder (checked before any work, written whole, marked by its run)."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest

from agents.rollout import Episodes
from evaluation import experiments, plots, report, statistics


def test_pooled_percentile_uses_every_served_request_of_all_seeds():
    rng = np.random.default_rng(0)
    lat = rng.exponential(1.0, (8, 256))
    lat[0, :10] = np.nan  # dropped requests do not count
    lat[3] = np.nan  # an episode that served nothing
    value, half = statistics.pooled_percentile(lat, 99.0)
    assert value == pytest.approx(np.percentile(lat[np.isfinite(lat)], 99.0))
    # not the mean of per-episode p99s, which differs on 256-request episodes
    per_episode = np.nanmean([np.nanpercentile(r, 99.0) for r in lat if np.isfinite(r).any()])
    assert value != pytest.approx(per_episode, rel=1e-6)
    assert 0 < half < value


def test_pooled_percentile_ci_resamples_whole_seeds():
    # seed i serves every request in about i seconds: the pooled p99 (~9 s) is set by which seeds are
    # drawn, so a seed bootstrap is wide (a resample without seed 9 has p99 ~8 s, probability 0.35);
    # resampling single requests would give a CI of ~0.
    rng = np.random.default_rng(2)
    lat = np.arange(10.0)[:, None] + rng.normal(0.0, 0.01, (10, 100))
    value, half = statistics.pooled_percentile(lat, 99.0)
    assert value == pytest.approx(9.0, abs=0.05)
    assert half > 0.4


def _episodes(cost, ttft, hit):
    n = len(cost)
    metrics = {m: np.zeros(n) for m in statistics.METRICS}
    metrics["ttft_mean"] = np.asarray(ttft, float)
    metrics["cache_hit_rate"] = np.asarray(hit, float)
    metrics["load_share"] = np.full((n, 2), 0.5)
    lat = np.ones((n, 4))
    return Episodes(np.asarray(cost, float), metrics, lat, lat)


def test_rows_carry_paired_ttft_and_hit_rate_against_round_robin():
    res = {
        "round-robin": _episodes([10, 12, 11], [1.0, 1.2, 1.1], [0.1, 0.2, 0.15]),
        "llm-d": _episodes([9, 11, 10], [0.5, 0.7, 0.6], [0.6, 0.7, 0.65]),
    }
    rows = {r["router"]: r for r in statistics.scenario_rows("prefix", res)}
    assert rows["llm-d"]["ttft_mean_vs_rr"] == pytest.approx(-0.5)
    assert rows["llm-d"]["ttft_mean_vs_rr_ci"] == pytest.approx(0.0, abs=1e-12)  # same gap every seed
    assert rows["llm-d"]["cache_hit_rate_vs_rr"] == pytest.approx(0.5)
    assert rows["round-robin"]["ttft_mean_vs_rr"] == 0.0
    md = report.markdown(pd.DataFrame(list(rows.values())), [])
    assert "Δ TTFT vs RR" in md and "-0.500" in md


def test_regime_cells_cross_prefix_sharing_with_continuous_batching_only():
    grid = {
        "arrivals": ("poisson",),
        "prefix": ("none", "heavy"),
        "loads": (0.3, 0.7),
        "schedulers": ("continuous", "dynamic"),
    }
    cells = experiments.regime_cells(grid)
    assert ("poisson", "heavy", 0.7, "continuous") in cells
    assert all(level == "none" for _, level, _, s in cells if s == "dynamic")
    assert len(cells) == 2 * 2 + 2  # continuous x both levels, dynamic x "none"
    assert set(experiments.GRIDS["prefix"]["prefix"]) == {"none", "moderate", "heavy"}


def test_regime_matrix_leaves_cells_with_ci_including_zero_uncoloured():
    df = pd.DataFrame(
        [
            {
                "arrivals": "poisson",
                "prefix": "none",
                "load": 0.3,
                "skew_vs_balancing_pct": -3.7,
                "significant": False,
            },
            {
                "arrivals": "poisson",
                "prefix": "none",
                "load": 0.7,
                "skew_vs_balancing_pct": 2.0,
                "significant": True,
            },
            {
                "arrivals": "poisson",
                "prefix": "heavy",
                "load": 0.3,
                "skew_vs_balancing_pct": -9.0,
                "significant": True,
            },
        ]
    )
    labels, loads, z = plots.regime_matrix(df)
    assert labels == ["poisson / prefix none", "poisson / prefix heavy"] and loads == [0.3, 0.7]
    assert np.isnan(z[0, 0]) and z[0, 1] == 2.0 and z[1, 0] == -9.0 and np.isnan(z[1, 1])


REGIME_ROUTERS = (
    "round-robin",
    "jsq",
    "weighted-skew",
    "pack-load",
    "soonest-batch",
    "sglang-cache-aware",
    "llm-d",
)


def test_families_are_read_from_the_routers():
    groups = experiments.families(REGIME_ROUTERS, "continuous", "heavy")
    assert groups == {
        "balancing": ("round-robin", "jsq"),
        "batching": ("weighted-skew", "pack-load"),  # soonest-batch declares dynamic batching only
        "affinity": ("sglang-cache-aware", "llm-d"),
    }
    assert experiments.families(REGIME_ROUTERS, "dynamic", "none")["batching"][-1] == "soonest-batch"
    assert experiments.families(REGIME_ROUTERS, "continuous", "none")["affinity"] == ()


def test_regime_map_compares_affinity_routers_only_where_prefixes_are_shared(tmp_path):
    grid = {
        "arrivals": ("bursts x8",),
        "prefix": ("none", "heavy"),
        "loads": (0.7,),
        "schedulers": ("continuous",),
    }
    df = experiments.regime_map(grid, {"episode_length": 16}, [10_000, 10_001], None, routers=REGIME_ROUTERS)
    none, heavy = df.iloc[0], df.iloc[1]
    assert pd.isna(none["best_affinity"]) and none["mechanism"] == "batching"
    assert heavy["best_affinity"] in ("sglang-cache-aware", "llm-d")
    assert heavy["best_batching"] in ("weighted-skew", "pack-load")
    assert heavy["best_balancing"] in ("round-robin", "jsq")
    assert heavy["best_skew"] == heavy[f"best_{heavy['mechanism']}"]
    assert "objective[llm-d]" in df.columns and np.isnan(none["objective[llm-d]"])
    cost = {f: heavy[f"objective[{heavy[f'best_{f}']}]"] for f in ("batching", "affinity")}
    assert heavy["mechanism"] == min(cost, key=cost.get)
    plots.plot_regime(tmp_path / "regime_map.png", df)
    assert (tmp_path / "regime_map.png").stat().st_size > 1000


class _FakeRollout:
    """Episodes whose costs depend only on the seed: router "x" costs 100 + N(0, 5) more than "rr"."""

    def __init__(self):
        self.calls = []

    def run(self, routers, seeds):
        self.calls.append(list(seeds))
        noise = np.array([np.random.default_rng(s).normal(0.0, 5.0) for s in seeds])
        out = {}
        for name, cost in (("rr", np.full(len(seeds), 100.0)), ("x", 100.0 + noise)):
            out[name] = _episodes(cost, np.zeros(len(seeds)), np.zeros(len(seeds)))
        return out


def test_run_resolved_adds_new_seeds_until_the_ci_is_narrow_enough_or_the_cap():
    pairs = lambda res: [("x", "rr")]  # noqa: E731
    wide = _FakeRollout()
    res, left = experiments.run_resolved(wide, [], [0, 1, 2, 3], 40, 50.0, pairs)
    assert not left and wide.calls == [[0, 1, 2, 3]] and res["x"].cost.size == 4

    capped = _FakeRollout()
    res, left = experiments.run_resolved(capped, [], [0, 1, 2, 3], 10, 0.01, pairs)
    assert left == ["x"] and capped.calls == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    assert res["x"].cost.size == 10 and res["rr"].ttft.shape == (10, 4)

    target = _FakeRollout()  # ±5 noise on 100: a ±2% CI needs roughly 25 seeds
    res, left = experiments.run_resolved(target, [], [0, 1, 2, 3], 200, 2.0, pairs)
    _, half, _ = statistics.paired(res["x"].cost, res["rr"].cost)
    assert not left and half <= 2.0 and 8 < res["x"].cost.size < 200
    seen = [s for call in target.calls for s in call]
    assert seen == list(range(len(seen)))  # every seed once, in order


def test_ray_tasks_give_the_local_results(tmp_path):
    ray = pytest.importorskip("ray")
    try:
        _ray_equals_local(tmp_path)
    finally:  # no Ray threads stay behind in the test process (it goes on compiling with XLA)
        ray.shutdown()


def _ray_equals_local(tmp_path):
    task = dict(
        name="steady",
        settings={"episode_length": 16},
        routers=["round-robin", "least-tokens", ("sglang-cache-aware", {"cache_view": "engine"})],
        learned=None,
        seeds=[10_000, 10_001],
        max_seeds=2,
        width_pct=1.0,
    )
    ((local, _),) = experiments.run_tasks(experiments.scenario_task, [task], "scenarios", None)
    ((remote, _),) = experiments.run_tasks(experiments.scenario_task, [task], "scenarios", "local")
    assert list(local) == ["round-robin", "least-tokens", "sglang-cache-aware@engine"] == list(remote)
    for name in local:
        np.testing.assert_array_equal(local[name].cost, remote[name].cost)
    grid = {"arrivals": ("poisson",), "prefix": ("none",), "loads": (0.3,), "schedulers": ("continuous",)}
    routers = ("round-robin", "least-tokens", "pack-load")
    local = experiments.regime_map(grid, {"episode_length": 16}, [10_000, 10_001], None, routers=routers)
    remote = experiments.regime_map(
        grid, {"episode_length": 16}, [10_000, 10_001], None, ray_address="local", routers=routers
    )
    pd.testing.assert_frame_equal(local, remote)


# ----------------------------------------------------------------------------- the results folder


def test_results_folder_refuses_an_unusable_out_before_any_work(tmp_path):
    afile = tmp_path / "afile"
    afile.write_text("not a folder")
    with pytest.raises(ValueError, match="afile: exists and is not a folder"):
        report.ResultsFolder(afile)
    with pytest.raises(ValueError, match="cannot write into"):
        report.ResultsFolder(afile / "results")
    foreign = tmp_path / "mine"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("keep me")
    with pytest.raises(ValueError, match="holds files evaluate.py did not write"):
        report.ResultsFolder(foreign)
    assert (foreign / "notes.txt").read_text() == "keep me"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile", "mine"]  # no staging folder left


def test_results_folder_is_written_whole_and_replaces_the_previous_run(tmp_path):
    out = tmp_path / "results"
    first = report.ResultsFolder(out, command=["evaluate.py", "--seeds", "2"])
    first.path("old_plot.png").write_bytes(b"x")
    assert not out.exists()  # nothing in place until it is complete
    run1 = first.publish({"complete": True})
    assert (out / "old_plot.png").exists() and report.written_by(out) == run1
    assert run1["command"] == ["evaluate.py", "--seeds", "2"] and run1["finished"] >= run1["started"]
    second = report.ResultsFolder(out)
    second.path("results.md").write_text("new")
    assert (out / "old_plot.png").exists()  # the previous results stay until the new ones are whole
    run2 = second.publish({"complete": True})
    assert run2["id"] != run1["id"]
    assert sorted(p.name for p in out.iterdir()) == ["results.json", "results.md"]  # no stale file
    assert json.loads((out / "results.json").read_text())["run"]["id"] == run2["id"]
    failed = report.ResultsFolder(out)
    failed.path("results.md").write_text("half")
    failed.discard()
    assert (out / "results.md").read_text() == "new"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["results"]


def test_a_folder_of_an_earlier_evaluate_version_may_be_replaced(tmp_path):
    out = tmp_path / "results"
    out.mkdir()
    (out / "results.json").write_text(json.dumps({"complete": True, "rows": []}))
    assert report.written_by(out) == {}
    report.ResultsFolder(out).publish({"complete": True})
    assert report.written_by(out)["id"]
