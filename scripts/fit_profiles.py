"""Regenerate every shipped latency profile (burstgym/profiles/*.json) from the calibration data.

    python scripts/fit_profiles.py [--data DIR] [--out burstgym/profiles] [--check]

Reads Vidur's kernel timings and DistServe's fitted serving coefficients from
shared/data/calibration (or $BURSTGYM_SHARED_DATA/calibration), fits one set of GPU constants per
GPU, composes them with each model architecture and writes the profiles with provenance. Exits
0 with a message when the data is absent. ``--check`` fits and prints without writing.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import sys
from pathlib import Path

import numpy as np
import pandas as pd

from burstgym.calibrate import (
    AttentionSamples,
    attention_samples,
    concat_samples,
    fit_allreduce,
    fit_attention_heldout,
    fit_linear_heldout,
    holdout_mask,
    linear_samples,
    mape,
    predict_linear,
    subset,
)
from burstgym.latency import (
    PROFILES_DIR,
    GPUConstants,
    build_profile,
    compose_latency_model,
    load_model_config,
)

REPO = Path(__file__).resolve().parents[1]
VIDUR_MODELS = {  # Vidur's folder name -> burstgym model file
    "Llama-2-7b-hf": "llama-2-7b",
    "Meta-Llama-3-8B": "llama-3-8b",
    "Llama-2-70b-hf": "llama-2-70b",
    "Meta-Llama-3-70B": "llama-3-70b",
    "CodeLlama-34b-Instruct-hf": "codellama-34b",
    "phi-2": "phi-2",
}
MIB = 2**20
# Per-GPU hardware figures. Memory as nvidia-smi reports it; busy power = board TDP from NVIDIA's
# datasheets (A100: "A100 Tensor Core GPU" datasheet, SXM4 80GB 400 W; H100: "H100 Tensor Core GPU"
# datasheet, SXM5 up to 700 W; H200: "H200 Tensor Core GPU" datasheet, SXM up to 700 W). Idle power
# is an ASSUMPTION (typical nvidia-smi readings of an idle SXM board), not a measurement.
HARDWARE = {
    "a100": {
        "name": "A100-SXM4-80GB",
        "memory_bytes": 81920 * MIB,
        "busy_w": 400.0,
        "idle_w": 50.0,
        "hbm_bw": 2.039e12,
        "peak_flops": 312e12,
    },
    "h100": {
        "name": "H100-SXM5-80GB",
        "memory_bytes": 81559 * MIB,
        "busy_w": 700.0,
        "idle_w": 70.0,
        "hbm_bw": 3.35e12,
        "peak_flops": 989e12,
    },
    "h200": {
        "name": "H200-SXM-141GB",
        "memory_bytes": 143771 * MIB,
        "busy_w": 700.0,
        "idle_w": 75.0,
        "hbm_bw": 4.8e12,
        "peak_flops": 989e12,
    },
}
POWER_SOURCES = (
    "per GPU x TP. Busy = TDP from NVIDIA datasheets (A100 SXM4 400 W, H100 SXM5 700 W, "
    "H200 SXM 700 W); idle = assumption (A100 50 W, H100 70 W, H200 75 W, typical idle "
    "nvidia-smi draw), not measured"
)
PROFILES = [  # (gpu, model, tp)
    ("h100", "llama-2-7b", 1),
    ("h100", "llama-3-8b", 1),
    ("a100", "llama-2-7b", 1),
    ("a100", "llama-3-8b", 1),
    ("h100", "llama-2-70b", 8),
    ("a100", "llama-2-70b", 8),
    ("h200", "llama-3-8b", 1),
    ("h200", "llama-2-7b", 1),
    ("h100", "phi-2", 1),
    ("h100", "codellama-34b", 2),
    ("a100", "llama-3-70b", 4),
    ("h200", "llama-3-70b", 4),
]
DISTSERVE_MODEL, DISTSERVE_CONTEXT = "opt-13b", 512


def data_dir(arg: str | None) -> Path:
    """The calibration folder: --data, $BURSTGYM_SHARED_DATA/calibration, or ../shared/data/calibration."""
    if arg:
        return Path(arg)
    env = os.environ.get("BURSTGYM_SHARED_DATA")
    base = Path(env) if env else REPO.parent / "shared" / "data"
    return base / "calibration"


def read_linear(root: Path, gpu: str) -> tuple[dict[tuple[str, int], object], list[str]]:
    """Vidur per-layer operator medians summed over layers (plus the embedding), N <= 4096, by (model, TP)."""
    out, files = {}, []
    for path in sorted((root / "vidur" / "compute" / gpu).glob("*/*/mlp.csv")):
        model = load_model_config(VIDUR_MODELS[path.parent.name])
        df = pd.read_csv(path).drop_duplicates(subset=["num_tokens", "num_tensor_parallel_workers"])
        df = df[df.num_tokens <= 4096]
        layer_ops = [c for c in df.columns if c.endswith(".median") and ".emb." not in c]
        for tp, part in df.groupby("num_tensor_parallel_workers"):
            ms = model.num_layers * part[layer_ops].sum(axis=1) + part["time_stats.emb.median"]
            out[(model.name, int(tp))] = linear_samples(
                model, int(tp), part.num_tokens.to_numpy(), ms.to_numpy() * 1e-3
            )
        files.append(str(path.relative_to(root)))
    return out, files


def read_attention(root: Path) -> AttentionSamples:
    """The transcribed Vidur A100 Llama-3-8B attention samples (per-layer medians)."""
    df = pd.read_csv(root / "vidur" / "attention_samples_a100_llama3_8b.csv")
    model = load_model_config("llama-3-8b")
    parts = [
        attention_samples(
            model,
            int(tp),
            g.is_prefill.to_numpy(),
            g.batch_size.to_numpy(),
            g.kv_cache_size.to_numpy(),
            g.prefill_chunk_size.to_numpy(),
            g.attn_median_ms_per_layer.to_numpy() * 1e-3,
        )
        for tp, g in df.groupby("tp")
    ]
    return concat_samples(parts)


def read_allreduce(root: Path, platform: str) -> dict[str, tuple[list[float], dict]]:
    """Alpha-beta fits of Vidur's all-reduce timings inside one node (rank 0), by TP degree."""
    df = pd.read_csv(root / "vidur" / "network" / platform / "all_reduce.csv")
    df = df[(df["rank"] == 0) & (df.devices_per_node == df.num_workers)]
    return {
        str(int(n)): fit_allreduce(g["size"].to_numpy(), g["time_stats.all_reduce.median"].to_numpy() * 1e-3)
        for n, g in df.groupby("num_workers")
    }


