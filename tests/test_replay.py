"""Request logs and their replay: one small log per supported format, written here from a simulated
run, read back, replayed and compared; bad input refused naming file, line (or request) and field;
fit-logs recovers known engine terms from a log and reports its held-out error."""

from __future__ import annotations

import datetime as dt
import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from burstgym import calibrate as cal
from burstgym.latency import load_profile
from burstgym.latency.engines import EngineTerms
from burstgym.latency.fitlogs import Replayer, engine_of, fit_logs, log_case
from burstgym.latency.profiles import with_engine
from burstgym.latency.replay import ReplaySettings, replay, replay_settings
from burstgym.latency.requestlog import FORMATS, ServingLog, detect_format, read_log
from burstgym.reference import RefNode, simulate

PROFILE = "h100-llama-3-8b-tp1"
N = 240
FAILED = 7  # the request that failed in every log
T0 = 1_700_000_000.0  # the client's clock at the first request (any origin)


def _truth_engine(profile_name: str = PROFILE) -> EngineTerms:
    base = load_profile(profile_name).engine_terms
    return replace(base, overhead_s=2.5e-3, frontend_s=0.011)


def _simulated_run(seed: int = 0) -> dict[str, np.ndarray]:
    """A served run as the simulator sees it: arrivals, lengths, TTFT and E2E of each request."""
    rng = np.random.default_rng(seed)
    arrival = np.cumsum(rng.exponential(1 / 12.0, N))
    arrival -= arrival[0]
    prompt = rng.integers(80, 600, N)
    output = rng.integers(8, 80, N)
    profile = with_engine(load_profile(PROFILE), engine_of(_truth_engine(), "h100"))
    node = RefNode(
        "continuous", profile.latency, max_num_seqs=64, max_num_batched_tokens=512, kv_blocks=4000,
        queue_capacity=10**9,
    )  # fmt: skip
    r = simulate([node], arrival, prompt, output, np.zeros(N, dtype=int))
    return {"arrival": arrival, "prompt": prompt, "output": output, "ttft": r.ttft, "e2e": r.e2e_latency}


def write_log(fmt: str, run: dict[str, np.ndarray], folder: Path) -> tuple[Path, Path | None]:
    """The run written in ``fmt`` (request `FAILED` failed); returns (log, truth file or None)."""
    a, p, o, t, e = (run[k] for k in ("arrival", "prompt", "output", "ttft", "e2e"))
    ok = np.arange(N) != FAILED
    if fmt == "inference-sim":
        log, truth = folder / "run.json", folder / "run_ground_truth.json"
        config = {"tensor_parallelism": 1, "max_num_seqs": 64, "max_num_batched_tokens": 512,
                  "kv_blocks_total_gpu": 4000, "block_size": 16, "num_prefix_groups": 0,
                  "users_per_group": 0, "system_prompt_len": 0}  # fmt: skip
        requests = [
            {"index": i, "arrival_time_us": round(a[i] * 1e6), "input_tokens": int(p[i]),
             "output_tokens": int(o[i]), "prefix_group": "", "has_error": not ok[i]}
            for i in range(N)
        ]  # fmt: skip
        log.write_text(json.dumps({"experiment": "test", "config": config, "requests": requests}))
        truth.write_text(
            json.dumps(
                [
                    {
                        "index": i,
                        "has_error": not ok[i],
                        "e2e_s": float(e[i]) if ok[i] else None,
                        "ttft_s": float(t[i]) if ok[i] else None,
                    }
                    for i in range(N)
                ]  # fmt: skip
            )
        )
        return log, truth
    if fmt == "vllm":
        log = folder / "vllm-bench.json"
        itls = [[float((e[i] - t[i]) / (o[i] - 1))] * int(o[i] - 1) if ok[i] else [] for i in range(N)]
        data = {
            "duration": float(a[-1] + e[-1]),
            "start_times": [T0 + float(x) for x in a],
            "input_lens": [int(x) for x in p],
            "output_lens": [int(o[i]) if ok[i] else 0 for i in range(N)],
            "ttfts": [float(t[i]) if ok[i] else 0.0 for i in range(N)],
            "itls": itls,
            "errors": ["" if ok[i] else "ClientPayloadError" for i in range(N)],
            "generated_texts": ["" for _ in range(N)],
        }
        log.write_text(json.dumps(data))
        return log, None
    if fmt == "inference-perf":
        log = folder / "per_request_lifecycle_metrics.json"
        records = []
        for i in range(N):
            start = T0 + float(a[i])
            times = [start + float(t[i]) + k * float((e[i] - t[i]) / (o[i] - 1)) for k in range(int(o[i]))]
            records.append(
                {"start_time": start, "end_time": start + float(e[i]), "request": "{}", "response": "",
                 "info": {"input_tokens": int(p[i]), "output_tokens": int(o[i]),
                          "output_token_times": times if ok[i] else []},
                 "error": None if ok[i] else {"error_type": "TimeoutError", "error_msg": ""}}
            )  # fmt: skip
        log.write_text(json.dumps(records))
        return log, None
    log = folder / "gateway.csv"
    lines = ["# gateway access log", "start_time,prompt_tokens,completion_tokens,ttft_ms,duration_ms,status"]
    for i in range(N):
        stamp = dt.datetime.fromtimestamp(T0 + float(a[i]), dt.timezone.utc).isoformat()
        status = 200 if ok[i] else 503
        lines.append(f"{stamp},{p[i]},{o[i]},{1e3 * t[i]:.6f},{1e3 * e[i]:.6f},{status}")
    log.write_text("\n".join(lines) + "\n")
    return log, None


