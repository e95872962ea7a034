"""Engine calibrations fitted to end-to-end measurements, and their held-out errors.

Each procedure here both produces a shipped calibration (``scripts/fit_profiles.py`` writes what it
returns) and scores it on data it was not fitted to; ``python -m burstgym.latency validate``
prints the tables that docs/latency.md reports.

- ``splitwise-2023`` (`fit_splitwise`): Llama-2-70B, TP2 and TP4, A100 and H100 (Splitwise).
  Held out: fit on one TP degree, predict the other, decode and prefill separately.
- ``distserve-vllm`` (`fit_distserve_vllm`): DistServe's fit of vLLM decode steps, OPT-13B TP1.
- ``vllm-ci`` (`fit_vllm_ci`): vLLM's own CI latency benchmark (Llama-3-8B TP1, Llama-3-70B
  TP4 on A100, H100, H200). Held out: fit on two GPUs, predict the third.
- A100 energy constants (`fit_splitwise_energy`): Splitwise's average power of the A100 runs.
  Held out: leave one run out.
"""

from __future__ import annotations

import datetime as dt
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import numpy as np

from burstgym.latency.configs import ModelConfig, load_model_config
from burstgym.latency.engines import Engine, EngineTerms, apply_engine
from burstgym.latency.fit import (
    ServingPoints,
    energy_report,
    fit_engine_terms,
    fit_gpu_energy,
    predict_serving,
    serving_report,
    step_times,
    subset,
)
from burstgym.latency.model import LatencyModel
from burstgym.latency.power import GPUEnergy
from burstgym.latency.profiles import GPUConstants, compose_kernels, load_profile
from burstgym.latency.sources import (
    DISTSERVE_VLLM_FILE,
    SPLITWISE_FILE,
    VLLM_CI_ITL,
    VLLM_CI_LATENCY,
    VLLM_CI_SHAPE,
    distserve_decode_points,
    read_distserve,
    read_splitwise,
    splitwise_pcap_check,
    splitwise_points,
    splitwise_power_runs,
)

# Terms the Splitwise data determines. The per-iteration overhead is not among them: at one TP
# degree a constant per iteration and the all-reduce latency (a constant per iteration too) cannot
# be told apart, so it is taken from distserve-vllm (vLLM of the same year, TP1, no all-reduce).
SPLITWISE_FREE = ("overhead_seq_s", "allreduce_step_s", "allreduce_bw_factor")
HELDOUT_TARGET = 0.10
A100_TDP_W = 400.0  # NVIDIA A100 80GB SXM4 datasheet
A100_IDLE_W = 50.0  # assumption (typical idle nvidia-smi draw of an SXM board), not measured


def shipped_gpus() -> dict[str, GPUConstants]:
    """The GPU constants of the shipped profiles (kernel fits), by family."""
    return {
        "a100": load_profile("a100-llama-2-70b-tp8").gpu,
        "h100": load_profile("h100-llama-2-70b-tp8").gpu,
        "h200": load_profile("h200-llama-3-70b-tp4").gpu,
    }


def kernels_by_tp(gpu: GPUConstants, model: ModelConfig, tps) -> dict[int, LatencyModel]:
    """Kernel-only coefficients (no serving overhead) of ``model`` at each TP degree."""
    return {int(tp): compose_kernels(gpu, model, int(tp), serving=False) for tp in tps}


# --- distserve-vllm ----------------------------------------------------------------------------


def fit_distserve_vllm(root: Path, a100: GPUConstants) -> tuple[EngineTerms, dict[str, Any]]:
    """Per-iteration and per-sequence overhead of 2023 vLLM from DistServe's decode fit.

    DistServe fitted vLLM's decode step on OPT-13B, TP1, A100 as ``a + b * context + c * batch``.
    Over batch 1..94 at 512 context tokens each, the part the A100 kernel model does not explain
    (their step time minus ours, in seconds) is regressed on the batch: the intercept is the
    per-iteration overhead, the slope the per-sequence one.
    """
    model = load_model_config("opt-13b")
    points = distserve_decode_points(root, "facebook/opt-13b", 1)
    kernels = kernels_by_tp(a100, model, [1])
    ours = predict_serving(kernels, model, EngineTerms(), points)
    slope, intercept = np.polyfit(points.batch, points.time_s - ours, 1)
    terms = EngineTerms(overhead_s=float(intercept), overhead_seq_s=float(max(slope, 0.0)))
    report = serving_report(predict_serving(kernels, model, terms, points), points)
    return terms, {"fit": report, "points": "decode, batch 1..94, 512 context tokens"}


