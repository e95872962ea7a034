"""Regenerate the shipped calibrations from the public calibration data.

    python scripts/fit_profiles.py [--data DIR] [--out burstgym/profiles] [--check]

Reads shared/data/calibration (or $BURSTGYM_SHARED_DATA/calibration; see its SOURCES.md) and
1. fits one set of kernel constants per GPU to Vidur's kernel timings (linear layers, attention,
   all-reduce); the H200's are derived from the H100's, the L40S's from the A100's and its datasheet;
   writes each GPU's constants to burstgym/latency/gpus/ (profiles of any model and TP compose on them);
2. fits the engine calibrations (burstgym/latency/engines/*.json): ``splitwise-2023`` to Splitwise's
   end-to-end Llama-2-70B runs, ``distserve-vllm`` to DistServe's vLLM decode fit, ``vllm-ci`` to
   vLLM's CI latency tests (`burstgym.latency.validate`);
3. fits the A100 energy constants to Splitwise's average power and derives the H100's and H200's;
4. composes every shipped profile (burstgym/profiles/*.json) with the default engine.
Prints every fit error. Exits 0 with a message when the data is absent. ``--check`` fits and
prints without writing.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import sys
from pathlib import Path

from burstgym.latency import validate
from burstgym.latency.configs import load_model_config
from burstgym.latency.engines import DEFAULT_ENGINE, ENGINES_DIR
from burstgym.latency.fit import (
    concat_samples,
    fit_attention_heldout,
    fit_linear_heldout,
    holdout_mask,
    mape,
    predict_linear,
    subset,
)
from burstgym.latency.power import derive_energy
from burstgym.latency.profiles import GPUS_DIR, PROFILES_DIR, GPUConstants, GPUFamily, build_profile
from burstgym.latency.sources import (
    data_dir,
    read_vidur_allreduce,
    read_vidur_attention,
    read_vidur_linear,
)

MIB = 2**20
# Per-GPU hardware figures. Memory as nvidia-smi reports it; TDP, HBM bandwidth and dense bf16
# compute from NVIDIA's datasheets (A100: "A100 Tensor Core GPU" datasheet, SXM4 80GB 400 W;
# H100: "H100 Tensor Core GPU" datasheet, SXM5 up to 700 W; H200: "H200 Tensor Core GPU"
# datasheet, SXM up to 700 W). Idle power with a model loaded is an ASSUMPTION (typical
# nvidia-smi readings of an idle SXM board), not a measurement.
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
    # NVIDIA L40S datasheet: 48 GB GDDR6 (46068 MiB as nvidia-smi reports it), 864 GB/s, 362.05 TFLOPS
    # dense FP16/BF16 tensor (733 with sparsity), 350 W, PCIe Gen4 x16 (64 GB/s bidirectional), no
    # NVLink. Idle power is an assumption, not a measurement.
    "l40s": {
        "name": "L40S-48GB",
        "memory_bytes": 46068 * MIB,
        "busy_w": 350.0,
        "idle_w": 35.0,
        "hbm_bw": 864e9,
        "peak_flops": 362.05e12,
        "link_bw": 32e9,  # PCIe Gen4 x16, one direction
    },
}
# NVLink 3 of the A100 SXM4: 600 GB/s per GPU, 300 GB/s one direction (A100 datasheet).
A100_LINK_BW = 300e9
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


def fit_kernels(root: Path) -> tuple[dict[str, GPUConstants], dict]:
    """Kernel constants per GPU family (the H200's derived) and their fit reports."""
    attention = read_vidur_attention(root)
    att_fit, att_report = fit_attention_heldout(attention)
    print(
        f"attention (A100 Llama-3-8B samples): held-out MAPE {att_report['heldout_mape']:.1%} "
        f"(decode {att_report['heldout_mape_decode']:.1%}, prefill {att_report['heldout_mape_prefill']:.1%})"
    )
    allreduce = {
        "a100": read_vidur_allreduce(root, "a100_dgx"),
        "h100": read_vidur_allreduce(root, "h100_dgx"),
    }
    fits, reports, files, per_model = {}, {}, {}, {}
    for gpu in ("a100", "h100"):
        samples, files[gpu] = read_vidur_linear(root, gpu)
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

    def constants(gpu: str) -> GPUConstants:
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
            overhead_s=0.0,  # serving overhead comes from the engine calibration
            overhead_seq_s=0.0,
            allreduce={tp: v[0] for tp, v in allreduce[gpu].items()},
        )

    gpus = {g: constants(g) for g in ("a100", "h100")}
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
    # L40S: no kernel data. The A100 fit (the other non-Hopper GPU) with the bandwidth-bound constants
    # scaled by the datasheet memory bandwidth ratio (864 / 2039 GB/s), the compute-bound ones by the
    # dense BF16 ratio (362 / 312 TFLOP/s), fixed costs kept; all-reduce over PCIe: the A100's NCCL
    # latency with its bandwidth scaled by one PCIe Gen4 x16 direction over one NVLink 3 direction.
    a100, hw, ref = gpus["a100"], HARDWARE["l40s"], HARDWARE["a100"]
    bw, fl, link = (
        hw["hbm_bw"] / ref["hbm_bw"],
        hw["peak_flops"] / ref["peak_flops"],
        hw["link_bw"] / A100_LINK_BW,
    )
    gpus["l40s"] = GPUConstants(
        **{
            **a100.__dict__,
            "name": hw["name"],
            "memory_bytes": float(hw["memory_bytes"]),
            "mem_bw": a100.mem_bw * bw,
            "elementwise_bw": a100.elementwise_bw * bw,
            "attn_bw": a100.attn_bw * bw,
            "flops": a100.flops * fl,
            "attn_flops": a100.attn_flops * fl,
            "allreduce": {tp: [alpha, beta * link] for tp, (alpha, beta) in a100.allreduce.items()},
        }
    )
    info = {
        "attention": att_report,
        "linear": reports,
        "per_model": per_model,
        "allreduce": allreduce,
        "files": files,
    }
    return gpus, info