@pytest.fixture(scope="module")
def run() -> dict[str, np.ndarray]:
    return _simulated_run()


SETTINGS = dict(max_num_seqs=64, max_num_batched_tokens=512, kv_blocks=4000)


@pytest.mark.parametrize("fmt", FORMATS)
def test_each_format_reads_back_and_replays_to_itself(fmt: str, run, tmp_path: Path) -> None:
    path, truth = write_log(fmt, run, tmp_path)
    assert detect_format(path) == fmt
    log = read_log(path, truth=truth)
    ok = np.arange(N) != FAILED
    assert log.format == fmt and len(log) == N and log.ok.tolist() == ok.tolist()
    np.testing.assert_allclose(log.arrival_s, run["arrival"], atol=1e-5)
    np.testing.assert_array_equal(log.prompt_tokens, run["prompt"])
    np.testing.assert_allclose(log.ttft_s[ok], run["ttft"][ok], atol=1e-6)
    np.testing.assert_allclose(log.e2e_s[ok], run["e2e"][ok], atol=1e-6)
    # replayed with the engine that produced it, the prediction is the measurement
    profile = with_engine(load_profile(PROFILE), engine_of(_truth_engine(), "h100"))
    settings = replay_settings(log, profile, **SETTINGS)
    summary = replay(log, profile, settings).summary()
    for metric in ("ttft", "itl", "e2e"):
        for stat in ("mean", "p50", "p90", "p99"):
            meas, pred = summary["measured"][metric][stat], summary["predicted"][metric][stat]
            assert pred == pytest.approx(meas, rel=2e-4), (fmt, metric, stat)