def distserve_residuals(root: Path, a100: GPUConstants) -> list[dict[str, Any]]:
    """Per-iteration and per-sequence residual (DistServe's vLLM decode fit minus the A100 kernel
    model, regressed on batch 1..94 at 512 context tokens) for every model and TP degree DistServe
    fitted and the kernel model can compose (the NCCL fit has TP 2, 4, 8)."""
    out = []
    models = {"facebook/opt-13b": "opt-13b", "facebook/opt-66b": "opt-66b"}
    for name, coef in read_distserve(root).items():
        if name not in models:
            continue
        model = load_model_config(models[name])
        for tp in sorted(coef, key=int):
            if int(tp) > 1 and tp not in a100.allreduce:
                continue
            points = distserve_decode_points(root, name, int(tp))
            ours = predict_serving(kernels_by_tp(a100, model, [int(tp)]), model, EngineTerms(), points)
            slope, intercept = np.polyfit(points.batch, points.time_s - ours, 1)
            out.append(
                {
                    "model": models[name],
                    "tp": int(tp),
                    "overhead_ms": 1e3 * intercept,
                    "per_seq_us": 1e6 * slope,
                }
            )
    return out


def splitwise_prior_sensitivity(root: Path, gpus: dict[str, GPUConstants]) -> dict[str, Any]:
    """The Splitwise held-out table with the per-iteration prior fitted to DistServe's residual by
    least squares on relative error instead of the linear regression `fit_distserve_vllm` uses."""
    model = load_model_config("opt-13b")
    points = distserve_decode_points(root, "facebook/opt-13b", 1)
    prior = fit_engine_terms(
        kernels_by_tp(gpus["a100"], model, [1]), model, points, ("overhead_s", "overhead_seq_s")
    )
    _, report = fit_splitwise(root, gpus, prior)
    return {"prior_overhead_ms": 1e3 * prior.overhead_s, "heldout": report["heldout"]}


# --- splitwise-2023 ----------------------------------------------------------------------------


def _splitwise_fit(
    kernels: dict[int, LatencyModel], model: ModelConfig, points: ServingPoints, prior: EngineTerms
) -> EngineTerms:
    return fit_engine_terms(kernels, model, points, SPLITWISE_FREE, base=prior)


def fit_splitwise(
    root: Path, gpus: dict[str, GPUConstants], prior: EngineTerms
) -> tuple[dict[str, EngineTerms], dict[str, Any]]:
    """Fit the Splitwise engine per GPU on both TP degrees, and score each TP held out.

    :param prior: terms not determined by the data (``overhead_s``, ``layer_s``) come from here.
    :returns: terms per GPU family, and a report with the held-out table and exclusions.
    """
    table = read_splitwise(root)
    model = load_model_config("llama-2-70b")
    prior = replace(prior, allreduce_step_s=None, allreduce_bw_factor=1.0, overhead_seq_s=0.0)
    terms, heldout, insample = {}, [], {}
    for gpu in ("a100", "h100"):
        kernels = kernels_by_tp(gpus[gpu], model, (2, 4))
        both = splitwise_points(table, gpu)
        terms[gpu] = _splitwise_fit(kernels, model, both, prior)
        insample[gpu] = {
            str(tp): serving_report(
                predict_serving(kernels, model, terms[gpu], subset(both, both.tp == tp)),
                subset(both, both.tp == tp),
            )
            for tp in (2, 4)
        }
        for fit_tp, held_tp in ((2, 4), (4, 2)):
            train, test = subset(both, both.tp == fit_tp), subset(both, both.tp == held_tp)
            t = _splitwise_fit(kernels, model, train, prior)
            fit_rep = serving_report(predict_serving(kernels, model, t, train), train)
            pred = predict_serving(kernels, model, t, test)
            held = serving_report(pred, test)
            heldout.append(
                {
                    "gpu": gpu,
                    "fit_tp": fit_tp,
                    "heldout_tp": held_tp,
                    "fit_decode_mape": fit_rep["decode_mape"],
                    "fit_prefill_mape": fit_rep["prefill_mape"],
                    **held,
                    "residuals_decode": _residuals(pred, test, False),
                    "residuals_prefill": _residuals(pred, test, True),
                    "terms": asdict(t),
                }
            )
    excluded = table[table.excluded != ""]
    report = {
        "heldout": heldout,
        "insample": insample,
        "excluded": sorted(
            {
                f"{r.hardware} tp{r.tp} batch {r.batch}: {r.excluded}"
                for r in excluded.itertuples()
                if r.hardware != "h100-80gb-pcap"
            }
        ),
        "pcap_check": splitwise_pcap_check(root),
    }
    return terms, report


