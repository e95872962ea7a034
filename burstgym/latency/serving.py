"""Fit an engine calibration to your own end-to-end measurements: ``calibrate fit-serving``.

Input: a CSV of measured step times of one model on one GPU type (the base profile's), one row per
measurement, with a header line naming these columns (order free, extra columns ignored):

=================  ======================================================================
``phase``          ``prefill`` or ``decode``
``batch_size``     prompts prefilled together (prefill), or sequences decoding together (decode)
``prompt_tokens``  prefill rows: tokens of each prompt (prefilled from scratch)
``context_tokens`` decode rows: mean context (KV) tokens per sequence over the measured iterations
``time_ms``        prefill: milliseconds of the prefill of the whole batch (one iteration);
                   decode: mean milliseconds of one decode iteration of the batch
``tp``             optional: tensor-parallel degree of the row (default: the base profile's)
=================  ======================================================================

Blank lines and lines starting with ``#`` are skipped. Errors name the file, the line and the
column. The engine terms (`burstgym.latency.engines.EngineTerms`) the data can determine are
fitted, the others are kept from the base profile's engine, and a profile JSON is written that
`load_profile` reads; its provenance says which terms were fitted and their in-sample error.
"""

from __future__ import annotations

import datetime as dt
import json
import math
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import numpy as np

from burstgym.latency.csvlines import csv_rows
from burstgym.latency.engines import DEFAULT_ENGINE, Engine, load_engine
from burstgym.latency.fit import (
    ENGINE_KEYS,
    ServingPoints,
    fit_engine_terms,
    predict_serving,
    serving_points,
    serving_report,
)
from burstgym.latency.profiles import Profile, compose_kernels, load_profile, with_engine

COLUMNS = ("phase", "batch_size", "prompt_tokens", "context_tokens", "time_ms", "tp")
REQUIRED = ("phase", "batch_size", "time_ms")


def _number(text: str, where: str, column: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"{where}: column {column!r}: not a number: {text!r}") from None
    if not math.isfinite(value):
        raise ValueError(f"{where}: column {column!r}: not a finite number: {text!r}")
    return value


def _positive_int(text: str, where: str, column: str) -> int:
    value = _number(text, where, column)
    if value < 1 or value != int(value):
        raise ValueError(f"{where}: column {column!r}: must be a positive integer, got {text!r}")
    return int(value)


def read_serving_csv(path: str | Path, default_tp: int) -> ServingPoints:
    """Parse a measurement CSV (format in the module docstring) into `ServingPoints`."""
    rows: list[tuple[bool, int, float, int, float]] = []
    for where, row in csv_rows(path, REQUIRED):
        phase = row["phase"].lower()
        if phase not in ("prefill", "decode"):
            raise ValueError(f"{where}: column 'phase': expected 'prefill' or 'decode', got {row['phase']!r}")
        batch = _positive_int(row["batch_size"], where, "batch_size")
        column = "prompt_tokens" if phase == "prefill" else "context_tokens"
        if not row.get(column, ""):
            raise ValueError(f"{where}: column {column!r}: required for a {phase} row")
        tokens = _number(row[column], where, column)
        if tokens <= 0 if phase == "prefill" else tokens < 0:
            raise ValueError(f"{where}: column {column!r}: must be positive, got {row[column]!r}")
        time_ms = _number(row["time_ms"], where, "time_ms")
        if time_ms <= 0:
            raise ValueError(f"{where}: column 'time_ms': must be positive, got {row['time_ms']!r}")
        tp = _positive_int(row["tp"], where, "tp") if row.get("tp", "") else default_tp
        rows.append((phase == "prefill", batch, tokens, tp, time_ms * 1e-3))
    if not rows:
        raise ValueError(f"{path}: no measurement rows")
    is_prefill, batch, tokens, tp, time_s = zip(*rows, strict=True)
    return serving_points(is_prefill, batch, tokens, tp, time_s)


