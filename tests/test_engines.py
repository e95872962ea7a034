"""Engine calibrations: loading and errors, how an engine enters the coefficients, the shipped
calibrations' provenance, and their held-out errors on the end-to-end data they were not fitted to."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from burstgym.latency import (
    DEFAULT_ENGINE,
    EngineTerms,
    apply_engine,
    compose_kernels,
    compose_latency_model,
    list_engines,
    list_profiles,
    load_engine,
    load_model_config,
    load_profile,
)
from burstgym.latency.engines import ENGINES_DIR, engine_from_dict
from burstgym.latency.sources import data_dir

ROOT = data_dir()
needs_data = pytest.mark.skipif(
    not (ROOT / "splitwise").is_dir() or not (ROOT / "distserve").is_dir(),
    reason="end-to-end calibration data absent (../shared/data/calibration or $BURSTGYM_SHARED_DATA)",
)

# The held-out MAPE per split that docs/latency.md reports (rounded up to 0.1%): fit on one TP
# degree, predict the other. Decode meets the 10% target everywhere; prefill misses it from TP2 to
# TP4 on both GPUs (docs/latency.md, residual analysis).
REPORTED_HELDOUT = {  # (gpu, fit TP, held-out TP): (decode, prefill)
    ("a100", 2, 4): (0.089, 0.161),
    ("a100", 4, 2): (0.039, 0.089),
    ("h100", 2, 4): (0.082, 0.117),
    ("h100", 4, 2): (0.027, 0.046),
}
REPORTED_VLLM_CI_LEAVE_ONE_GPU_OUT = 0.066  # worst |error| of an end-to-end latency test


def test_shipped_engines_and_default() -> None:
    assert {"splitwise-2023", "distserve-vllm", "vllm-ci", "vllm-serve", "kernels"} <= set(list_engines())
    assert DEFAULT_ENGINE == "vllm-ci"
    for name in list_profiles():
        p = load_profile(name)
        assert p.engine == DEFAULT_ENGINE, name
        assert p.provenance["engine"]["name"] == DEFAULT_ENGINE
        assert "gpu_energy" in p.provenance["power"]


def test_unknown_engine_lists_known() -> None:
    with pytest.raises(ValueError, match="unknown engine 'tgi-9'.*splitwise-2023.*vllm-ci"):
        load_profile("h100-llama-3-8b-tp1", engine="tgi-9")
    with pytest.raises(ValueError, match="distserve-vllm"):
        load_engine("nope")


def test_engine_files_have_provenance() -> None:
    for path in ENGINES_DIR.glob("*.json"):
        data = json.loads(path.read_text())
        engine = engine_from_dict(data, str(path))
        prov = engine.provenance
        assert prov["source_files"] and prov["fit_date"] and "report" in prov, path
        assert engine.applies, path
        assert engine.default_gpu in engine.gpus


def test_malformed_engine_names_file_and_field(tmp_path: Path) -> None:
    data = load_engine("vllm-ci").to_dict()
    data["gpus"]["h100"]["overhead_s"] = "fast"
    bad = tmp_path / "bad-engine.json"
    bad.write_text(json.dumps(data))
    with pytest.raises(ValueError, match="bad-engine.json.*gpus.h100.*overhead_s"):
        load_engine(bad)
    data["gpus"]["h100"] = {"overhead_ms": 1.0}
    bad.write_text(json.dumps(data))
    with pytest.raises(ValueError, match="unknown engine term 'overhead_ms'"):
        load_engine(bad)


def test_engine_moves_only_its_coefficients() -> None:
    """An engine adds per-iteration, per-sequence and per-layer time and sets the all-reduce terms;
    every other coefficient is the kernel model's."""
    p = load_profile("h100-llama-2-70b-tp8")
    model, tp = p.model, p.tp
    kernels = compose_kernels(p.gpu, model, tp, serving=False)
    terms = EngineTerms(
        overhead_s=1e-3, overhead_seq_s=2e-5, layer_s=3e-6, allreduce_step_s=4e-6, allreduce_bw_factor=2.0
    )
    lat = apply_engine(kernels, terms, model, tp)
    assert lat.overhead_s == pytest.approx(1e-3)
    assert lat.overhead_seq_s == pytest.approx(2e-5)
    assert lat.kernel_fixed_s == pytest.approx(kernels.kernel_fixed_s + 80 * 3e-6)
    assert lat.allreduce_fixed_s == pytest.approx(2 * 80 * 2 * (8 - 1) * 4e-6)
    assert lat.allreduce_token_s == pytest.approx(2 * kernels.allreduce_token_s)
    moved = {"overhead_s", "overhead_seq_s", "kernel_fixed_s", "allreduce_fixed_s", "allreduce_token_s"}
    for field in lat._fields:
        if field not in moved:
            assert getattr(lat, field) == getattr(kernels, field), field
    # At TP1 there is no all-reduce, whatever the engine says.
    one = apply_engine(compose_kernels(p.gpu, model, 1, serving=False), terms, model, 1)
    assert one.allreduce_fixed_s == 0 and one.allreduce_token_s == 0