def fit_energies(root: Path, gpus: dict[str, GPUConstants]) -> tuple[dict, dict]:
    """Energy constants per GPU family: the A100's fitted, the H100's and H200's derived."""
    a100, report = validate.fit_splitwise_energy(root, gpus["a100"])
    ref, ref_rates = HARDWARE["a100"], (gpus["a100"].mem_bw, gpus["a100"].flops)
    p_mem, p_comp = a100.roof_powers(ref_rates)
    energies = {"a100": a100}
    for gpu in ("h100", "h200", "l40s"):
        hw = HARDWARE[gpu]
        energies[gpu] = derive_energy(
            a100,
            ref_rates,
            hw["name"],
            hw["busy_w"],
            hw["idle_w"],
            (gpus[gpu].mem_bw, gpus[gpu].flops),
            source=(
                f"derived from the A100 fit: static power and the power above it at the memory and compute "
                f"roofs held at the A100's shares of TDP ({a100.static_w / ref['busy_w']:.2f}, "
                f"{p_mem / ref['busy_w']:.2f}, {p_comp / ref['busy_w']:.2f}), at this GPU's TDP and fitted "
                f"kernel rates; idle {hw['idle_w']:.0f} W assumed; not measured"
            ),
        )
    return energies, report


POWER_SOURCES = (
    "per node = per GPU x TP. Energy roofline (Choi et al., IPDPS 2013): A100 constants fitted to "
    "Splitwise's measured average power; H100/H200/L40S derived from them (not measured). Limit = TDP "
    "from NVIDIA datasheets (A100 SXM4 400 W, H100 SXM5 700 W, H200 SXM 700 W, L40S 350 W); idle = "
    "assumption (A100 50 W, H100 70 W, H200 75 W, L40S 35 W, typical idle nvidia-smi draw), not measured"
)
GPU_DETAIL = {
    "a100": ("measured", "kernel constants fitted to Vidur A100 kernel timings"),
    "h100": ("measured", "kernel constants fitted to Vidur H100 kernel timings"),
    "h200": (
        "derived",
        "H100 kernel fit with the H200's HBM bandwidth (4.8 vs 3.35 TB/s) and memory (141 GB)",
    ),
    "l40s": (
        "derived",
        "A100 kernel fit scaled by the L40S datasheet (864 GB/s, 362 TFLOP/s dense BF16, 48 GB); "
        "all-reduce over PCIe Gen4 (A100 NCCL bandwidth x 32/300); no L40S data",
    ),
}


