"""The inference-sim (BLIS) runs: reading a checkout's layout (a small one written here), what the
replay takes from each run's client profile, the validation table; and, where the real checkout is
present ($BURSTGYM_BLIS_DATA), the facts about it the docs state."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest

from burstgym.latency import blis
from burstgym.latency.requestlog import read_inference_sim

RUN = "20990101-000000-llama-2-7b-tp1-codegen"


def _checkout(root: Path, n: int = 200) -> Path:
    """A miniature inference-sim/training checkout with one two-stage run."""
    rng = np.random.default_rng(0)
    arrival = np.sort(rng.uniform(0, 60, n))
    (root / "replay_data").mkdir(parents=True)
    (root / "default_args" / RUN).mkdir(parents=True)
    config = {"tensor_parallelism": 1, "max_num_seqs": 128, "max_num_batched_tokens": 2048,
              "kv_blocks_total_gpu": 7462, "block_size": 16, "num_prefix_groups": 0, "users_per_group": 0,
              "system_prompt_len": 0}  # fmt: skip
    requests = [
        {"index": i, "arrival_time_us": int(a * 1e6), "input_tokens": 590,
         "output_tokens": int(rng.integers(0, 250)), "prefix_group": "", "has_error": False}
        for i, a in enumerate(arrival)
    ]  # fmt: skip
    data = {"experiment": RUN, "model_id": "meta-llama/Llama-2-7b-hf", "config": config, "requests": requests}
    (root / "replay_data" / f"{RUN}.json").write_text(json.dumps(data))
    truth = [{"index": i, "has_error": False, "ttft_s": 0.03, "e2e_s": 2.0} for i in range(n)]
    (root / "replay_data" / f"{RUN}_ground_truth.json").write_text(json.dumps(truth))
    profile = {
        "api": {"streaming": True, "type": "completion"},
        "data": {"type": "shared_prefix", "shared_prefix": {"num_unique_system_prompts": 11,
                 "num_users_per_system_prompt": 4, "output_len": 247, "question_len": 466,
                 "system_prompt_len": 100, "enable_multi_turn_chat": True}},
        "load": {"stages": [{"duration": 30, "rate": 2}, {"duration": 30, "rate": 4}], "type": "constant"},
        "server": {"ignore_eos": True, "type": "vllm"},
    }  # fmt: skip
    (root / "default_args" / RUN / "profile.yaml").write_text(json.dumps(profile))
    return root


def test_a_run_takes_output_length_and_system_prompts_from_its_client_profile(tmp_path: Path) -> None:
    root = _checkout(tmp_path)
    assert blis.run_names(root) == [RUN]
    run = blis.load_run(root, RUN)
    assert (run.model, run.tp, run.profile_name) == ("llama-2-7b", 1, "h100-llama-2-7b-tp1")
    assert run.fitted and not run.saturated and run.workload == "codegen"
    assert (run.log.output_tokens == 247).all() and run.output_len == 247
    assert run.log.server.system_prompt_tokens == 100 and run.log.prefix_group.max() == 10
    assert run.stages == ((2.0, 30.0), (4.0, 30.0))
    stage = run.stage()
    assert (stage[run.log.arrival_s < 30] == 0).all() and (stage[run.log.arrival_s >= 30] == 1).all()
    case = run.case()
    assert set(np.unique(case.window)) <= {-1, 0, 1, 2, 3}
    assert case.settings.kv_blocks == 7462 and case.settings.prefix_tokens == 100
    short = run.case(seconds_per_stage=10)
    assert len(short.log) < len(run.log) and (short.log.arrival_s % 30 < 10 + 1e-9).all()


def test_refused_runs_are_named(tmp_path: Path) -> None:
    root = _checkout(tmp_path)
    data = json.loads((root / "replay_data" / f"{RUN}.json").read_text())
    data["model_id"] = "org/unknown"
    (root / "replay_data" / f"{RUN}.json").write_text(json.dumps(data))
    with pytest.raises(ValueError, match="field 'model_id'"):
        blis.load_run(root, RUN)
    with pytest.raises(ValueError, match="no replay_data/ folder"):
        blis.run_names(tmp_path / "nowhere")


@pytest.mark.parametrize(
    "which, change, message",
    [
        ("requests", lambda r: r.__setitem__(3, 7), "{req}: request 3: expected an object"),
        (
            "requests",
            lambda r: r[4].__setitem__("index", 2),
            "{req}: request 4: field 'index': 2 appears twice",
        ),
        (
            "truth",
            lambda r: r[5].__setitem__("index", 1),
            "{truth}: request 5: field 'index': 1 appears twice",
        ),
        ("truth", lambda r: r.__setitem__(0, []), "{truth}: request 0: expected an object"),
        (
            "requests",
            lambda r: r[6].__setitem__("index", 999),
            "{req}: request 6: field 'index': 999 has no entry in {truth}",
        ),
        ("requests", lambda r: r.pop(), "{truth}: request index 199 is not in {req}"),
    ],
)
def test_inference_sim_records_are_refused_by_file_and_request(
    tmp_path: Path, which, change, message
) -> None:
    """Each list of the replay format (the requests and the measured latencies) is read by one
    reader that names the file, the record's position and the field it refuses."""
    folder = _checkout(tmp_path) / "replay_data"
    req, truth = folder / f"{RUN}.json", folder / f"{RUN}_ground_truth.json"
    data = json.loads(req.read_text())
    if which == "requests":
        change(data["requests"])
        req.write_text(json.dumps(data))
    else:
        records = json.loads(truth.read_text())
        change(records)
        truth.write_text(json.dumps(records))
    with pytest.raises(ValueError) as refused:
        read_inference_sim(req, truth)
    assert str(refused.value) == message.format(req=req, truth=truth)