def splitwise_tp8(csv_file: Path, gpus: dict[str, GPUConstants]) -> list[dict[str, Any]]:
    """The shipped ``splitwise-2023`` engine (fitted on TP2 and TP4) predicting Splitwise's TP8 runs,
    never fitted: decode and prefill MAPE per GPU, with each prefill point's error. ``csv_file`` is
    splitwise-sim's ``data/perf_model.csv`` (github.com/Mutinifni/splitwise-sim at 8f99e7d), read
    where it lies."""
    from burstgym.latency.engines import load_engine

    table = read_splitwise(csv_file.parent, csv_file)
    model = load_model_config("llama-2-70b")
    engine = load_engine("splitwise-2023")
    out = []
    for gpu in ("a100", "h100"):
        points = splitwise_points(table, gpu, 8)
        if len(points.time_s) == 0:
            raise ValueError(f"{csv_file}: no TP8 rows of Llama-2-70B on {gpu}")
        pred = predict_serving(kernels_by_tp(gpus[gpu], model, (8,)), model, engine.gpus[gpu], points)
        out.append(
            {"gpu": gpu, **serving_report(pred, points), "residuals_prefill": _residuals(pred, points, True)}
        )
    return out


def _residuals(pred: np.ndarray, p: ServingPoints, prefill: bool) -> list[dict[str, float]]:
    m = p.is_prefill == prefill
    return [
        {"batch": float(b), "tokens": float(t), "measured_ms": 1e3 * float(y), "error": float(e / y - 1)}
        for b, t, y, e in zip(p.batch[m], p.tokens[m], p.time_s[m], pred[m], strict=True)
    ]


# --- vllm-ci -----------------------------------------------------------------------------------


def ci_latency(lat: LatencyModel, batch: int, input_tokens: int, output_tokens: int) -> float:
    """Seconds of vLLM's latency test: one prefill of the batch, then output_tokens - 1 decode
    iterations (the first output token comes with the prefill)."""
    pre = step_times(lat, batch * input_tokens, 0.0, 0.0, batch * input_tokens * (input_tokens + 1) / 2)
    k = np.arange(1, output_tokens)
    dec = step_times(lat, np.zeros(len(k)), np.full(len(k), float(batch)), batch * (input_tokens + k), 0.0)
    return float(pre + dec.sum())