def test_replay_cli_prints_writes_json_and_cdf_plot(
    run, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    path, truth = write_log("inference-sim", run, tmp_path)
    out = tmp_path / "replay.json"
    cal.main(["replay", str(path), "--truth", str(truth), "--profile", PROFILE])
    assert "engine vllm-serve" in capsys.readouterr().out  # the default: served vLLM, front end included
    argv = ["replay", str(path), "--truth", str(truth), "--profile", PROFILE, "--engine", "vllm-ci"]
    cal.main([*argv, "--json", str(out)])
    printed = capsys.readouterr().out
    assert "ttft   mean" in printed and "e2e    p99" in printed and "engine vllm-ci" in printed
    data = json.loads(out.read_text())
    for side in ("measured", "predicted"):
        assert set(data[side]) == {"ttft", "itl", "e2e"}
        for metric in data[side].values():
            assert set(metric) == {"mean", "p50", "p90", "p99"} and all(v > 0 for v in metric.values())
    assert data["settings"]["kv_blocks"] == 4000 and data["log"]["succeeded"] == N - 1
    # the default engine has no front end and less overhead: it predicts a shorter TTFT than measured
    assert data["predicted"]["ttft"]["mean"] < data["measured"]["ttft"]["mean"]
    assert out.with_suffix(".png").stat().st_size > 10_000


def test_replay_settings_come_from_flags_then_log_then_vllm_defaults(run, tmp_path: Path) -> None:
    path, _ = write_log("vllm", run, tmp_path)
    log = read_log(path)
    profile = load_profile(PROFILE)
    s = replay_settings(log, profile)
    assert (s.max_num_seqs, s.max_num_batched_tokens, s.block_size) == (1024, 8192, 16)
    assert s.kv_blocks == profile.kv_capacity_tokens // 16
    s = replay_settings(log, profile, max_num_batched_tokens=1024, kv_blocks=99)
    assert (s.max_num_batched_tokens, s.kv_blocks) == (1024, 99)
    with pytest.raises(ValueError, match="max_num_seqs"):
        ReplaySettings(0, 1, 1, 1)


def _long_prompts(rate: float, n: int, seed: int = 1) -> ServingLog:
    rng = np.random.default_rng(seed)
    arrival = np.cumsum(rng.exponential(1 / rate, n))
    return ServingLog(
        "synthetic", "vllm", arrival - arrival[0], np.full(n, 1800), np.full(n, 120), np.ones(n, bool),
        np.full(n, 0.1), np.full(n, 1.0), np.full(n, -1),
    )  # fmt: skip


def _predicted(log: ServingLog, budget: int) -> dict[str, float]:
    profile = load_profile(PROFILE)
    summary = replay(log, profile, replay_settings(log, profile, max_num_batched_tokens=budget)).summary()
    return {m: summary["predicted"][m]["mean"] for m in ("ttft", "itl", "e2e")}


def test_max_num_batched_tokens_trades_ttft_for_itl_and_capacity() -> None:
    """Chunked prefill (Sarathi-Serve, Agrawal et al., OSDI 2024): a smaller token budget splits a
    long prompt's prefill over more iterations (TTFT grows) in which the running requests keep
    decoding (ITL shrinks); near saturation the extra iterations' fixed costs cut capacity, and TTFT
    grows without bound at the small budget first."""
    light = _long_prompts(6.0, 300)
    small, large = _predicted(light, 512), _predicted(light, 2048)
    assert small["ttft"] > 1.2 * large["ttft"] and small["itl"] < large["itl"]
    heavy = _long_prompts(16.0, 600)
    small, large = _predicted(heavy, 512), _predicted(heavy, 2048)
    assert small["ttft"] > 5 * large["ttft"]


def test_prefix_groups_are_served_from_the_cache(run, tmp_path: Path) -> None:
    path, truth = write_log("inference-sim", run, tmp_path)
    log = read_log(path, truth=truth)
    grouped = replace(log, prefix_group=np.arange(N) % 4, prompt_tokens=log.prompt_tokens + 256)
    profile = load_profile(PROFILE)
    shared = replay(grouped, profile, replay_settings(grouped, profile, **SETTINGS, prefix_tokens=256))
    cold = replay(grouped, profile, replay_settings(grouped, profile, **SETTINGS, prefix_tokens=0))
    assert shared.summary()["predicted"]["ttft"]["mean"] < 0.95 * cold.summary()["predicted"]["ttft"]["mean"]


BAD = {
    "inference-sim": [
        (lambda d: d["requests"][3].update(input_tokens=-4), "request 3: field 'input_tokens'"),
        (lambda d: d["requests"][5].update(arrival_time_us="soon"), "request 5: field 'arrival_time_us'"),
        (lambda d: d["requests"][2].update(has_error="no"), "request 2: field 'has_error'"),
        (lambda d: d["config"].update(max_num_seqs=0), "[config]: field 'max_num_seqs'"),
    ],
    "vllm": [
        (lambda d: d["ttfts"].__setitem__(4, -1.0), "request 4: field 'ttfts'"),
        (lambda d: d["input_lens"].__setitem__(9, 2**40), "request 9: field 'input_lens'"),
        (lambda d: d.pop("start_times"), "field 'start_times' is missing"),
        (lambda d: d["itls"].__setitem__(1, "x"), "request 1: field 'itls'"),
    ],
    "inference-perf": [
        (lambda d: d[6]["info"].update(output_token_times=[]), "request 6: field 'info.output_token_times'"),
        (lambda d: d[8].update(end_time=d[8]["start_time"] - 1), "request 8: field 'e2e'"),
        (lambda d: d[0]["info"].pop("input_tokens"), "request 0: field 'info.input_tokens'"),
    ],
}


@pytest.mark.parametrize(
    ("fmt", "case"), [(f, i) for f, cases in BAD.items() for i in range(len(cases))]
)  # fmt: skip
def test_bad_json_logs_name_file_request_and_field(fmt: str, case: int, run, tmp_path: Path) -> None:
    path, truth = write_log(fmt, run, tmp_path)
    data = json.loads(path.read_text())
    corrupt, message = BAD[fmt][case]
    corrupt(data)
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError) as err:
        read_log(path, fmt, truth)
    assert str(path) in str(err.value) and message in str(err.value), str(err.value)


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("2024-01-01T00:00:00Z,100,10,abc,200,200", "line 5: field 'ttft_ms': not a number: 'abc'"),
        ("yesterday,100,10,20,200,200", "line 5: field 'start_time'"),
        ("2024-01-01T00:00:00Z,0,10,20,200,200", "line 5: field 'prompt_tokens'"),
        ("2024-01-01T00:00:00Z,100,10,20,200,OK", "line 5: field 'status'"),
        ("2024-01-01T00:00:00Z,100,10,300,200,200", "line 5: field 'e2e'"),
        ("2024-01-01T00:00:00Z,100,10,20", "line 5: 4 fields, the header has 6"),
    ],
)
def test_bad_gateway_csv_names_file_line_and_field(line: str, message: str, tmp_path: Path) -> None:
    path = tmp_path / "gw.csv"
    header = "start_time,prompt_tokens,completion_tokens,ttft_ms,duration_ms,status"
    good = "2024-01-01T00:00:00Z,100,10,20,200,200"
    path.write_text(f"{header}\n{good}\n\n# note\n{line}\n")
    with pytest.raises(ValueError, match="gw.csv: " + message.replace("(", r"\(").replace(")", r"\)")):
        read_log(path, "gateway-csv")
    path.write_text("start_time,prompt_tokens,completion_tokens,ttft_ms\n")
    with pytest.raises(ValueError, match="line 1: missing column 'duration_ms'"):
        read_log(path, "gateway-csv")


