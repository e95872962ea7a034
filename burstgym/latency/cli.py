"""``python -m burstgym.latency show|list|gpus|models|engines|validate``: profiles, engines, fits."""

from __future__ import annotations

from burstgym.latency.cliargs import OneLineParser, int_at_least
from burstgym.latency.configs import list_models
from burstgym.latency.engines import DEFAULT_ENGINE, list_engines, load_engine
from burstgym.latency.profiles import list_gpus, list_profiles, load_gpu, load_profile, show


def _validate_blis(root: str, engine: str, jobs: int | None) -> int:
    """Replay the inference-sim runs and print the validation table (docs/latency.md)."""
    from burstgym.latency import blis

    try:
        names = blis.run_names(root)
    except ValueError as err:
        print(f"{err}; nothing validated")
        return 0
    print(f"{len(names)} runs of {root}, replayed on H100 profiles with engine {engine}")
    print(blis.table(blis.validate_runs(root, engine, jobs)))
    print(
        f"BLIS: {blis.BLIS_SOURCE} (its predictions of the run's means; ITL over the client's token counts)"
    )
    return 0


def _validate_tp8(csv_file: str) -> int:
    """Print the splitwise-2023 engine's held-out error on Splitwise's TP8 runs."""
    from pathlib import Path

    from burstgym.latency import validate

    path = Path(csv_file)
    if not path.is_file():
        print(f"{path}: no such file (splitwise-sim's data/perf_model.csv); nothing validated")
        return 0
    print("splitwise-2023 (fitted on TP2 and TP4) predicting Llama-2-70B at TP8, never fitted:")
    for r in validate.splitwise_tp8(path, validate.shipped_gpus()):
        print(
            f"  {r['gpu'].upper()}: decode MAPE {100 * r['decode_mape']:.1f}% ({r['decode_points']} points), "
            f"prefill MAPE {100 * r['prefill_mape']:.1f}% ({r['prefill_points']} points)"
        )
        errors = [
            f"{int(x['batch'])}x{int(x['tokens'])} {100 * x['error']:+.0f}%" for x in r["residuals_prefill"]
        ]
        print("    prefill errors (prompts x tokens): " + ", ".join(errors))
    return 0


def _validate(data: str | None) -> int:
    """Print the held-out tables of the shipped calibrations (needs the calibration data)."""
    from burstgym.latency import validate
    from burstgym.latency.sources import data_dir

    root = data_dir(data)
    if not (root / "splitwise").is_dir():
        print(f"calibration data not found at {root} (set BURSTGYM_SHARED_DATA or --data); nothing validated")
        return 0
    gpus = validate.shipped_gpus()
    engines = validate.fit_engines(root, gpus)
    sw = engines["splitwise-2023"].provenance["report"]
    print("splitwise-2023: fit on one TP degree, predict the other (Llama-2-70B, Splitwise end-to-end)")
    print(validate.heldout_table(sw))
    for gpu, tps in sw["insample"].items():
        print(
            f"  {gpu} fitted on TP2+TP4: "
            + ", ".join(
                f"TP{tp} decode {100 * r['decode_mape']:.1f}% prefill {100 * r['prefill_mape']:.1f}%"
                for tp, r in tps.items()
            )
        )
    print("vllm-ci: fit on two GPUs, predict the third (vLLM CI latency tests)")
    for r in engines["vllm-ci"].provenance["report"]["leave_one_gpu_out"]:
        print(
            f"  {r['heldout_gpu']} {r['test']}: measured {r['measured_ms']:.0f} ms, "
            f"predicted {r['predicted_ms']:.0f} ms ({100 * r['error']:+.1f}%)"
        )
    for r in engines["vllm-ci"].provenance["report"]["itl_check"]:
        print(
            f"  {r['gpu']} {r['test']}: mean ITL {r['mean_itl_ms']:.1f} ms; predicted decode step "
            f"{r['predicted_ms_batch1_ctx600']:.1f} ms (batch 1) .. {r['predicted_ms_batch4_ctx600']:.1f} ms "
            "(batch 4), 600 context tokens"
        )
    sens = validate.splitwise_prior_sensitivity(root, gpus)
    print(
        f"  with the per-iteration prior fitted on relative error ({sens['prior_overhead_ms']:.2f} ms): "
        + ", ".join(
            f"{r['gpu']} TP{r['fit_tp']}->TP{r['heldout_tp']} decode {100 * r['decode_mape']:.1f}% "
            f"prefill {100 * r['prefill_mape']:.1f}%"
            for r in sens["heldout"]
        )
    )
    ds = engines["distserve-vllm"].provenance["report"]["fit"]
    print(f"distserve-vllm: decode fit MAPE {100 * ds['decode_mape']:.2f}% ({ds['decode_points']} points)")
    print("  residual of DistServe's vLLM decode fits over the A100 kernel model, by model and TP:")
    for r in validate.distserve_residuals(root, gpus["a100"]):
        print(
            f"    {r['model']} TP{r['tp']}: {r['overhead_ms']:.2f} ms/iteration + "
            f"{r['per_seq_us']:.1f} us/sequence"
        )
    energy, report = validate.fit_splitwise_energy(root, gpus["a100"])
    print(
        f"A100 energy: static {energy.static_w:.0f} W, {energy.joule_per_byte * 1e12:.0f} pJ/B, "
        f"{energy.joule_per_flop * 1e12:.2f} pJ/FLOP; average power MAPE {100 * report['power_mape']:.1f}% "
        f"(leave one run out {100 * report['power_mape_leave_one_out']:.1f}%, {report['runs']} runs)"
    )
    return 0