def test_validation_table_has_a_row_per_run_and_the_held_out_medians(tmp_path: Path) -> None:
    root = _checkout(tmp_path)
    rows = blis.validate_runs(root, "vllm-ci", jobs=1)
    text = blis.table(rows)
    assert "| llama-2-7b-tp1-codegen | fitted |" in text and "median / worst, fitted (1 runs)" in text
    assert rows[0]["measured"]["e2e"] == pytest.approx(2.0) and rows[0]["blis"] is None
    # a held-out run gets its own median row
    held = [dict(rows[0], fitted=False)]
    assert "held out, unsaturated (1 runs)" in blis.table(held)


DATA = os.environ.get("BURSTGYM_BLIS_DATA")
needs_blis = pytest.mark.skipif(
    not DATA or not (Path(DATA) / "replay_data").is_dir(),
    reason="$BURSTGYM_BLIS_DATA (a checkout of inference-sim/training at ab8e76b) is not set",
)


@needs_blis
def test_the_checkout_holds_what_the_docs_say() -> None:
    runs = blis.load_runs(DATA)
    assert len(runs) == 16
    roles = {(r.model, r.saturated) for r in runs}
    assert sum(r.fitted and not r.saturated for r in runs) == 6
    assert sum(not r.fitted and not r.saturated for r in runs) == 6
    assert {r.workload for r in runs if r.saturated} == {"reasoning"}
    assert ("mixtral-8x7b", False) in roles
    # the client's recorded output counts are short for a third of Llama-2-7B codegen's requests,
    # whose decode time equals the full-length requests'
    name = "20260217-155451-llama-2-7b-tp1-codegen"
    raw = read_inference_sim(Path(DATA) / "replay_data" / f"{name}.json",
                             Path(DATA) / "replay_data" / f"{name}_ground_truth.json")  # fmt: skip
    short = raw.output_tokens < 0.9 * 247
    assert 0.3 < short.mean() < 0.4
    decode = raw.e2e_s - raw.ttft_s
    assert np.mean(decode[short]) == pytest.approx(np.mean(decode[~short]), rel=0.02)


@needs_blis
def test_replaying_a_run_reproduces_the_shipped_engines_report() -> None:
    """One run replayed now gives the errors recorded with the vllm-serve engine (and docs/latency.md)."""
    from burstgym.latency import load_engine

    name = "20260217-162547-llama-2-7b-tp1-roleplay"
    [row] = blis.validate_runs(DATA, "vllm-serve", jobs=1, runs=[blis.load_run(DATA, name)])
    [recorded] = [r for r in load_engine("vllm-serve").provenance["report"]["runs"] if r["run"] == name]
    for metric in ("ttft", "itl", "e2e"):
        assert row["error"][metric] == pytest.approx(recorded["error"][metric], abs=1e-3)
