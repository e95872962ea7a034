"""Fit the ``vllm-serve`` engine to the inference-sim (BLIS) runs of vLLM v0.15.1 on H100.

    python scripts/fit_serving_engine.py --blis DIR [--terms T1,T2,...] [--seconds-per-stage S]
                                         [--jobs N] [--check]

DIR is a checkout of github.com/inference-sim/training at commit ab8e76b (`burstgym.latency.blis`).
Only the unsaturated runs of Llama-2-7B (TP1) and CodeLlama-34B (TP2) are fitted; every other run
(Llama-2-70B TP4, Mixtral-8x7B TP2, and the saturated runs) is held out and only ever predicted
(``python -m burstgym.latency validate --blis DIR``). The terms are fitted by
`burstgym.latency.fitlogs.fit_logs` to the mean TTFT and ITL of each half of each load stage; the
cross-validation leaves one model out (fit on Llama-2-7B, predict CodeLlama-34B, and back), and is
reported with the fit. ``--seconds-per-stage`` fits on the first seconds of each stage only (faster;
the shipped engine is fitted on whole stages). Writes burstgym/latency/engines/vllm-serve.json
unless ``--check``. Exits 0 with a message when DIR holds no runs.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import sys
from pathlib import Path

from burstgym.latency.blis import COMMIT, FIT_MODELS, GPU, load_runs
from burstgym.latency.engines import DEFAULT_ENGINE, ENGINES_DIR, Engine
from burstgym.latency.fitlogs import DEFAULT_TERMS, fit_logs

NAME = "vllm-serve"
# Where the fit starts: vLLM's CUDA graphs hide most of the profiled per-layer launch time, and its
# API server adds milliseconds to every request (docs/latency.md); the rest start from vllm-ci.
START = "layer_factor=0.3,frontend_s=0.008"


def main(argv: list[str] | None = None) -> int:
    """Fit, report and (unless --check) write the engine."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--blis", type=Path, required=True, help="checkout of inference-sim/training")
    parser.add_argument("--terms", default=",".join(DEFAULT_TERMS), help="engine terms to fit")
    parser.add_argument(
        "--start", default=START, help="starting values, e.g. layer_factor=0.3,frontend_s=0.008"
    )
    parser.add_argument("--seconds-per-stage", type=float, default=None, help="fit on each stage's start")
    parser.add_argument("--jobs", type=int, default=None, help="worker processes (default: CPUs)")
    parser.add_argument("--iterations", type=int, default=12, help="Levenberg-Marquardt iterations")
    parser.add_argument("--no-cv", action="store_true", help="skip the leave-one-model-out check")
    parser.add_argument("--check", action="store_true", help="fit and report without writing")
    parser.add_argument("--report", type=Path, default=None, help="also write the report JSON here")
    args = parser.parse_args(argv)
    if not (args.blis / "replay_data").is_dir():
        print(
            f"no inference-sim runs at {args.blis} (a checkout of inference-sim/training at {COMMIT}); "
            "nothing fitted"
        )
        return 0
    runs = [r for r in load_runs(args.blis) if r.fitted and not r.saturated]
    cases = [r.case(seconds_per_stage=args.seconds_per_stage) for r in runs]
    terms = tuple(t.strip() for t in args.terms.split(",") if t.strip())
    start = {k: float(v) for k, v in (item.split("=") for item in args.start.split(",") if item)}
    engine, report = fit_logs(
        cases,
        terms,
        jobs=args.jobs,
        cross_validate=not args.no_cv,
        iterations=args.iterations,
        name=NAME,
        groups=[r.model for r in runs],
        start=start,
    )
    print("fitted " + ", ".join(f"{k} = {v:.4g}" for k, v in report["terms"].items()))
    for row in report["logs"]:
        print(f"  in sample {row['log'].split('/')[-1]}: " + _errors(row))
    for row in report.get("cross_validation", {}).get("folds", []):
        print(f"  held out ({row['fold']} not fitted) {row['held_out'].split('/')[-1]}: " + _errors(row))
    terms_h100 = engine.gpus[GPU]
    shipped = Engine(
        name=NAME,
        description=(
            "vLLM v0.15.1's OpenAI API server (V1 engine, chunked prefill, prefix caching) on H100, as "
            "measured end to end by inference-perf through HTTP in the inference-sim training runs; "
            "fitted to the request logs of Llama-2-7B TP1 and CodeLlama-34B TP2"
        ),
        gpus={GPU: terms_h100},
        default_gpu=GPU,
        applies=(
            "fitted on H100; other GPUs use the H100 terms. The front end and the per-iteration overhead "
            "are the engine's (CPU) and carry to every model; the kernel factors say how vLLM's kernels "
            "run against the profiled ones and carry to every model on the GPU; the all-reduce factor, "
            "fitted at TP2, scales the NCCL microbenchmark of every TP degree"
        ),
        provenance={
            "source_files": [
                f"github.com/inference-sim/training@{COMMIT}: replay_data/{r.name}.json, "
                f"replay_data/{r.name}_ground_truth.json, default_args/{r.name}/profile.yaml"
                for r in runs
            ],
            "fitted_models": list(FIT_MODELS),
            "base_engine": DEFAULT_ENGINE,
            "seconds_per_stage": args.seconds_per_stage,
            "fit_date": dt.date.today().isoformat(),
            "generated_by": "scripts/fit_serving_engine.py",
            "report": report,
        },
    )
    if args.report is not None:
        args.report.write_text(json.dumps(report, indent=2) + "\n")
    if not args.check:
        path = ENGINES_DIR / f"{NAME}.json"
        path.write_text(json.dumps(shipped.to_dict(), indent=2) + "\n")
        print(f"wrote {path}")
    return 0


def _errors(row: dict) -> str:
    return ", ".join(
        f"{m.upper()} {1e3 * row['measured'][m]:.1f} -> {1e3 * row['predicted'][m]:.1f} ms "
        f"({100 * row['error'][m]:+.1f}%)"
        for m in ("ttft", "itl", "e2e")
    )


if __name__ == "__main__":
    sys.exit(main())