def serving_overhead(root: Path, a100: GPUConstants) -> dict[str, dict[str, float]]:
    """Serving overhead implied by DistServe's decode fits: their step time minus our A100 kernels.

    DistServe fitted decode = a + b x context tokens + c x batch on OPT-13B, A100, TP1, for vLLM and
    for its own engine. Over batches 1..94 at 512 context tokens each, the part our kernel model
    does not explain is regressed on batch size: intercept = per-iteration overhead, slope = per
    sequence.
    """
    model = load_model_config(DISTSERVE_MODEL)
    kernels = compose_latency_model(a100, model, 1)
    batch = np.arange(1, 95, dtype=float)
    from burstgym.latency import step_time

    ours = np.asarray(step_time(kernels, 0, batch, batch * DISTSERVE_CONTEXT))
    out = {}
    for engine in ("vllm", "distserve"):
        coef = json.loads((root / "distserve" / f"profiler-a100-80g.{engine}.json").read_text())
        a, b, c = coef["facebook/opt-13b"]["1"]["decoding_smallbs"]
        theirs = (a + b * batch * DISTSERVE_CONTEXT + c * batch) * 1e-3
        slope, intercept = np.polyfit(batch, theirs - ours, 1)
        out[engine] = {"overhead_s": float(intercept), "overhead_seq_s": float(slope)}
    return out


