"""Fitting: kernel constants to kernel timings, engine terms to end-to-end step times, energy
constants to measured power.

Every fit is least squares on relative error in log-parameters (all constants are positive rates,
times or energies) and is scored on points held out of it. The fitted forms are those of
`burstgym.latency`: roofline linear layers, memory-bound decode attention, FLOP-bound prefill
attention, latency + size/bandwidth all-reduce as in the alpha-beta model of collective
communication (kernels); per-iteration, per-sequence, per-layer and ring all-reduce terms
(`burstgym.latency.engines`); and the energy roofline of `burstgym.latency.power`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import numpy as np
from scipy.optimize import least_squares

from burstgym.latency.configs import ModelConfig
from burstgym.latency.engines import EngineTerms, apply_engine
from burstgym.latency.model import LatencyModel, step_time
from burstgym.latency.power import GPUEnergy, compose_power_model, energy_j

TILE_CANDIDATES = (1, 16, 32, 64, 128)


class LinearSamples(NamedTuple):
    """Timings of the non-attention part of a forward pass (all layers plus the embedding)."""

    tokens: np.ndarray  # tokens in the pass
    time_s: np.ndarray  # measured seconds
    layers: np.ndarray  # transformer layers
    layer_weight_bytes: np.ndarray  # weight bytes of one layer on one rank
    layer_flops_per_token: np.ndarray  # 2 x parameters of one layer on one rank
    elementwise_bytes: np.ndarray  # element-wise HBM bytes per token per layer
    embed_bytes: np.ndarray  # embedding bytes gathered per token


def linear_samples(model: ModelConfig, tp: int, tokens: np.ndarray, time_s: np.ndarray) -> LinearSamples:
    """Samples of one model at one TP degree, with the architecture numbers the fit needs."""
    n = len(tokens)
    full = np.ones(n)
    return LinearSamples(
        tokens=np.asarray(tokens, float),
        time_s=np.asarray(time_s, float),
        layers=full * model.num_layers,
        layer_weight_bytes=full * model.layer_params(tp) * model.dtype_bytes,
        layer_flops_per_token=full * 2 * model.layer_params(tp),
        elementwise_bytes=full * model.elementwise_bytes_per_token(tp),
        embed_bytes=full * model.hidden_size * model.dtype_bytes,
    )


def concat_samples(parts: list[NamedTuple]) -> Any:
    """Join sample tuples of one kind field by field."""
    kind = type(parts[0])
    return kind(*(np.concatenate([getattr(p, f) for p in parts]) for f in kind._fields))


def subset(samples: Any, mask: np.ndarray) -> Any:
    """The samples where ``mask`` holds."""
    return type(samples)(*(np.asarray(v)[mask] for v in samples))


LINEAR_KEYS = ("mem_bw", "flops", "knee_p", "layer_fixed_s", "elementwise_bw")


def predict_linear(c: dict[str, float], s: LinearSamples) -> np.ndarray:
    """Seconds of the linear part as `burstgym.latency.step_time` composes it."""
    tiled = np.ceil(s.tokens / c["tile_tokens"]) * c["tile_tokens"]
    mem = s.layer_weight_bytes / c["mem_bw"]
    comp = s.layer_flops_per_token * tiled / c["flops"]
    top = np.maximum(mem, comp)
    p = c["knee_p"]
    roof = top * ((mem / top) ** p + (comp / top) ** p) ** (1.0 / p)
    elementwise = s.tokens * (s.layers * s.elementwise_bytes + s.embed_bytes) / c["elementwise_bw"]
    return s.layers * (c["layer_fixed_s"] + roof) + elementwise


def _fit(
    keys: tuple[str, ...],
    x0: list[float],
    bounds: tuple[list[float], list[float]],
    predict: Callable[[dict[str, float]], np.ndarray],
    measured: np.ndarray,
) -> dict[str, float]:
    """Least squares on relative error, in log-parameters (all constants are positive rates/times)."""

    def residual(x: np.ndarray) -> np.ndarray:
        return predict(dict(zip(keys, np.exp(x), strict=True))) / measured - 1.0

    lo, hi = np.log(bounds[0]), np.log(bounds[1])
    start = np.clip(np.log(x0), lo + 1e-9, hi - 1e-9)
    result = least_squares(residual, start, bounds=(lo, hi))
    return {k: float(v) for k, v in zip(keys, np.exp(result.x), strict=True)}


def fit_linear(s: LinearSamples, tile: float) -> dict[str, float]:
    """Fit effective bandwidth, compute, knee shape, per-layer floor and element-wise bandwidth."""
    x0 = [1e12, 1e13, 2.0, 1e-5, 1e11]
    bounds = ([1e6, 1e6, 1.0, 1e-9, 1e6], [1e14, 1e16, 30.0, 1e-1, 1e14])
    fitted = _fit(LINEAR_KEYS, x0, bounds, lambda c: predict_linear({**c, "tile_tokens": tile}, s), s.time_s)
    return {**fitted, "tile_tokens": float(tile)}


def mape(predicted: np.ndarray, measured: np.ndarray) -> float:
    """Mean absolute percentage error, as a fraction."""
    return float(np.mean(np.abs(np.asarray(predicted) / np.asarray(measured) - 1.0)))


def holdout_mask(n: int, fraction: float, seed: int) -> np.ndarray:
    """A reproducible random choice of ``fraction`` of ``n`` points to hold out of a fit."""
    rng = np.random.default_rng(seed)
    mask = rng.random(n) < fraction
    if n >= 2 and not mask.any():
        mask[rng.integers(n)] = True
    return mask


def fit_linear_heldout(
    s: LinearSamples, seed: int = 0, fraction: float = 0.2
) -> tuple[dict[str, float], dict]:
    """Choose the GEMM tile by held-out error, fit on the rest, and report the held-out MAPE.

    The reported constants are refitted on every point with the chosen tile.
    """
    test = holdout_mask(len(s.tokens), fraction, seed)
    train, held = subset(s, ~test), subset(s, test)
    scores = {}
    for tile in TILE_CANDIDATES:
        scores[tile] = mape(predict_linear(fit_linear(train, tile), held), held.time_s)
    best = min(scores, key=scores.get)
    report = {
        "heldout_mape": scores[best],
        "heldout_points": int(test.sum()),
        "fit_points": int((~test).sum()),
        "heldout_mape_by_tile": {str(k): round(v, 4) for k, v in scores.items()},
    }
    return fit_linear(s, best), report


class AttentionSamples(NamedTuple):
    """Per-layer attention kernel timings, decode and prefill mixed."""

    is_prefill: np.ndarray  # bool
    batch: np.ndarray  # decoding sequences (decode) / prompts (prefill)
    kv_tokens: np.ndarray  # context tokens read per sequence (decode) / prefix before the chunk
    chunk: np.ndarray  # prefill query tokens per prompt (0 for decode)
    kv_bytes_per_token: np.ndarray  # KV bytes per token of one layer on one rank
    pair_flops: np.ndarray  # FLOPs per (query, key) pair of one layer on one rank
    time_s: np.ndarray  # seconds per layer


def attention_samples(
    model: ModelConfig, tp: int, is_prefill, batch, kv_tokens, chunk, time_s
) -> AttentionSamples:
    """Samples of one model at one TP degree."""
    n = len(time_s)
    kv_layer = model.kv_bytes_per_token(tp) / model.num_layers
    return AttentionSamples(
        is_prefill=np.asarray(is_prefill, bool),
        batch=np.asarray(batch, float),
        kv_tokens=np.asarray(kv_tokens, float),
        chunk=np.asarray(chunk, float),
        kv_bytes_per_token=np.full(n, kv_layer),
        pair_flops=np.full(n, 4.0 * model.num_heads / tp * model.head_dim),
        time_s=np.asarray(time_s, float),
    )


ATTENTION_KEYS = ("attn_layer_fixed_s", "attn_seq_layer_s", "attn_bw", "prefill_layer_fixed_s", "attn_flops")


def predict_attention(c: dict[str, float], s: AttentionSamples) -> np.ndarray:
    """Seconds per layer as `step_time` composes them (FlashAttention/PagedAttention roofline).

    Decode reads every sequence's KV cache once (memory-bound); prefill does 4 x heads x head_dim
    FLOPs per (query, key) pair of the causal chunk (compute-bound).
    """
    pairs = s.batch * s.chunk * (s.kv_tokens + (s.chunk + 1.0) / 2.0)
    decode = (
        c["attn_layer_fixed_s"]
        + c["attn_seq_layer_s"] * s.batch
        + s.kv_bytes_per_token * s.batch * s.kv_tokens / c["attn_bw"]
    )
    prefill = c["prefill_layer_fixed_s"] + s.pair_flops * pairs / c["attn_flops"]
    return np.where(s.is_prefill, prefill, decode)


def fit_attention(s: AttentionSamples) -> dict[str, float]:
    """Fit decode and prefill attention constants."""
    x0 = [1e-5, 1e-7, 1e12, 1e-5, 1e14]
    bounds = ([1e-9, 1e-12, 1e6, 1e-9, 1e6], [1e-1, 1e-2, 1e14, 1e-1, 1e16])
    return _fit(ATTENTION_KEYS, x0, bounds, lambda c: predict_attention(c, s), s.time_s)


def fit_attention_heldout(s: AttentionSamples) -> tuple[dict[str, float], dict]:
    """Fit on all samples; score by leave-one-out (each sample predicted by a fit without it)."""
    errors = []
    for i in range(len(s.time_s)):
        keep = np.arange(len(s.time_s)) != i
        c = fit_attention(subset(s, keep))
        errors.append(abs(predict_attention(c, subset(s, ~keep))[0] / s.time_s[i] - 1.0))
    errors_arr = np.asarray(errors)
    report = {
        "heldout_mape": float(errors_arr.mean()),
        "heldout_method": "leave-one-out",
        "points": len(errors),
        "heldout_mape_decode": float(errors_arr[~s.is_prefill].mean()) if (~s.is_prefill).any() else None,
        "heldout_mape_prefill": float(errors_arr[s.is_prefill].mean()) if s.is_prefill.any() else None,
    }
    return fit_attention(s), report


def fit_allreduce(size_bytes: np.ndarray, time_s: np.ndarray, seed: int = 0) -> tuple[list[float], dict]:
    """Alpha-beta fit of one all-reduce, ``t = alpha + bytes / bandwidth``, with a held-out MAPE."""
    size_bytes, time_s = np.asarray(size_bytes, float), np.asarray(time_s, float)

    def fit(mask: np.ndarray) -> dict[str, float]:
        return _fit(
            ("alpha", "bw"),
            [2e-5, 1e11],
            ([1e-8, 1e6], [1e-1, 1e14]),
            lambda c: c["alpha"] + size_bytes[mask] / c["bw"],
            time_s[mask],
        )

    test = holdout_mask(len(time_s), 0.2, seed)
    c = fit(~test)
    err = mape(c["alpha"] + size_bytes[test] / c["bw"], time_s[test])
    c = fit(np.ones(len(time_s), bool))
    return [c["alpha"], c["bw"]], {"heldout_mape": err, "points": len(time_s)}


# --- engine terms from end-to-end step times ---------------------------------------------------


class ServingPoints(NamedTuple):
    """End-to-end step times of one model on one GPU: a prefill of a batch, or one decode iteration."""

    is_prefill: np.ndarray  # bool
    batch: np.ndarray  # prompts in the prefill / sequences decoding in the iteration
    tokens: np.ndarray  # prompt tokens per prompt (prefill) / mean context tokens per sequence (decode)
    tp: np.ndarray  # tensor-parallel degree
    time_s: np.ndarray  # measured seconds


def serving_points(is_prefill, batch, tokens, tp, time_s) -> ServingPoints:
    """Points from sequences (or arrays) of equal length."""
    return ServingPoints(
        is_prefill=np.asarray(is_prefill, bool),
        batch=np.asarray(batch, float),
        tokens=np.asarray(tokens, float),
        tp=np.asarray(tp, int),
        time_s=np.asarray(time_s, float),
    )


def serving_args(p: ServingPoints) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """`step_time` arguments (prefill tokens, decode sequences, KV tokens, prefill pairs) of each point.

    A prefill of B prompts of L tokens is one iteration of B x L tokens and B x L (L + 1) / 2
    attention pairs; a decode iteration of B sequences reads B x context KV entries.
    """
    prefill_tokens = np.where(p.is_prefill, p.batch * p.tokens, 0.0)
    decode_seqs = np.where(p.is_prefill, 0.0, p.batch)
    kv_tokens = np.where(p.is_prefill, 0.0, p.batch * p.tokens)
    pairs = np.where(p.is_prefill, p.batch * p.tokens * (p.tokens + 1.0) / 2.0, 0.0)
    return prefill_tokens, decode_seqs, kv_tokens, pairs


_step_time_jit = jax.jit(step_time)

ENGINE_KEYS = ("overhead_s", "overhead_seq_s", "layer_s", "allreduce_step_s", "allreduce_bw_factor")
_ENGINE_START = {
    "overhead_s": 5e-3,
    "overhead_seq_s": 3e-5,
    "layer_s": 1e-5,
    "allreduce_step_s": 5e-6,
    "allreduce_bw_factor": 1.0,
}
_ENGINE_BOUNDS = {
    "overhead_s": (1e-9, 1.0),
    "overhead_seq_s": (1e-12, 1e-1),
    "layer_s": (1e-12, 1e-2),
    "allreduce_step_s": (1e-12, 1e-2),
    "allreduce_bw_factor": (1e-3, 1e3),
}


def step_times(model: LatencyModel, prefill_tokens, decode_seqs, kv_tokens, prefill_pairs) -> np.ndarray:
    """`step_time` in float64 (fits need more precision than the simulator's float32)."""
    with jax.enable_x64(True):
        model = LatencyModel(*(np.float64(v) for v in model))
        args = (np.asarray(a, np.float64) for a in (prefill_tokens, decode_seqs, kv_tokens, prefill_pairs))
        return np.asarray(_step_time_jit(model, *args), np.float64)


def predict_serving(
    kernels: dict[int, LatencyModel], model: ModelConfig, terms: EngineTerms, p: ServingPoints
) -> np.ndarray:
    """Seconds of each point: the kernel model at its TP degree (``kernels[tp]``) plus the engine."""
    out = np.empty(len(p.time_s))
    args = serving_args(p)
    for tp in np.unique(p.tp):
        mask = p.tp == tp
        lat = apply_engine(kernels[int(tp)], terms, model, int(tp))
        out[mask] = step_times(lat, *(a[mask] for a in args))
    return out


def fit_engine_terms(
    kernels: dict[int, LatencyModel],
    model: ModelConfig,
    p: ServingPoints,
    free: Sequence[str],
    base: EngineTerms | None = None,
) -> EngineTerms:
    """Fit the ``free`` engine terms (names of `EngineTerms` fields) to ``p``; the others stay as in
    ``base``. Least squares on relative error, each term positive."""
    base = base if base is not None else EngineTerms()
    keys = tuple(free)
    unknown = [k for k in keys if k not in ENGINE_KEYS]
    if unknown:
        raise ValueError(f"unknown engine term {unknown[0]!r}; known: {', '.join(ENGINE_KEYS)}")
    if not keys:
        return base

    def terms(x: np.ndarray) -> EngineTerms:
        return EngineTerms(**{**base.__dict__, **dict(zip(keys, (float(v) for v in np.exp(x)), strict=True))})

    lo = np.log([_ENGINE_BOUNDS[k][0] for k in keys])
    hi = np.log([_ENGINE_BOUNDS[k][1] for k in keys])
    start = []
    for k in keys:
        current = getattr(base, k)
        value = current if current not in (None, 0.0) else _ENGINE_START[k]
        start.append(np.clip(np.log(value), lo[len(start)] + 1e-9, hi[len(start)] - 1e-9))
    result = least_squares(
        lambda x: predict_serving(kernels, model, terms(x), p) / p.time_s - 1.0,
        np.asarray(start),
        bounds=(lo, hi),
        x_scale=1.0,
    )
    return terms(result.x)


def serving_report(predicted: np.ndarray, p: ServingPoints) -> dict[str, Any]:
    """MAPE by phase (``None`` where a phase has no points) and the number of points."""
    err = np.abs(predicted / p.time_s - 1.0)
    out: dict[str, Any] = {}
    for phase, mask in (("decode", ~p.is_prefill), ("prefill", p.is_prefill)):
        out[f"{phase}_mape"] = float(err[mask].mean()) if mask.any() else None
        out[f"{phase}_points"] = int(mask.sum())
    return out


# --- energy constants from measured power ------------------------------------------------------


class PowerRuns(NamedTuple):
    """Measured runs: a prefill of ``batch`` prompts of ``prompt`` tokens, then ``decode_iters``
    decode iterations of the batch, and the node's average power over the run."""

    tp: np.ndarray
    batch: np.ndarray
    prompt: np.ndarray
    decode_iters: np.ndarray
    prefill_s: np.ndarray  # seconds of the prefill
    decode_iter_s: np.ndarray  # mean seconds of one decode iteration
    power_w: np.ndarray  # average watts of the node (all TP GPUs) over the run


def run_energy(
    energy: GPUEnergy, kernels: dict[int, LatencyModel], rates: tuple[float, float], runs: PowerRuns
) -> np.ndarray:
    """Joules of each run under ``energy``: `energy_j` of its prefill plus its decode iterations.

    ``kernels[tp]`` is the kernel-only model at each TP degree and ``rates`` the kernel fit's
    effective (bytes/s, FLOP/s) (see `compose_power_model`). Decode iteration k (1-based) of a batch
    B after prompts of L tokens reads B (L + k) KV entries, so the decode part sums in closed form
    (energy is affine in its arguments).
    """
    out = np.empty(len(runs.tp))
    for i in range(len(runs.tp)):
        lat = kernels[int(runs.tp[i])]
        pm = compose_power_model(energy, lat, int(runs.tp[i]), rates)
        b, length, n = runs.batch[i], runs.prompt[i], runs.decode_iters[i]
        prefill = energy_j(pm, runs.prefill_s[i], b * length, 0.0, b * length * (length + 1) / 2, 1.0)
        kv = b * (n * length + n * (n + 1) / 2)
        decode = energy_j(pm, n * runs.decode_iter_s[i], n * b, kv, 0.0, n)
        out[i] = float(prefill) + float(decode)
    return out


def run_duration(runs: PowerRuns) -> np.ndarray:
    """Seconds of each run: its prefill plus its decode iterations."""
    return runs.prefill_s + runs.decode_iters * runs.decode_iter_s


ENERGY_KEYS = ("static_w", "joule_per_byte")  # joule_per_flop follows: static + compute roof = TDP


def fit_gpu_energy(
    kernels: dict[int, LatencyModel],
    rates: tuple[float, float],
    runs: PowerRuns,
    name: str,
    idle_w: float,
    tdp_w: float,
    source: str,
) -> GPUEnergy:
    """Fit the static power and the energy per byte of one GPU to the runs' average power.

    Compute-bound work is taken to draw the board limit: ``static_w`` plus the compute-roof power
    equals ``tdp_w`` (Splitwise's peak power readings, which come from the compute-bound prefill,
    are at the TDP), which fixes the energy per FLOP. ``static_w`` stays between ``idle_w`` and
    ``tdp_w``. Together with the cap at ``tdp_w`` this makes busy power grow with the work through
    the balance point, where the uncapped energy roofline would peak.
    """
    measured = runs.power_w * run_duration(runs)

    def energy(x: np.ndarray) -> GPUEnergy:
        static, jpb = np.exp(x)
        jpf = (tdp_w - static) / rates[1]
        return GPUEnergy(name, idle_w, tdp_w, float(static), float(jpb), float(jpf), source)

    lo = np.log([max(idle_w, 1e-3), 1e-14])
    hi = np.log([0.999 * tdp_w, 1e-8])
    start = np.clip(np.log([0.4 * tdp_w, 1e-10]), lo + 1e-9, hi - 1e-9)
    with jax.enable_x64(True):
        result = least_squares(
            lambda x: run_energy(energy(x), kernels, rates, runs) / measured - 1.0, start, bounds=(lo, hi)
        )
    return energy(result.x)


def energy_report(
    kernels: dict[int, LatencyModel], rates: tuple[float, float], runs: PowerRuns, fitted: GPUEnergy
) -> dict[str, Any]:
    """In-sample MAPE of the average power, and leave-one-run-out MAPE (each run predicted by a fit
    without it)."""
    duration = run_duration(runs)
    with jax.enable_x64(True):
        predicted = run_energy(fitted, kernels, rates, runs) / duration
    loo = []
    for i in range(len(runs.tp)):
        keep = np.arange(len(runs.tp)) != i
        sub = PowerRuns(*(np.asarray(v)[keep] for v in runs))
        e = fit_gpu_energy(kernels, rates, sub, fitted.name, fitted.idle_w, fitted.tdp_w, fitted.source)
        one = PowerRuns(*(np.asarray(v)[~keep] for v in runs))
        with jax.enable_x64(True):
            loo.append(
                abs(run_energy(e, kernels, rates, one)[0] / run_duration(one)[0] / one.power_w[0] - 1.0)
            )
    return {
        "power_mape": mape(predicted, runs.power_w),
        "power_mape_leave_one_out": float(np.mean(loo)),
        "runs": int(len(runs.tp)),
        "by_tp": {
            str(int(tp)): mape(predicted[runs.tp == tp], runs.power_w[runs.tp == tp])
            for tp in np.unique(runs.tp)
        },
    }
