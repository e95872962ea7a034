"""``python -m burstgym.calibrate``: calibrate burstgym to your own hardware and engine.

Two commands:

- ``python -m burstgym.calibrate --model NAME --device auto --out my.json`` (or the same after
  ``kernels``): time a model's kernels with torch on this machine, fit the kernel model, and write
  a profile JSON and a PNG of measured against fitted (`burstgym.latency.measure`);
- ``python -m burstgym.calibrate fit-serving FILE --profile BASE --out my.json``: fit a serving
  engine calibration to your own end-to-end step times over a base profile's kernels
  (`burstgym.latency.serving`, which documents the CSV columns).

The fitting code lives in `burstgym.latency.fit`; its names are re-exported here for callers
that import them from this module.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from burstgym.latency.cliargs import OneLineParser, float_at_least, int_at_least
from burstgym.latency.configs import list_models
from burstgym.latency.engines import DEFAULT_ENGINE
from burstgym.latency.fit import (  # noqa: F401  (re-exported)
    ATTENTION_KEYS,
    LINEAR_KEYS,
    TILE_CANDIDATES,
    AttentionSamples,
    LinearSamples,
    attention_samples,
    concat_samples,
    fit_allreduce,
    fit_attention,
    fit_attention_heldout,
    fit_linear,
    fit_linear_heldout,
    holdout_mask,
    linear_samples,
    mape,
    predict_attention,
    predict_linear,
    subset,
)
from burstgym.latency.measure import (  # noqa: F401  (re-exported)
    MIN_MAX_TOKENS,
    Timer,
    calibrate,
    device_description,
    measure_allreduce,
    measure_attention,
    measure_linear,
    plot_fit,
    resolve_device,
    token_grid,
)


def kernels_main(argv: list[str], prog: str = "python -m burstgym.calibrate") -> None:
    """Time a model's kernels on this machine and write a profile."""
    parser = OneLineParser(prog=prog, description=kernels_main.__doc__)
    parser.add_argument(
        "--model",
        required=True,
        help=f"a shipped model ({', '.join(list_models())}) or a Hugging Face config.json",
    )
    parser.add_argument("--device", default="auto", help="auto, cpu or cuda[:N]")
    parser.add_argument(
        "--out", type=Path, default=Path("my-gpu.json"), help="profile JSON (PNG written beside)"
    )
    parser.add_argument(
        "--max-tokens",
        type=int_at_least(MIN_MAX_TOKENS),
        default=4096,
        help=f"largest token count timed (at least {MIN_MAX_TOKENS}: the linear fit needs token counts "
        "on both sides of the memory-to-compute knee)",
    )
    parser.add_argument("--warmup", type=int_at_least(0), default=3, help="untimed runs before each timing")
    parser.add_argument("--repeats", type=int_at_least(1), default=10, help="timed runs (median kept)")
    parser.add_argument(
        "--tp", type=int_at_least(1), default=1, help="tensor-parallel degree (times an all-reduce if > 1)"
    )
    parser.add_argument(
        "--threads", type=int_at_least(1), default=None, help="CPU threads for torch (CPU runs)"
    )
    parser.add_argument(
        "--gpu-idle-w", type=float_at_least(0.0), default=0.0, help="idle power of one GPU, W"
    )
    parser.add_argument(
        "--gpu-busy-w", type=float_at_least(0.0), default=0.0, help="busy power (e.g. TDP) of one GPU, W"
    )
    parser.add_argument(
        "--engine",
        default=DEFAULT_ENGINE,
        help=f"serving-engine calibration to compose (default {DEFAULT_ENGINE})",
    )
    args = parser.parse_args(argv)
    try:
        profile, report = calibrate(
            args.model,
            args.device,
            args.out,
            args.max_tokens,
            args.warmup,
            args.repeats,
            args.tp,
            args.gpu_idle_w,
            args.gpu_busy_w,
            threads=args.threads,
            engine=args.engine,
        )
    except ValueError as err:
        parser.error(str(err))
    print(f"wrote {args.out} and {args.out.with_suffix('.png')}")
    print(
        f"held-out MAPE: linear {report['linear']['heldout_mape']:.1%}, "
        f"attention {report['attention']['heldout_mape']:.1%}"
    )
    print(f"decode step at batch 1: {1e3 * float(profile.step_time(decode_seqs=1, kv_tokens=128)):.3f} ms")


def fit_serving_main(argv: list[str]) -> None:
    """Fit a serving-engine calibration to end-to-end step times (CSV) and write a profile.

    CSV columns: phase (prefill|decode), batch_size, prompt_tokens (prefill rows), context_tokens
    (decode rows: mean context tokens per sequence), time_ms (prefill of the batch / one decode
    iteration), optional tp. See burstgym/latency/serving.py or docs/latency.md.
    """
    from burstgym.latency.serving import fit_serving

    parser = OneLineParser(
        prog="python -m burstgym.calibrate fit-serving",
        description=fit_serving_main.__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("file", type=Path, help="CSV of measured step times")
    parser.add_argument(
        "--profile",
        default="h100-llama-3-8b-tp1",
        help="base profile (name or JSON) the data was measured on",
    )
    parser.add_argument("--engine-name", default=None, help="name recorded for the fitted engine")
    parser.add_argument(
        "--fit", default=None, help="comma-separated engine terms to fit (default: those the data determines)"
    )
    parser.add_argument("--out", type=Path, required=True, help="profile JSON to write")
    args = parser.parse_args(argv)
    free = tuple(t.strip() for t in args.fit.split(",") if t.strip()) if args.fit else None
    try:
        profile, report = fit_serving(args.file, args.profile, args.engine_name, free, args.out)
    except ValueError as err:
        parser.error(str(err))
    print(f"wrote {args.out} (engine {profile.engine} over {args.profile})")
    print("fitted " + ", ".join(f"{k} = {report['terms'][k]:.4g}" for k in report["fitted_terms"]))
    for phase in ("decode", "prefill"):
        if report[f"{phase}_mape"] is not None:
            print(
                f"{phase}: in-sample MAPE {report[f'{phase}_mape']:.1%} over {report[f'{phase}_points']} rows"
            )


def main(argv: list[str] | None = None) -> None:
    """``python -m burstgym.calibrate [kernels] --model ...`` or ``... fit-serving FILE ...``."""
    import sys

    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "fit-serving":
        fit_serving_main(argv[1:])
    elif argv and argv[0] == "kernels":
        kernels_main(argv[1:], prog="python -m burstgym.calibrate kernels")
    else:
        kernels_main(argv)


if __name__ == "__main__":
    main()
