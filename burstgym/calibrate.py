"""``python -m burstgym.calibrate``: calibrate burstgym to your own hardware and engine.

Commands:

- ``python -m burstgym.calibrate --model NAME --device auto --out my.json`` (or the same after
  ``kernels``): time a model's kernels with torch on this machine, fit the kernel model, and write
  a profile JSON and a PNG of measured against fitted (`burstgym.latency.measure`);
- ``python -m burstgym.calibrate fit-serving FILE --profile BASE --out my.json``: fit a serving
  engine calibration to your own end-to-end step times over a base profile's kernels
  (`burstgym.latency.serving`, which documents the CSV columns);
- ``python -m burstgym.calibrate replay LOG --profile NAME``: replay a request log (a benchmark
  client's or a gateway's) through the simulator and compare predicted with measured TTFT, ITL and
  E2E (`burstgym.latency.replay`, `burstgym.latency.requestlog`);
- ``python -m burstgym.calibrate fit-logs LOG... --profile NAME --out my.json``: fit a serving engine
  to request logs, cross-validated, and write a profile the simulator takes (`burstgym.latency.fitlogs`).

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


# Request logs are measured by clients through a serving engine's API: replay and fit them with the
# engine calibrated that way (burstgym/latency/engines/vllm-serve.json) unless told otherwise.
SERVED_ENGINE = "vllm-serve"


def _add_server_flags(parser: argparse.ArgumentParser) -> None:
    """Flags for the serving settings a log may not state (each overrides the log's)."""
    parser.add_argument("--max-num-seqs", type=int_at_least(1), default=None, help="running-set limit")
    parser.add_argument(
        "--max-num-batched-tokens", type=int_at_least(1), default=None, help="token budget per iteration"
    )
    parser.add_argument("--kv-blocks", type=int_at_least(1), default=None, help="KV blocks of the node")
    parser.add_argument("--block-size", type=int_at_least(1), default=None, help="tokens per KV block")
    parser.add_argument(
        "--prefix-tokens",
        type=int_at_least(0),
        default=None,
        help="tokens of the prompt prefix shared within a log's prefix group (the log's, else 0)",
    )
    parser.add_argument(
        "--no-prefix-caching", action="store_true", help="simulate without vLLM's automatic prefix caching"
    )
    parser.add_argument(
        "--output-tokens",
        type=int_at_least(1),
        default=None,
        help="every request generated this many tokens (a server run with ignore_eos and max_tokens "
        "N whose client counted fewer; docs/latency.md)",
    )


def replay_main(argv: list[str]) -> None:
    """Replay a request log through the simulator and print predicted against measured TTFT, ITL and
    E2E (mean, p50, p90, p99); formats and columns in docs/latency.md ("Request logs")."""
    from burstgym.latency.profiles import load_profile
    from burstgym.latency.replay import replay, replay_settings, write_json
    from burstgym.latency.requestlog import FORMATS, read_log

    parser = OneLineParser(
        prog="python -m burstgym.calibrate replay",
        description=replay_main.__doc__,
    )
    parser.add_argument("log", type=Path, help="the request log")
    parser.add_argument("--truth", type=Path, default=None, help="measured latencies (inference-sim format)")
    parser.add_argument("--format", default="auto", choices=("auto", *FORMATS), help="the log's format")
    parser.add_argument(
        "--profile",
        required=True,
        help="profile name (e.g. h100-llama-2-70b-tp4, any TP of a known model and GPU) or JSON path",
    )
    parser.add_argument(
        "--engine",
        default=SERVED_ENGINE,
        help=f"engine calibration the profile is composed with (default {SERVED_ENGINE}: vLLM's OpenAI "
        "server measured end to end, front end included; a path to an engine JSON works too)",
    )
    _add_server_flags(parser)
    parser.add_argument("--json", type=Path, default=None, help="write the summary here")
    parser.add_argument(
        "--plot", type=Path, default=None, help="PNG of the CDFs (default: beside --json, if given)"
    )
    args = parser.parse_args(argv)
    try:
        log = read_log(args.log, args.format, args.truth)
        if args.output_tokens is not None:
            log = log.with_output_tokens(args.output_tokens)
        profile = load_profile(args.profile, engine=args.engine)
        settings = replay_settings(
            log,
            profile,
            args.max_num_seqs,
            args.max_num_batched_tokens,
            args.block_size,
            args.kv_blocks,
            not args.no_prefix_caching,
            args.prefix_tokens,
        )
        result = replay(log, profile, settings)
        plot = args.plot or (args.json.with_suffix(".png") if args.json else None)
        for out in (args.json, plot):
            if out is not None and not out.parent.is_dir():
                raise ValueError(f"{out}: folder {out.parent} does not exist")
        if args.json is not None:
            write_json(result, args.json)
        if plot is not None:
            result.plot(plot)
    except ValueError as err:
        parser.error(str(err))
    print(
        f"{log.source}: {len(log)} requests ({int(log.ok.sum())} succeeded), {log.format} format; "
        f"profile {profile.name}, engine {profile.engine}; {settings}"
    )
    print(result.table())
    for out in (args.json, plot):
        if out is not None:
            print(f"wrote {out}")


def _per_log(values: list | None, n: int, flag: str) -> list:
    """A flag given once applies to every log; given once per log, to each in order."""
    if not values:
        return [None] * n
    if len(values) == 1:
        return values * n
    if len(values) != n:
        raise ValueError(f"{flag} given {len(values)} times for {n} logs: give it once, or once per log")
    return values


def _truth_beside(log: Path) -> Path | None:
    """``<run>_ground_truth.json`` beside an inference-sim ``<run>.json``, if it exists."""
    candidate = log.with_name(f"{log.stem}_ground_truth.json")
    return candidate if candidate.exists() else None


def fit_logs_main(argv: list[str]) -> None:
    """Fit a serving engine to request logs (per-iteration overhead, front-end latency, kernel
    factors) with cross-validation, and write a profile (and the engine) the simulator takes."""
    from burstgym.latency.fitlogs import BOUNDS, DEFAULT_WINDOWS, fit_logs, log_case
    from burstgym.latency.profiles import load_profile
    from burstgym.latency.replay import replay_settings
    from burstgym.latency.requestlog import FORMATS, detect_format, read_log

    parser = OneLineParser(prog="python -m burstgym.calibrate fit-logs", description=fit_logs_main.__doc__)
    parser.add_argument("logs", type=Path, nargs="+", help="request logs (all on one GPU type)")
    parser.add_argument(
        "--profile", action="append", required=True, help="base profile: once for all logs, or once per log"
    )
    parser.add_argument(
        "--engine",
        default=SERVED_ENGINE,
        help=f"base engine: its terms start the fit and stay where not fitted (default {SERVED_ENGINE})",
    )
    parser.add_argument(
        "--truth",
        type=Path,
        action="append",
        default=None,
        help="measured latencies of an inference-sim log, once per log (default: <run>_ground_truth.json "
        "beside it)",
    )
    parser.add_argument("--format", default="auto", choices=("auto", *FORMATS), help="the logs' format")
    parser.add_argument(
        "--output-tokens",
        type=int_at_least(1),
        action="append",
        default=None,
        help="tokens every request generated (ignore_eos runs), once for all logs or once per log",
    )
    parser.add_argument(
        "--prefix-tokens",
        type=int_at_least(0),
        action="append",
        default=None,
        help="shared prefix tokens of a log's prefix groups, once for all logs or once per log",
    )
    parser.add_argument("--no-prefix-caching", action="store_true", help="simulate without prefix caching")
    parser.add_argument(
        "--fit",
        default=None,
        help="comma-separated engine terms to fit (default: those the logs determine); any of "
        + ", ".join(BOUNDS),
    )
    parser.add_argument(
        "--windows",
        type=int_at_least(1),
        default=DEFAULT_WINDOWS,
        help="time windows per log scored in the fit",
    )
    parser.add_argument("--jobs", type=int_at_least(1), default=None, help="worker processes (default: CPUs)")
    parser.add_argument("--no-cv", action="store_true", help="skip the cross-validation")
    parser.add_argument("--engine-name", default="fitted", help="name recorded for the fitted engine")
    parser.add_argument(
        "--out", type=Path, required=True, help="profile JSON: the first log's profile, fitted"
    )
    parser.add_argument("--engine-out", type=Path, default=None, help="also write the engine JSON here")
    args = parser.parse_args(argv)
    try:
        for out in (args.out, args.engine_out):
            if out is not None and not out.parent.is_dir():
                raise ValueError(f"{out}: folder {out.parent} does not exist")
        n = len(args.logs)
        profiles = _per_log(args.profile, n, "--profile")
        truths = _per_log(args.truth, n, "--truth")
        tokens = _per_log(args.output_tokens, n, "--output-tokens")
        prefixes = _per_log(args.prefix_tokens, n, "--prefix-tokens")
        free = tuple(t.strip() for t in args.fit.split(",") if t.strip()) if args.fit else None
        cases = []
        for path, name, truth, out_tokens, prefix in zip(
            args.logs, profiles, truths, tokens, prefixes, strict=True
        ):
            fmt = detect_format(path) if args.format == "auto" else args.format
            if truth is None and fmt == "inference-sim":
                truth = _truth_beside(path)
            log = read_log(path, fmt, truth)
            if out_tokens is not None:
                log = log.with_output_tokens(out_tokens)
            profile = load_profile(name, engine=args.engine)
            settings = replay_settings(
                log, profile, prefix_caching=not args.no_prefix_caching, prefix_tokens=prefix
            )
            cases.append(log_case(log, profile, settings, args.windows))
        engine, report = fit_logs(cases, free, args.jobs, not args.no_cv, name=args.engine_name)
    except ValueError as err:
        parser.error(str(err))
    import json

    from burstgym.latency.profiles import with_engine

    profile = with_engine(cases[0].profile, engine)
    profile = profile.__class__(**{**profile.__dict__, "name": args.out.stem})
    args.out.write_text(json.dumps(profile.to_dict(), indent=2) + "\n")
    if args.engine_out is not None:
        args.engine_out.write_text(json.dumps(engine.to_dict(), indent=2) + "\n")
    print("fitted " + ", ".join(f"{k} = {v:.4g}" for k, v in report["terms"].items()))
    _print_errors("in sample", report["logs"])
    if "cross_validation" in report:
        cv = report["cross_validation"]
        _print_errors(f"held out ({cv['method']})", cv["folds"], key="held_out")
    print(f"wrote {args.out}" + (f" and {args.engine_out}" if args.engine_out else ""))


def _print_errors(title: str, rows: list[dict], key: str = "log") -> None:
    """Print measured and predicted mean TTFT, ITL and E2E with the relative error, one log a line."""
    print(f"{title}: mean TTFT / ITL / E2E, measured -> predicted (error)")
    for r in rows:
        cells = [
            f"{m.upper()} {1e3 * r['measured'][m]:.1f} -> {1e3 * r['predicted'][m]:.1f} ms "
            f"({100 * r['error'][m]:+.1f}%)"
            for m in ("ttft", "itl", "e2e")
        ]
        print(f"  {r[key]}: " + "; ".join(cells))


def main(argv: list[str] | None = None) -> None:
    """``python -m burstgym.calibrate [kernels] --model ...``, ``... fit-serving FILE ...`` or
    ``... replay LOG ...``."""
    import sys

    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "fit-serving":
        fit_serving_main(argv[1:])
    elif argv and argv[0] == "replay":
        replay_main(argv[1:])
    elif argv and argv[0] == "fit-logs":
        fit_logs_main(argv[1:])
    elif argv and argv[0] == "kernels":
        kernels_main(argv[1:], prog="python -m burstgym.calibrate kernels")
    else:
        kernels_main(argv)


if __name__ == "__main__":
    main()