def test_kernel_factors_and_front_end_move_what_they_name() -> None:
    """layer_factor scales the per-layer fixed kernel times, compute_factor the FLOP times,
    weights_factor the weight streaming (dense and expert), elementwise_factor the element-wise
    time; frontend_s is a per-request latency outside the iteration."""
    p = load_profile("h100-mixtral-8x7b-tp2")
    kernels = compose_kernels(p.gpu, p.model, p.tp, serving=False)
    terms = EngineTerms(
        layer_factor=0.5, compute_factor=0.8, weights_factor=1.1, elementwise_factor=0.7, frontend_s=0.01
    )
    lat = apply_engine(kernels, terms, p.model, p.tp)
    scaled = {
        "kernel_fixed_s": 0.5, "attn_fixed_s": 0.5, "prefill_fixed_s": 0.5, "token_s": 0.8,
        "logits_seq_s": 0.8, "prefill_pair_s": 0.8, "weights_s": 1.1, "expert_weights_s": 1.1,
        "elementwise_token_s": 0.7,
    }  # fmt: skip
    for field, factor in scaled.items():
        assert float(getattr(lat, field)) == pytest.approx(factor * float(getattr(kernels, field))), field
    assert lat.frontend_s == pytest.approx(0.01)
    for field in set(lat._fields) - set(scaled) - {"frontend_s", "allreduce_fixed_s"}:
        assert getattr(lat, field) == getattr(kernels, field), field


def test_vllm_serve_engine_is_fitted_to_the_inference_sim_runs() -> None:
    """The served-vLLM engine: an API front end of ~11 ms per request, a per-iteration overhead of
    ~2 ms, CUDA graphs hiding most of the profiled per-layer launch time; fitted on H100 runs of
    Llama-2-7B and CodeLlama-34B only."""
    engine = load_engine("vllm-serve")
    t = engine.gpus["h100"]
    assert engine.default_gpu == "h100" and engine.provenance["fitted_models"] == [
        "llama-2-7b",
        "codellama-34b",
    ]
    assert 0.005 < t.frontend_s < 0.02 and 0.0005 < t.overhead_s < 0.005 and t.layer_factor < 0.5
    assert all("inference-sim/training@ab8e76b" in f for f in engine.provenance["source_files"])
    assert not any(
        "70b" in f or "mixtral" in f or "reasoning" in f for f in engine.provenance["source_files"]
    )
    served, offline = (load_profile("h100-llama-2-70b-tp4", engine=e) for e in ("vllm-serve", "vllm-ci"))
    assert float(served.latency.frontend_s) == pytest.approx(t.frontend_s)
    assert float(offline.latency.frontend_s) == 0.0