def identifiable_terms(p: ServingPoints) -> tuple[str, ...]:
    """Engine terms the measurements can determine.

    - ``overhead_s`` always;
    - ``overhead_seq_s`` when decode rows cover two or more batch sizes;
    - ``allreduce_step_s`` when rows cover two or more TP degrees, one above 1 (at one TP degree
      the all-reduce latency is a constant per iteration, like ``overhead_s``);
    - ``allreduce_bw_factor`` when prefill rows above TP 1 cover two or more token counts.
    """
    free = ["overhead_s"]
    if len(np.unique(p.batch[~p.is_prefill])) >= 2:
        free.append("overhead_seq_s")
    tps = np.unique(p.tp)
    if len(tps) >= 2 and tps.max() > 1:
        free.append("allreduce_step_s")
    tp_prefill = p.is_prefill & (p.tp > 1)
    if len(np.unique((p.batch * p.tokens)[tp_prefill])) >= 2:
        free.append("allreduce_bw_factor")
    return tuple(free)


def fit_serving(
    csv_path: str | Path,
    base: str | Path = "h100-llama-3-8b-tp1",
    engine_name: str | None = None,
    free: tuple[str, ...] | None = None,
    out: str | Path | None = None,
) -> tuple[Profile, dict[str, Any]]:
    """Fit engine terms to the measurements in ``csv_path`` over the kernels of profile ``base``.

    :param base: the profile (name or path) whose GPU constants and model the measurements were
        taken with; its engine's terms are kept for what the data cannot determine.
    :param engine_name: name recorded for the fitted engine (default ``fit-<csv stem>``).
    :param free: terms to fit (default: `identifiable_terms`).
    :param out: where to write the profile JSON (nothing written when None).
    :returns: the fitted profile and the fit report.
    """
    profile = load_profile(base)
    points = read_serving_csv(csv_path, profile.tp)
    free = tuple(free) if free is not None else identifiable_terms(points)
    unknown = [k for k in free if k not in ENGINE_KEYS]
    if unknown:
        raise ValueError(f"unknown engine term {unknown[0]!r}; known: {', '.join(ENGINE_KEYS)}")
    kernels = {}
    for tp in np.unique(points.tp):
        try:
            kernels[int(tp)] = compose_kernels(profile.gpu, profile.model, int(tp), serving=False)
        except ValueError as err:
            raise ValueError(f"{csv_path}: column 'tp': {err}") from None
    start = profile.engine_terms
    if start is None:
        start = load_engine(DEFAULT_ENGINE).terms_for(profile.gpu.name)[1]
    if "allreduce_step_s" in free and start.allreduce_step_s is None:
        start = replace(start, allreduce_step_s=0.0)
    terms = fit_engine_terms(kernels, profile.model, points, free, base=start)
    report = serving_report(predict_serving(kernels, profile.model, terms, points), points)
    name = engine_name or f"fit-{Path(csv_path).stem}"
    key = profile.gpu.name.lower()
    engine = Engine(
        name=name,
        description=f"fitted to {Path(csv_path).name} over the kernels of {profile.name}",
        gpus={key: terms},
        default_gpu=key,
        provenance={"source_files": [str(csv_path)]},
    )
    provenance = {
        **profile.provenance,
        "engine": {
            "name": name,
            "fitted_by": "python -m burstgym.calibrate fit-serving",
            "source_file": str(csv_path),
            "base_profile": profile.name,
            "base_engine": profile.engine,
            "fitted_terms": list(free),
            "kept_terms": [k for k in ENGINE_KEYS if k not in free],
            "fit_date": dt.date.today().isoformat(),
            "fit_error": report,
        },
    }
    fitted = with_engine(profile, engine)
    fitted = replace(
        fitted, name=Path(out).stem if out is not None else f"{profile.name}-{name}", provenance=provenance
    )
    if out is not None:
        Path(out).write_text(json.dumps(fitted.to_dict(), indent=2) + "\n")
    return fitted, {"fitted_terms": list(free), "terms": asdict(terms), **report}