def main(argv: list[str] | None = None) -> None:
    """``python -m burstgym.latency show|list|engines|validate``: inspect the shipped profiles."""
    parser = OneLineParser(prog="python -m burstgym.latency", description=main.__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    show_p = sub.add_parser("show", help="table of step times over batch x context")
    show_p.add_argument("profile", help="profile name or path to a profile JSON")
    show_p.add_argument("--engine", default=None, help="recompose with this engine calibration")
    show_p.add_argument(
        "--batches",
        type=int_at_least(1),
        nargs="+",
        default=[1, 8, 32, 64, 128, 256],
        help="decoding sequences",
    )
    show_p.add_argument(
        "--contexts",
        type=int_at_least(1),
        nargs="+",
        default=[128, 512, 1024, 2048, 4096, 8192],
        help="context tokens per sequence",
    )
    sub.add_parser("list", help="names of the shipped profiles")
    sub.add_parser("gpus", help="GPUs profiles compose on (<gpu>-<model>-tp<N>), with their source")
    sub.add_parser("models", help="shipped model architectures (<gpu>-<model>-tp<N>)")
    sub.add_parser("engines", help="names and descriptions of the engine calibrations")
    val_p = sub.add_parser("validate", help="refit the engine calibrations and print their held-out errors")
    val_p.add_argument(
        "--data", default=None, help="calibration folder (default: ../shared/data/calibration)"
    )
    val_p.add_argument(
        "--blis",
        default=None,
        help="instead: replay the inference-sim runs of this checkout of inference-sim/training (ab8e76b)",
    )
    val_p.add_argument("--engine", default="vllm-serve", help="engine the --blis runs are replayed with")
    val_p.add_argument(
        "--splitwise-tp8",
        default=None,
        help="instead: predict the TP8 runs of splitwise-sim's data/perf_model.csv (8f99e7d) at this path",
    )
    val_p.add_argument("--jobs", type=int_at_least(1), default=None, help="worker processes (--blis)")
    args = parser.parse_args(argv)
    if args.command == "list":
        print("\n".join(list_profiles()))
        return
    if args.command == "gpus":
        for key in list_gpus():
            family = load_gpu(key)
            source = family.provenance
            print(f"{key}: {family.gpu.name} ({source.get('kind')}): {source.get('detail')}")
        return
    if args.command == "models":
        print("\n".join(list_models()))
        return
    if args.command == "engines":
        for name in list_engines():
            mark = " (default)" if name == DEFAULT_ENGINE else ""
            print(f"{name}{mark}: {load_engine(name).description}")
        return
    if args.command == "validate":
        if args.blis:
            raise SystemExit(_validate_blis(args.blis, args.engine, args.jobs))
        if args.splitwise_tp8:
            raise SystemExit(_validate_tp8(args.splitwise_tp8))
        raise SystemExit(_validate(args.data))
    try:
        profile = load_profile(args.profile, engine=args.engine)
    except ValueError as err:
        parser.error(str(err))
    print(show(profile, args.batches, args.contexts))


if __name__ == "__main__":
    main()