def main(argv: list[str] | None = None) -> int:
    """Fit, compose and write the shipped profiles; print the fit errors."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--data", help="calibration folder (default: ../shared/data/calibration)")
    parser.add_argument("--out", type=Path, default=PROFILES_DIR)
    parser.add_argument("--check", action="store_true", help="fit and report without writing")
    args = parser.parse_args(argv)
    root = data_dir(args.data)
    if not (root / "vidur").is_dir():
        print(
            f"calibration data not found at {root} (set BURSTGYM_SHARED_DATA or --data); nothing regenerated"
        )
        return 0
    today = dt.date.today().isoformat()
    attention = read_attention(root)
    att_fit, att_report = fit_attention_heldout(attention)
    print(
        f"attention (A100 Llama-3-8B samples): held-out MAPE {att_report['heldout_mape']:.1%} "
        f"(decode {att_report['heldout_mape_decode']:.1%}, prefill {att_report['heldout_mape_prefill']:.1%})"
    )
    allreduce = {"a100": read_allreduce(root, "a100_dgx"), "h100": read_allreduce(root, "h100_dgx")}
    fits, reports, files, per_model = {}, {}, {}, {}
    for gpu in ("a100", "h100"):
        samples, files[gpu] = read_linear(root, gpu)
        lin = concat_samples(list(samples.values()))
        fits[gpu], reports[gpu] = fit_linear_heldout(lin)
        # Per (model, TP) error on the same held-out points, from a fit without them.
        test = holdout_mask(len(lin.tokens), 0.2, 0)
        trained = fit_linear_heldout(subset(lin, ~test))[0]
        per_model[gpu] = {}
        for key, s in samples.items():
            held = subset(s, holdout_mask(len(s.tokens), 0.2, 1))
            per_model[gpu][key] = mape(predict_linear(trained, held), held.time_s)
        print(
            f"linear layers {gpu}: held-out MAPE {reports[gpu]['heldout_mape']:.1%} over "
            f"{reports[gpu]['heldout_points']} points, tile {fits[gpu]['tile_tokens']:.0f}; "
            + ", ".join(f"{m}/tp{t} {e:.1%}" for (m, t), e in sorted(per_model[gpu].items()))
        )
        for tp, (_, rep) in sorted(allreduce[gpu].items(), key=lambda kv: int(kv[0])):
            print(f"  all-reduce {gpu} TP{tp}: held-out MAPE {rep['heldout_mape']:.1%}")

    def constants(gpu: str, overhead: dict[str, float]) -> GPUConstants:
        hw, base = HARDWARE[gpu], fits[gpu]
        # Attention samples exist for the A100 only; other GPUs scale them by their own fitted
        # bandwidth and compute relative to the A100 fit (attention kernels are bandwidth- and
        # FLOP-bound like the GEMMs). Fixed per-layer costs carry over unchanged.
        bw_ratio = base["mem_bw"] / fits["a100"]["mem_bw"]
        flop_ratio = base["flops"] / fits["a100"]["flops"]
        return GPUConstants(
            name=hw["name"],
            memory_bytes=float(hw["memory_bytes"]),
            **base,
            attn_layer_fixed_s=att_fit["attn_layer_fixed_s"],
            attn_seq_layer_s=att_fit["attn_seq_layer_s"],
            attn_bw=att_fit["attn_bw"] * bw_ratio,
            prefill_layer_fixed_s=att_fit["prefill_layer_fixed_s"],
            attn_flops=att_fit["attn_flops"] * flop_ratio,
            **overhead,
            allreduce={tp: v[0] for tp, v in allreduce[gpu].items()},
        )

    overheads = serving_overhead(root, constants("a100", {"overhead_s": 0.0, "overhead_seq_s": 0.0}))
    for engine, o in overheads.items():
        print(
            f"serving overhead implied by DistServe's {engine} fit (OPT-13B, A100): "
            f"{o['overhead_s'] * 1e3:.2f} ms + {o['overhead_seq_s'] * 1e6:.1f} us/seq"
        )
    # Shipped: DistServe's own (lighter) engine; its vLLM-2023 figure is the heavier alternative.
    overhead = overheads["distserve"]
    gpus = {g: constants(g, overhead) for g in ("a100", "h100")}
    h100, hw = gpus["h100"], HARDWARE["h200"]
    # H200: the H100 die with HBM3e. Bandwidth-bound constants scale by the datasheet bandwidth
    # ratio (4.8 / 3.35 TB/s); compute, fixed costs and NVLink all-reduce are kept from the H100.
    bw_scale = hw["hbm_bw"] / HARDWARE["h100"]["hbm_bw"]
    gpus["h200"] = GPUConstants(
        **{
            **h100.__dict__,
            "name": hw["name"],
            "memory_bytes": float(hw["memory_bytes"]),
            "mem_bw": h100.mem_bw * bw_scale,
            "elementwise_bw": h100.elementwise_bw * bw_scale,
            "attn_bw": h100.attn_bw * bw_scale,
        }
    )

    common_sources = [
        "vidur/attention_samples_a100_llama3_8b.csv",
        "distserve/profiler-a100-80g.distserve.json",
        "distserve/profiler-a100-80g.vllm.json",
    ]
    written = []
    for gpu, model_name, tp in PROFILES:
        model = load_model_config(model_name)
        fit_gpu = "h100" if gpu == "h200" else gpu
        platform = f"{fit_gpu}_dgx"
        fit_error = {
            "linear_heldout_mape_gpu": reports[fit_gpu]["heldout_mape"],
            "linear_heldout_mape_this_model_tp": per_model[fit_gpu].get((model_name, tp)),
            "attention_heldout_mape_a100_llama3_8b": att_report["heldout_mape"],
            "allreduce_heldout_mape": allreduce[fit_gpu][str(tp)][1]["heldout_mape"] if tp > 1 else None,
        }
        derived = gpu == "h200"
        provenance = {
            "kind": "derived" if derived else "measured",
            "detail": (
                "H100 fit with the H200's HBM bandwidth (4.8 vs 3.35 TB/s) and memory (141 GB); "
                "no H200 kernel data and no device measurement in this session"
                if derived
                else f"GPU constants fitted to Vidur {fit_gpu.upper()} kernel timings of "
                f"{len(per_model[fit_gpu])} model/TP combinations; this model/TP "
                f"{'is' if (model_name, tp) in per_model[fit_gpu] else 'is not'} among them"
            ),
            "source_files": files[fit_gpu] + [f"vidur/network/{platform}/all_reduce.csv"] + common_sources,
            "source_data": "shared/data/calibration (Vidur @ 7d47513, MIT; DistServe, Apache-2.0)",
            "fit_date": today,
            "fit_error": fit_error,
            "attention": (
                "fitted to A100 samples"
                if gpu == "a100"
                else "A100 attention fit scaled by this GPU's fitted bandwidth and compute (derived)"
            ),
            "serving_overhead": (
                "DistServe engine decode fit (OPT-13B, A100) minus our kernels: "
                f"{overhead['overhead_s'] * 1e3:.2f} ms/iteration + "
                f"{overhead['overhead_seq_s'] * 1e6:.1f} us/sequence; vLLM (2023) fit gives "
                f"{overheads['vllm']['overhead_s'] * 1e3:.2f} ms + "
                f"{overheads['vllm']['overhead_seq_s'] * 1e6:.1f} us/seq"
            ),
            "generated_by": "scripts/fit_profiles.py",
        }
        name = f"{gpu}-{model_name}-tp{tp}"
        hwg = HARDWARE[gpu]
        profile = build_profile(
            name, gpus[gpu], model, tp, hwg["idle_w"], hwg["busy_w"], POWER_SOURCES, provenance
        )
        if not args.check:
            args.out.mkdir(parents=True, exist_ok=True)
            (args.out / f"{name}.json").write_text(json.dumps(profile.to_dict(), indent=2) + "\n")
        written.append(name)
        print(
            f"{name}: decode bs1 {1e3 * float(profile.step_time(decode_seqs=1, kv_tokens=1024)):.2f} ms, "
            f"bs64 {1e3 * float(profile.step_time(decode_seqs=64, kv_tokens=64 * 1024)):.2f} ms, "
            f"KV capacity {profile.kv_capacity_tokens} tokens"
        )
    print(("checked " if args.check else f"wrote {args.out}/: ") + ", ".join(written))
    return 0


if __name__ == "__main__":
    sys.exit(main())