def main(argv: list[str] | None = None) -> int:
    """Fit, compose and write the shipped engines and profiles; print the fit errors."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--data", help="calibration folder (default: ../shared/data/calibration)")
    parser.add_argument("--out", type=Path, default=PROFILES_DIR)
    parser.add_argument("--engines-out", type=Path, default=ENGINES_DIR)
    parser.add_argument("--check", action="store_true", help="fit and report without writing")
    args = parser.parse_args(argv)
    root = data_dir(args.data)
    needed = ("vidur", "splitwise", "distserve")
    if not all((root / d).is_dir() for d in needed):
        print(
            f"calibration data not found at {root} (needs {', '.join(needed)}; set BURSTGYM_SHARED_DATA "
            "or --data); nothing regenerated"
        )
        return 0
    today = dt.date.today().isoformat()
    gpus, kern = fit_kernels(root)
    engines = validate.fit_engines(root, gpus)
    print(validate.heldout_table(engines["splitwise-2023"].provenance["report"]))
    for name, engine in engines.items():
        for key, t in engine.gpus.items():
            print(
                f"engine {name} [{key}]: {t.overhead_s * 1e3:.2f} ms/iteration + "
                f"{t.overhead_seq_s * 1e6:.1f} "
                f"us/sequence + {t.layer_s * 1e6:.1f} us/layer; all-reduce step "
                + ("NCCL" if t.allreduce_step_s is None else f"{t.allreduce_step_s * 1e6:.2f} us")
                + f", bandwidth x{t.allreduce_bw_factor:.2f}"
            )
    energies, energy_report = fit_energies(root, gpus)
    for gpu, e in energies.items():
        p_mem, p_comp = e.roof_powers((gpus[gpu].mem_bw, gpus[gpu].flops))
        print(
            f"energy {gpu}: static {e.static_w:.0f} W, {e.joule_per_byte * 1e12:.0f} pJ/B, "
            f"{e.joule_per_flop * 1e12:.2f} pJ/FLOP; memory roof +{p_mem:.0f} W, compute roof +{p_comp:.0f} W"
        )
    print(
        f"A100 average power: MAPE {energy_report['power_mape']:.1%}, leave one run out "
        f"{energy_report['power_mape_leave_one_out']:.1%} over {energy_report['runs']} runs"
    )
    if not args.check:
        args.engines_out.mkdir(parents=True, exist_ok=True)
        for name, engine in engines.items():
            (args.engines_out / f"{name}.json").write_text(json.dumps(engine.to_dict(), indent=2) + "\n")

    default = engines[DEFAULT_ENGINE]
    heldout = {
        f"{r['gpu']}_tp{r['fit_tp']}_to_tp{r['heldout_tp']}": {
            "decode_mape": r["decode_mape"],
            "prefill_mape": r["prefill_mape"],
        }
        for r in engines["splitwise-2023"].provenance["report"]["heldout"]
    }
    if not args.check:
        GPUS_DIR.mkdir(parents=True, exist_ok=True)
    for gpu, const in gpus.items():
        kind, detail = GPU_DETAIL[gpu]
        fit_gpu = {"h200": "h100", "l40s": "a100"}.get(gpu, gpu)
        family = GPUFamily(
            key=gpu,
            gpu=const,
            energy=energies[gpu],
            idle_w=HARDWARE[gpu]["idle_w"],
            busy_w=HARDWARE[gpu]["busy_w"],
            provenance={
                "kind": kind,
                "detail": detail,
                "source_files": kern["files"][fit_gpu]
                + [
                    f"vidur/network/{fit_gpu}_dgx/all_reduce.csv",
                    "vidur/attention_samples_a100_llama3_8b.csv",
                ],
                "source_data": "shared/data/calibration (Vidur @ 7d47513, MIT; Splitwise @ 8f99e7d, MIT) and "
                "NVIDIA datasheets",
                "fit_error": {
                    "linear_heldout_mape": kern["linear"][fit_gpu]["heldout_mape"],
                    "attention_heldout_mape_a100_llama3_8b": kern["attention"]["heldout_mape"],
                    "allreduce_heldout_mape": {
                        tp: rep["heldout_mape"] for tp, (_, rep) in kern["allreduce"][fit_gpu].items()
                    },
                },
                "power_sources": POWER_SOURCES,
                "fit_date": today,
                "generated_by": "scripts/fit_profiles.py",
            },
        )
        if not args.check:
            (GPUS_DIR / f"{gpu}.json").write_text(json.dumps(family.to_dict(), indent=2) + "\n")
    written = []
    for gpu, model_name, tp in PROFILES:
        model = load_model_config(model_name)
        fit_gpu = "h100" if gpu == "h200" else gpu
        engine_key, _ = default.terms_for(gpus[gpu].name)
        fit_error = {
            "linear_heldout_mape_gpu": kern["linear"][fit_gpu]["heldout_mape"],
            "linear_heldout_mape_this_model_tp": kern["per_model"][fit_gpu].get((model_name, tp)),
            "attention_heldout_mape_a100_llama3_8b": kern["attention"]["heldout_mape"],
            "allreduce_heldout_mape": kern["allreduce"][fit_gpu][str(tp)][1]["heldout_mape"]
            if tp > 1
            else None,
            "engine_vllm_ci_leave_one_gpu_out": [
                {"test": r["test"], "error": r["error"]}
                for r in default.provenance["report"]["leave_one_gpu_out"]
                if r["heldout_gpu"] == engine_key
            ],
            "engine_splitwise_2023_tp_heldout": heldout,
            "power_a100_mape": energy_report["power_mape"],
        }
        derived = gpu == "h200"
        provenance = {
            "kind": "derived" if derived else "measured",
            "detail": (
                "H100 kernel fit with the H200's HBM bandwidth (4.8 vs 3.35 TB/s) and memory (141 GB); "
                "no H200 kernel data"
                if derived
                else f"kernel constants fitted to Vidur {fit_gpu.upper()} kernel timings of "
                f"{len(kern['per_model'][fit_gpu])} model/TP combinations; this model/TP "
                f"{'is' if (model_name, tp) in kern['per_model'][fit_gpu] else 'is not'} among them"
            ),
            "source_files": kern["files"][fit_gpu]
            + [f"vidur/network/{fit_gpu}_dgx/all_reduce.csv", "vidur/attention_samples_a100_llama3_8b.csv"]
            + default.provenance["source_files"]
            + ["splitwise/perf_model_llama2-70b_tp2_tp4.csv (power)"],
            "source_data": "shared/data/calibration (Vidur @ 7d47513, MIT; Splitwise @ 8f99e7d, MIT) and "
            "vLLM's CI latency benchmark pages",
            "fit_date": today,
            "fit_error": fit_error,
            "attention": (
                "fitted to A100 samples"
                if gpu == "a100"
                else "A100 attention fit scaled by this GPU's fitted bandwidth and compute (derived)"
            ),
            "engine": {
                "name": default.name,
                "gpu_terms": engine_key,
                "file": f"burstgym/latency/engines/{default.name}.json",
            },
            "power": {"gpu_energy": energies[gpu].source},
            "generated_by": "scripts/fit_profiles.py",
        }
        name = f"{gpu}-{model_name}-tp{tp}"
        hw = HARDWARE[gpu]
        profile = build_profile(
            name,
            gpus[gpu],
            model,
            tp,
            hw["idle_w"],
            hw["busy_w"],
            POWER_SOURCES,
            provenance,
            engine=default,
            energy=energies[gpu],
        )
        if not args.check:
            args.out.mkdir(parents=True, exist_ok=True)
            (args.out / f"{name}.json").write_text(json.dumps(profile.to_dict(), indent=2) + "\n")
        written.append(name)
        c = 1024
        print(
            f"{name}: decode bs1 {1e3 * float(profile.step_time(decode_seqs=1, kv_tokens=c)):.2f} ms "
            f"({float(profile.iteration_power_w(decode_seqs=1, kv_tokens=c)):.0f} W), "
            f"bs64 {1e3 * float(profile.step_time(decode_seqs=64, kv_tokens=64 * c)):.2f} ms "
            f"({float(profile.iteration_power_w(decode_seqs=64, kv_tokens=64 * c)):.0f} W), "
            f"prefill 2048 {float(profile.iteration_power_w(prefill_tokens=2048)):.0f} W, "
            f"KV capacity {profile.kv_capacity_tokens} tokens"
        )
    print(("checked " if args.check else f"wrote {args.engines_out}/ and {args.out}/: ") + ", ".join(written))
    return 0


if __name__ == "__main__":
    sys.exit(main())