def _ci_design(
    figures: list[dict], gpus: dict[str, GPUConstants]
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Kernel-only latency K of each figure and its sensitivity to (overhead_s, allreduce_step_s):
    the test's latency is K + n_iter x overhead_s + n_iter x 2 layers x 2 (tp - 1) x step."""
    shape = VLLM_CI_SHAPE
    n_iter = shape["output_tokens"]
    k, a, y = [], [], []
    for f in figures:
        model = load_model_config(f["model"])
        base = compose_kernels(gpus[f["gpu"]], model, f["tp"], serving=False)
        no_ar = apply_engine(base, EngineTerms(allreduce_step_s=0.0), model, f["tp"])
        k.append(ci_latency(no_ar, shape["batch"], shape["input_tokens"], shape["output_tokens"]))
        a.append([n_iter, n_iter * 2 * model.num_layers * 2 * (f["tp"] - 1)])
        y.append(f["latency_ms"] * 1e-3)
    return np.asarray(k), np.asarray(a, float), np.asarray(y)


def _ci_solve(k: np.ndarray, a: np.ndarray, y: np.ndarray) -> EngineTerms:
    """Non-negative least squares on relative error of the two linear terms."""
    from scipy.optimize import nnls

    w = 1.0 / y
    x, _ = nnls(a * w[:, None], (y - k) * w)
    return EngineTerms(overhead_s=float(x[0]), allreduce_step_s=float(x[1]))


def fit_vllm_ci(gpus: dict[str, GPUConstants]) -> tuple[dict[str, EngineTerms], dict[str, Any]]:
    """vLLM's CI latency tests per GPU: overhead per iteration from Llama-3-8B TP1, ring-step
    all-reduce latency from Llama-3-70B TP4; held out: fit on two GPUs, predict the third."""
    fams = sorted({f["gpu"] for f in VLLM_CI_LATENCY})
    terms, rows = {}, []
    for gpu in fams:
        figs = [f for f in VLLM_CI_LATENCY if f["gpu"] == gpu]
        terms[gpu] = _ci_solve(*_ci_design(figs, gpus))
        others = [f for f in VLLM_CI_LATENCY if f["gpu"] != gpu]
        shared = _ci_solve(*_ci_design(others, gpus))
        k, a, y = _ci_design(figs, gpus)
        pred = k + a @ np.array([shared.overhead_s, shared.allreduce_step_s])
        for f, p in zip(figs, pred, strict=True):
            rows.append(
                {
                    "heldout_gpu": gpu,
                    "test": f["test"],
                    "measured_ms": f["latency_ms"],
                    "predicted_ms": 1e3 * float(p),
                    "error": float(p / (f["latency_ms"] * 1e-3) - 1),
                    "fit_on": [g for g in fams if g != gpu],
                }
            )
    itl = []
    for f in VLLM_CI_ITL:
        model = load_model_config(f["model"])
        lat = apply_engine(
            compose_kernels(gpus[f["gpu"]], model, f["tp"], serving=False), terms[f["gpu"]], model, f["tp"]
        )
        pred = {b: 1e3 * float(step_times(lat, 0.0, b, b * 600.0, 0.0)) for b in (1, 4)}
        itl.append({**f, "predicted_ms_batch1_ctx600": pred[1], "predicted_ms_batch4_ctx600": pred[4]})
    return terms, {"leave_one_gpu_out": rows, "itl_check": itl}


# --- A100 energy -------------------------------------------------------------------------------


def fit_splitwise_energy(root: Path, a100: GPUConstants) -> tuple[GPUEnergy, dict[str, Any]]:
    """A100 energy-roofline constants from Splitwise's average power (Llama-2-70B, TP2 and TP4)."""
    table = read_splitwise(root)
    model = load_model_config("llama-2-70b")
    runs, notes = splitwise_power_runs(table, "a100", A100_TDP_W)
    kernels = kernels_by_tp(a100, model, np.unique(runs.tp))
    rates = (a100.mem_bw, a100.flops)
    source = (
        f"fitted to Splitwise's average_power of {len(runs.tp)} A100 runs ({SPLITWISE_FILE}); "
        f"idle {A100_IDLE_W:.0f} W assumed, TDP {A100_TDP_W:.0f} W (datasheet)"
    )
    energy = fit_gpu_energy(kernels, rates, runs, "A100-SXM4-80GB", A100_IDLE_W, A100_TDP_W, source)
    report = energy_report(kernels, rates, runs, energy)
    report["excluded"] = notes
    return energy, report


# --- all together ------------------------------------------------------------------------------


def engine_provenance(sources: list[str], report: dict[str, Any], **extra: Any) -> dict[str, Any]:
    """Provenance block of a shipped engine JSON."""
    return {
        "source_files": sources,
        "source_data": "shared/data/calibration (see its SOURCES.md)",
        "fit_date": dt.date.today().isoformat(),
        "generated_by": "scripts/fit_profiles.py",
        "report": report,
        **extra,
    }


def fit_engines(root: Path, gpus: dict[str, GPUConstants]) -> dict[str, Engine]:
    """The three shipped engine calibrations fitted to the data under ``root``."""
    ds_terms, ds_report = fit_distserve_vllm(root, gpus["a100"])
    ds_report["residual_by_model_tp"] = distserve_residuals(root, gpus["a100"])
    distserve = Engine(
        name="distserve-vllm",
        description="vLLM as of 2023 (DistServe's profile of it): CPU overhead per iteration and per "
        "decoding sequence, no CUDA graphs",
        gpus={"a100": ds_terms},
        default_gpu="a100",
        applies="fitted on A100 (OPT-13B, TP1); the same CPU overhead serves every GPU, model and TP; "
        "all-reduce is each GPU's NCCL microbenchmark fit (DistServe's fits at TP 2-8 are not consistent "
        "across OPT-13B and OPT-66B under this form, so no engine all-reduce term is fitted)",
        provenance=engine_provenance([DISTSERVE_VLLM_FILE], ds_report),
    )
    sw_terms, sw_report = fit_splitwise(root, gpus, ds_terms)
    splitwise = Engine(
        name="splitwise-2023",
        description="the serving engine of the Splitwise characterisation (Patel et al., ISCA 2024): "
        "Llama-2-70B end-to-end prefill and decode, A100-80GB and H100-80GB, TP2 and TP4",
        gpus=sw_terms,
        default_gpu="h100",
        applies="fitted per GPU on Llama-2-70B at TP2 and TP4; other GPUs (H200) use the H100 terms; "
        "overhead_s is distserve-vllm's (not separable from all-reduce latency at one TP); per-sequence "
        "terms carry unchanged to other models; all-reduce latency scales with 2 x layers x 2 (tp - 1) "
        "ring steps, its per-token part with layers x hidden size over the GPU's NCCL bandwidth at that "
        "TP; h100-80gb-pcap rows are a derived copy (prompt_time x 1.3) and are not used",
        provenance=engine_provenance([SPLITWISE_FILE, DISTSERVE_VLLM_FILE], sw_report),
    )
    ci_terms, ci_report = fit_vllm_ci(gpus)
    vllm_ci = Engine(
        name="vllm-ci",
        description="vLLM as measured by its own CI latency benchmark (Llama-3-8B TP1 and Llama-3-70B TP4, "
        "batch 8, 32 input and 128 output tokens) on A100-SXM4-80GB, H100 and H200; the pages do not "
        "state the vLLM version",
        gpus=ci_terms,
        default_gpu="h100",
        applies="fitted per GPU; a GPU without figures uses the H100 terms; overhead_s per iteration "
        "serves every model and TP; all-reduce latency scales with 2 x layers x 2 (tp - 1) ring steps; "
        "per-token all-reduce and per-sequence terms are not measured (the tests run one batch size): "
        "NCCL microbenchmark bandwidth, no per-sequence overhead",
        provenance=engine_provenance(
            sorted({f["url"] for f in VLLM_CI_LATENCY}),
            ci_report,
            figures=VLLM_CI_LATENCY,
            shape=VLLM_CI_SHAPE,
        ),
    )
    return {e.name: e for e in (distserve, splitwise, vllm_ci)}


def heldout_table(report: dict[str, Any]) -> str:
    """The Splitwise held-out table (markdown) from `fit_splitwise`'s report."""
    lines = [
        "| GPU | fit on | predict | decode MAPE (n) | prefill MAPE (n) | fit decode / prefill | <= 10% |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in report["heldout"]:
        ok = r["decode_mape"] <= HELDOUT_TARGET and r["prefill_mape"] <= HELDOUT_TARGET
        lines.append(
            f"| {r['gpu'].upper()} | TP{r['fit_tp']} | TP{r['heldout_tp']} | "
            f"{100 * r['decode_mape']:.1f}% ({r['decode_points']}) | "
            f"{100 * r['prefill_mape']:.1f}% ({r['prefill_points']}) | "
            f"{100 * r['fit_decode_mape']:.1f}% / {100 * r['fit_prefill_mape']:.1f}% | "
            f"{'met' if ok else 'missed'} |"
        )
    return "\n".join(lines)