def test_unreadable_inputs_are_named(tmp_path: Path) -> None:
    missing = tmp_path / "nope.json"
    with pytest.raises(ValueError, match="nope.json: no such file"):
        read_log(missing)
    binary = tmp_path / "log.json"
    binary.write_bytes(b"{\xff\xfe")
    with pytest.raises(ValueError, match="log.json"):
        read_log(binary)
    broken = tmp_path / "broken.json"
    broken.write_text('{"requests": [\n{"index": 0,\n')
    with pytest.raises(ValueError, match="broken.json: line 3: malformed JSON"):
        read_log(broken)
    other = tmp_path / "other.json"
    other.write_text('{"hello": 1}')
    with pytest.raises(ValueError, match="name the format with --format"):
        read_log(other)
    with pytest.raises(ValueError, match="give --truth"):
        read_log(tmp_path / "other.json", "inference-sim")
    with pytest.raises(ValueError, match="unknown log format 'csv'"):
        read_log(other, "csv")


def test_replay_cli_errors_are_one_line(run, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    path, truth = write_log("inference-sim", run, tmp_path)
    for argv, named in (
        (["--profile", "h900-x-tp1"], "unknown profile"),
        (["--profile", PROFILE, "--kv-blocks", "0"], "argument --kv-blocks"),
        (["--profile", PROFILE, "--kv-blocks", "3"], "kv_blocks of node 0 (3) cannot hold"),
        (["--profile", PROFILE, "--json", str(tmp_path / "no" / "x.json")], "does not exist"),
    ):
        with pytest.raises(SystemExit) as exit_info:
            cal.main(["replay", str(path), "--truth", str(truth), *argv])
        assert exit_info.value.code == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and named in err, err


@pytest.mark.slow
def test_fit_logs_recovers_known_terms_with_held_out_error(run, tmp_path: Path) -> None:
    """A log simulated with overhead 2.5 ms and a front end of 11 ms: fitted from the default
    engine's terms, both come back within 5% (a replay's mean latencies are piecewise constant in
    the terms: a small change reorders queueing events), and the tool's own held-out error is small."""
    path, truth = write_log("inference-sim", run, tmp_path)
    log = read_log(path, truth=truth)
    profile = load_profile(PROFILE)
    case = log_case(log, profile, replay_settings(log, profile), 4)
    engine, report = fit_logs([case], ("overhead_s", "frontend_s"), jobs=1, log=lambda _: None)
    terms = engine.gpus["h100"]
    assert terms.overhead_s == pytest.approx(2.5e-3, rel=0.05)
    assert terms.frontend_s == pytest.approx(0.011, rel=0.05)
    fold = report["cross_validation"]["folds"][0]
    assert "second half" in fold["held_out"]
    assert all(abs(e) < 0.02 for e in fold["error"].values()), fold
    # the CLI writes a profile the simulator takes, and the engine
    out, eng = tmp_path / "mine.json", tmp_path / "mine-engine.json"
    flags = ["--engine", "vllm-ci", "--fit", "overhead_s,frontend_s", "--jobs", "1", "--no-cv"]
    cal.main(
        ["fit-logs", str(path), "--profile", PROFILE, *flags, "--out", str(out), "--engine-out", str(eng)]
    )
    mine = load_profile(out)
    assert float(mine.latency.frontend_s) == pytest.approx(0.011, rel=0.05)
    assert load_profile(PROFILE, engine=eng).engine == "fitted"
    import gymnasium as gym

    import burstgym  # noqa: F401  (registers the environment)

    env = gym.make("BurstBalance-v0", profile=str(out), n_nodes=2, episode_length=16)
    env.reset(seed=0)
    env.step(env.action_space.sample())


def test_fit_logs_refuses_what_it_cannot_fit(run, tmp_path: Path) -> None:
    path, truth = write_log("inference-sim", run, tmp_path)
    log = read_log(path, truth=truth)
    profile = load_profile(PROFILE)
    case = log_case(log, profile, replay_settings(log, profile), 4)
    with pytest.raises(ValueError, match="cannot fit engine term 'overhead_ms'"):
        fit_logs([case], ("overhead_ms",), jobs=1, log=lambda _: None)
    other = log_case(log, load_profile("a100-llama-3-8b-tp1"), replay_settings(log, profile), 4)
    with pytest.raises(ValueError, match="different GPUs"):
        fit_logs([case, other], ("overhead_s",), jobs=1, log=lambda _: None)
    with pytest.raises(ValueError, match="windows must be a positive integer"):
        log_case(log, profile, replay_settings(log, profile), 0)
    assert Replayer(1)([(case, profile.engine_terms)])[0][0].shape == (N,)