def test_recomposing_with_an_engine_changes_only_latency() -> None:
    base = load_profile("h100-llama-2-70b-tp8")
    old = load_profile("h100-llama-2-70b-tp8", engine="splitwise-2023")
    assert old.engine == "splitwise-2023" and old.kv_capacity_tokens == base.kv_capacity_tokens
    assert old.power == base.power
    np.testing.assert_allclose(
        old.latency, compose_latency_model(old.gpu, old.model, old.tp, "splitwise-2023"), rtol=1e-12
    )
    # The 2023 engine is slower at every batch: its CPU overhead per iteration and per sequence.
    for b in (1, 32):
        assert float(old.step_time(decode_seqs=b, kv_tokens=b * 600)) > 1.3 * float(
            base.step_time(decode_seqs=b, kv_tokens=b * 600)
        )
    assert float(load_profile("h100-llama-2-70b-tp8", engine="kernels").step_time(decode_seqs=1)) < float(
        base.step_time(decode_seqs=1)
    )


def test_unknown_gpu_uses_the_default_gpu_terms() -> None:
    engine = load_engine("splitwise-2023")
    assert engine.terms_for("H200-SXM-141GB") == ("h100", engine.gpus["h100"])
    assert engine.terms_for("NVIDIA A100-SXM4-80GB")[0] == "a100"
    assert engine.terms_for("Intel Xeon")[0] == engine.default_gpu


@needs_data
def test_splitwise_heldout_mape_per_split() -> None:
    """Fit on one TP degree, predict the other, decode and prefill separately, per GPU."""
    from burstgym.latency import validate

    _, report = validate.fit_splitwise(
        ROOT, validate.shipped_gpus(), load_engine("distserve-vllm").gpus["a100"]
    )
    seen = set()
    for r in report["heldout"]:
        key = (r["gpu"], r["fit_tp"], r["heldout_tp"])
        decode, prefill = REPORTED_HELDOUT[key]
        assert r["decode_mape"] <= decode, (key, r["decode_mape"])
        assert r["prefill_mape"] <= prefill, (key, r["prefill_mape"])
        assert r["decode_points"] >= 18 and r["prefill_points"] >= 12
        seen.add(key)
    assert seen == set(REPORTED_HELDOUT)
    # The batch-64 TP2 runs did not hold their batch; the power-capped H100 rows are a derived copy.
    assert len(report["excluded"]) == 2 and all("batch 64" in e for e in report["excluded"])
    assert report["pcap_check"]["prompt_time_ratio_min"] == pytest.approx(1.3)
    assert report["pcap_check"]["token_time_max_abs_diff_ms"] == 0.0


@needs_data
def test_shipped_splitwise_engine_is_the_refit() -> None:
    """The committed splitwise-2023 terms are what the procedure gives on the shipped data."""
    from burstgym.latency import validate

    prior = load_engine("distserve-vllm").gpus["a100"]
    terms, _ = validate.fit_splitwise(ROOT, validate.shipped_gpus(), prior)
    shipped = load_engine("splitwise-2023")
    for gpu, t in terms.items():
        for key, value in t.__dict__.items():
            assert getattr(shipped.gpus[gpu], key) == pytest.approx(value, rel=1e-3, abs=1e-12), (gpu, key)


@needs_data
def test_vllm_ci_leave_one_gpu_out() -> None:
    from burstgym.latency import validate

    terms, report = validate.fit_vllm_ci(validate.shipped_gpus())
    errors = [abs(r["error"]) for r in report["leave_one_gpu_out"]]
    assert len(errors) == 6 and max(errors) <= REPORTED_VLLM_CI_LEAVE_ONE_GPU_OUT
    # Fitted per GPU, the two figures of each GPU are reproduced exactly (two terms, two figures).
    for gpu, t in terms.items():
        assert t.overhead_s > 0 and t.allreduce_step_s > 0, gpu
    for r in report["itl_check"]:
        assert r["predicted_ms_batch1_ctx600"] == pytest.approx(r["mean_itl_ms"], rel=0.1)


@needs_data
def test_distserve_vllm_overhead() -> None:
    from burstgym.latency import validate

    terms, report = validate.fit_distserve_vllm(ROOT, validate.shipped_gpus()["a100"])
    assert 5e-3 < terms.overhead_s < 8e-3 and 1e-5 < terms.overhead_seq_s < 5e-5
    assert report["fit"]["decode_mape"] < 0.05


def test_default_engine_decode_is_close_to_vllm_ci_itl() -> None:
    """The shipped H200 Llama-3-70B TP4 profile against vLLM CI's mean ITL at 1 request/s (16.6 ms),
    a figure the calibration was not fitted to."""
    p = load_profile("h200-llama-3-70b-tp4")
    assert float(p.step_time(decode_seqs=1, kv_tokens=600)) == pytest.approx(16.55e-3, rel=0.1)
    assert load_model_config("llama-3-70b").num_layers == 80


# docs/latency.md, "Other engine and all-reduce forms": held-out (decode, prefill) MAPE of the
# launch floor per split (rounded up to 0.1%), and the best A100 TP2 -> TP4 prefill of any form.
REPORTED_LAUNCH_FLOOR = {
    ("a100", 2, 4): (0.098, 0.166),
    ("a100", 4, 2): (0.039, 0.089),
    ("h100", 2, 4): (0.058, 0.092),
    ("h100", 4, 2): (0.029, 0.034),
}
REPORTED_BEST_A100_TP2_TO_TP4_PREFILL = 0.159


@needs_data
def test_splitwise_forms_script_reports_what_the_docs_say(monkeypatch: pytest.MonkeyPatch) -> None:
    """scripts/splitwise_forms.py: its `shipped` form is the shipped procedure; the launch floor
    meets the target on the H100 only; no form meets it on A100 prefill from TP2 to TP4."""
    import importlib.util
    import sys

    from burstgym.latency import validate

    if not (ROOT / "vidur").is_dir():
        pytest.skip("Vidur data absent")
    path = Path(__file__).resolve().parents[1] / "scripts" / "splitwise_forms.py"
    spec = importlib.util.spec_from_file_location("splitwise_forms", path)
    forms = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "splitwise_forms", forms)  # dataclasses look their module up
    spec.loader.exec_module(forms)
    prior = load_engine("distserve-vllm").gpus["a100"]
    data = {gpu: forms.parts(ROOT, gpu) for gpu in ("a100", "h100")}
    rows = {f.name: forms.heldout(f, data, prior.overhead_s) for f in forms.FORMS}
    _, report = validate.fit_splitwise(ROOT, validate.shipped_gpus(), prior)
    for ours, shipped in zip(rows["shipped"], report["heldout"], strict=True):
        assert ours["decode_mape"] == pytest.approx(shipped["decode_mape"], abs=1e-6)
        assert ours["prefill_mape"] == pytest.approx(shipped["prefill_mape"], abs=1e-6)
    for r in rows["launch-floor"]:
        decode, prefill = REPORTED_LAUNCH_FLOOR[(r["gpu"], r["fit_tp"], r["heldout_tp"])]
        assert r["decode_mape"] <= decode and r["prefill_mape"] <= prefill, r["gpu"]
    # The floor fitted on either TP degree alone is the same CPU time on the H100 (within 10%).
    h100 = [r["terms"]["floor"] for r in rows["launch-floor"] if r["gpu"] == "h100"]
    assert h100[0] == pytest.approx(h100[1], rel=0.1)
    a100 = [r["prefill_mape"] for f in rows.values() for r in f if (r["gpu"], r["fit_tp"]) == ("a100", 2)]
    assert min(a100) == pytest.approx(REPORTED_BEST_A100_TP2_TO_TP4_PREFILL, abs=1e-3)
    assert min(a100) > validate.HELDOUT_TARGET
