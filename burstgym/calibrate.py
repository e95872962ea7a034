"""Fit the latency model's GPU constants to kernel timings, and measure them on the local device.

Two users share the fitting code here: ``scripts/fit_profiles.py`` fits the shipped profiles to
Vidur's published kernel timings, and ``python -m burstgym.calibrate`` times a model's kernels
with torch on your own GPU (or CPU), fits the same model and writes a profile JSON and a PNG.

The fitted forms are those of `burstgym.latency` (roofline linear layers, memory-bound decode
attention, FLOP-bound prefill attention, latency + size/bandwidth all-reduce as in the alpha-beta
model of collective communication). Each fit is scored on points held out from it.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
from scipy.optimize import least_squares

from burstgym.latency import (
    GPUConstants,
    ModelConfig,
    Profile,
    build_profile,
    list_models,
    load_model_config,
    load_profile,
)

# Serving overhead is CPU work kernels do not show; a kernel calibration cannot measure it, so a
# local calibration inherits the value fitted for the shipped profiles (see docs/latency.md).
OVERHEAD_REFERENCE_PROFILE = "h100-llama-3-8b-tp1"
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


# --- measuring kernels with torch -------------------------------------------------------------


class Timer:
    """Median wall time of a callable: CUDA events on a GPU, a monotonic clock on a CPU."""

    def __init__(self, device: Any, warmup: int, repeats: int) -> None:
        import torch

        self.torch = torch
        self.device = device
        self.warmup = warmup
        self.repeats = repeats

    def __call__(self, fn: Callable[[], Any]) -> float:
        """Seconds of one call of ``fn`` (median of the repeats, after warm-up calls)."""
        torch = self.torch
        for _ in range(self.warmup):
            fn()
        times = []
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            for _ in range(self.repeats):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end) * 1e-3)
        else:
            for _ in range(self.repeats):
                t0 = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t0)
        return statistics.median(times)


def resolve_device(name: str) -> Any:
    """``auto`` picks CUDA when present; ``cuda`` without a GPU is an error, not a silent CPU run."""
    import torch

    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(
            f"--device {name} requested but torch sees no CUDA GPU "
            f"(torch {torch.__version__}, CUDA build: {torch.version.cuda}); use --device cpu"
        )
    if name not in ("cpu",) and not name.startswith("cuda"):
        raise ValueError(f"unknown device {name!r}: use auto, cpu or cuda[:N]")
    return torch.device(name)


def _dtype(model: ModelConfig, device: Any) -> Any:
    import torch

    # CPUs run half precision through slow fallbacks; measure them in float32 (the tiny config's dtype).
    if device.type == "cpu":
        return torch.float32
    return {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}[model.dtype]


def measure_linear(
    model: ModelConfig, device: Any, tokens: list[int], timer: Timer, progress: Callable[[], None]
) -> np.ndarray:
    """Seconds of the non-attention work of a whole forward pass at each token count.

    One layer is timed (norm, QKV, rotary-like element-wise work, output projection, norm, MLP,
    residual adds) and multiplied by the layer count; the embedding gather is timed once.
    """
    import torch
    import torch.nn.functional as F

    dt_ = _dtype(model, device)
    h, hd = model.hidden_size, model.head_dim
    q_out = (model.num_heads + 2 * model.num_kv_heads) * hd
    up_out = (2 if model.gated_mlp else 1) * model.ffn_size
    w = {
        "qkv": torch.randn(q_out, h, device=device, dtype=dt_) * 0.02,
        "o": torch.randn(h, model.num_heads * hd, device=device, dtype=dt_) * 0.02,
        "up": torch.randn(up_out, h, device=device, dtype=dt_) * 0.02,
        "down": torch.randn(h, model.ffn_size, device=device, dtype=dt_) * 0.02,
        "emb": torch.randn(model.vocab_size, h, device=device, dtype=dt_) * 0.02,
    }
    norm_w = torch.ones(h, device=device, dtype=dt_)
    out = []
    for n in tokens:
        x = torch.randn(n, h, device=device, dtype=dt_)
        ids = torch.randint(0, model.vocab_size, (n,), device=device)

        def layer(x: Any = x) -> Any:
            y = F.rms_norm(x, (h,), norm_w)
            qkv = F.linear(y, w["qkv"])
            qk = qkv[:, : (model.num_heads + model.num_kv_heads) * hd]
            qk = qk * 0.5 + qk.flip(-1) * 0.5  # stands in for rotary: read and write Q and K
            x = x + F.linear(qk[:, : model.num_heads * hd], w["o"])
            y = F.rms_norm(x, (h,), norm_w)
            u = F.linear(y, w["up"])
            u = F.silu(u[:, : model.ffn_size]) * u[:, model.ffn_size :] if model.gated_mlp else F.gelu(u)
            return x + F.linear(u, w["down"])

        with torch.no_grad():
            t_layer = timer(layer)
            t_emb = timer(lambda ids=ids: F.embedding(ids, w["emb"]))
        out.append(model.num_layers * t_layer + t_emb)
        progress()
    return np.asarray(out)


def _sdpa(q: Any, k: Any, v: Any, causal: bool) -> Any:
    import torch.nn.functional as F

    if k.shape[1] != q.shape[1]:  # grouped-query attention: share each KV head across its group
        k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
        v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
    return F.scaled_dot_product_attention(q, k, v, is_causal=causal)


def measure_attention(
    model: ModelConfig,
    device: Any,
    decode_grid: list[tuple[int, int]],
    prompt_lengths: list[int],
    timer: Timer,
    progress: Callable[[], None],
) -> AttentionSamples:
    """Per-layer seconds of decode attention over (batch, context) and of prefill over prompts.

    Uses torch's scaled-dot-product attention (FlashAttention or memory-efficient kernels on a
    GPU). Grouped KV heads are expanded before the call, so GQA models read their KV cache
    group-times on devices where torch has no native GQA kernel: the fit stays per byte read.
    """
    import torch

    dt_ = _dtype(model, device)
    hq, hkv, hd = model.num_heads, model.num_kv_heads, model.head_dim
    rows: list[tuple[bool, int, int, int, float]] = []
    with torch.no_grad():
        for batch, ctx in decode_grid:
            q = torch.randn(batch, hq, 1, hd, device=device, dtype=dt_)
            k = torch.randn(batch, hkv, ctx, hd, device=device, dtype=dt_)
            v = torch.randn_like(k)
            rows.append((False, batch, ctx, 0, timer(lambda q=q, k=k, v=v: _sdpa(q, k, v, False))))
            progress()
        for p in prompt_lengths:
            q = torch.randn(1, hq, p, hd, device=device, dtype=dt_)
            k = torch.randn(1, hkv, p, hd, device=device, dtype=dt_)
            v = torch.randn_like(k)
            rows.append((True, 1, 0, p, timer(lambda q=q, k=k, v=v: _sdpa(q, k, v, True))))
            progress()
    cols = list(zip(*rows, strict=True))
    return attention_samples(model, 1, *cols)


def measure_allreduce(
    device_count: int, sizes: list[int], timer: Timer, progress: Callable[[], None]
) -> np.ndarray:
    """Seconds of an NCCL all-reduce across ``device_count`` local GPUs (single process)."""
    import torch
    import torch.cuda.nccl as nccl

    out = []
    for size in sizes:
        bufs = [torch.empty(size // 2, dtype=torch.float16, device=f"cuda:{i}") for i in range(device_count)]
        out.append(timer(lambda bufs=bufs: nccl.all_reduce(bufs)))
        progress()
    return np.asarray(out)


def token_grid(max_tokens: int) -> list[int]:
    """Token counts from 1 to ``max_tokens``, denser below the memory-to-compute knee."""
    grid = sorted(
        {
            1,
            2,
            4,
            8,
            12,
            16,
            24,
            32,
            48,
            64,
            80,
            96,
            112,
            128,
            160,
            192,
            224,
            256,
            320,
            384,
            448,
            512,
            640,
            768,
            896,
            1024,
            1280,
            1536,
            2048,
            2560,
            3072,
            4096,
        }
    )
    return [n for n in grid if n <= max_tokens]


def device_description(device: Any) -> dict[str, Any]:
    """Name, memory and software versions of the measured device."""
    import torch

    info: dict[str, Any] = {
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "device_type": device.type,
    }
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info.update(
            name=props.name, memory_bytes=float(props.total_memory), device_count=torch.cuda.device_count()
        )
    else:
        info.update(
            name=platform.processor() or platform.machine(),
            device_count=1,
            memory_bytes=float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")),
        )
    return info


def plot_fit(
    path: Path,
    lin: LinearSamples,
    lin_fit: dict[str, float],
    att: AttentionSamples,
    att_fit: dict[str, float],
    title: str,
) -> None:
    """PNG of measured against fitted times: linear part over tokens, attention per sample."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    ax1.loglog(lin.tokens, lin.time_s * 1e3, "o", label="measured")
    order = np.argsort(lin.tokens)
    ax1.loglog(lin.tokens[order], predict_linear(lin_fit, lin)[order] * 1e3, "-", label="fitted")
    ax1.set(xlabel="tokens in the pass", ylabel="linear layers, ms", title="linear layers")
    ax1.legend()
    pred = predict_attention(att_fit, att) * 1e3
    for mask, label in ((~att.is_prefill, "decode"), (att.is_prefill, "prefill")):
        ax2.loglog(att.time_s[mask] * 1e3, pred[mask], "o", label=label)
    lo, hi = float(att.time_s.min() * 1e3), float(att.time_s.max() * 1e3)
    ax2.plot([lo, hi], [lo, hi], "k--", lw=1)
    ax2.set(xlabel="measured, ms per layer", ylabel="fitted, ms per layer", title="attention")
    ax2.legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def calibrate(
    model_name: str,
    device_name: str = "auto",
    out: Path = Path("my-gpu.json"),
    max_tokens: int = 4096,
    warmup: int = 3,
    repeats: int = 10,
    tp: int = 1,
    gpu_idle_w: float = 0.0,
    gpu_busy_w: float = 0.0,
    show_progress: bool = True,
    threads: int | None = None,
) -> tuple[Profile, dict[str, Any]]:
    """Measure, fit and write a profile (JSON at ``out``, PNG beside it); returns it and its fit report."""
    import torch
    from tqdm import tqdm

    if threads:
        torch.set_num_threads(threads)
    model = load_model_config(model_name)
    device = resolve_device(device_name)
    info = device_description(device)
    if tp > 1 and info["device_count"] < tp:
        raise ValueError(
            f"--tp {tp} needs {tp} local GPUs to time the all-reduce; found {info['device_count']}"
        )
    timer = Timer(device, warmup, repeats)
    tokens = token_grid(max_tokens)
    ctx_max = max(max_tokens, 64)
    contexts = sorted({c for c in (16, 64, 256, 1024, 4096, 16384) if c <= ctx_max})
    decode_grid = [(b, c) for b in (1, 8, 32, 64, 128) for c in contexts]
    prompts = [p for p in (16, 32, 64, 128, 256, 512, 1024, 2048, 4096) if p <= max_tokens]
    ar_sizes = [2**k for k in range(11, 27, 2)] if tp > 1 else []
    total = len(tokens) + len(decode_grid) + len(prompts) + len(ar_sizes)
    bar = tqdm(total=total, desc=f"timing {model.name} on {info['name']}", disable=not show_progress)
    lin_s = measure_linear(model, device, tokens, timer, bar.update)
    att = measure_attention(model, device, decode_grid, prompts, timer, bar.update)
    ar_times = measure_allreduce(tp, ar_sizes, timer, bar.update) if tp > 1 else None
    bar.close()

    lin = linear_samples(model, 1, np.asarray(tokens), lin_s)
    lin_fit, lin_report = fit_linear_heldout(lin)
    att_fit, att_report = fit_attention_heldout(att)
    fit_error = {"linear": lin_report, "attention": att_report}
    allreduce: dict[str, list[float]] = {}
    if ar_times is not None:
        allreduce[str(tp)], fit_error["allreduce"] = fit_allreduce(np.asarray(ar_sizes), ar_times)
    reference = load_profile(OVERHEAD_REFERENCE_PROFILE).gpu
    gpu = GPUConstants(
        name=str(info["name"]),
        memory_bytes=float(info["memory_bytes"]),
        **lin_fit,
        **att_fit,
        overhead_s=reference.overhead_s,
        overhead_seq_s=reference.overhead_seq_s,
        allreduce=allreduce,
    )
    provenance = {
        "kind": "measured",
        "source_files": [],
        "device": info,
        "fit_date": dt.date.today().isoformat(),
        "fit_error": fit_error,
        "grid": {
            "tokens": tokens,
            "decode_batch_context": decode_grid,
            "prompt_lengths": prompts,
            "allreduce_bytes": ar_sizes,
            "warmup": warmup,
            "repeats": repeats,
        },
        "notes": (
            f"kernels timed with torch on {info['name']}; serving overhead copied from "
            f"{OVERHEAD_REFERENCE_PROFILE} (not measurable from kernels)"
        ),
    }
    power_note = (
        "per-GPU idle/busy power as given on the command line"
        if gpu_busy_w > 0
        else "power unknown for this device: pass --gpu-busy-w/--gpu-idle-w"
    )
    profile = build_profile(out.stem, gpu, model, tp, gpu_idle_w, gpu_busy_w, power_note, provenance)
    out.write_text(json.dumps(profile.to_dict(), indent=2) + "\n")
    plot_fit(out.with_suffix(".png"), lin, lin_fit, att, att_fit, f"{model.name} on {info['name']}")
    return profile, fit_error


def main(argv: list[str] | None = None) -> None:
    """``python -m burstgym.calibrate``: time a model's kernels on this machine and write a profile."""
    parser = argparse.ArgumentParser(prog="python -m burstgym.calibrate", description=main.__doc__)
    parser.add_argument(
        "--model",
        required=True,
        help=f"a shipped model ({', '.join(list_models())}) or a Hugging Face config.json",
    )
    parser.add_argument("--device", default="auto", help="auto, cpu or cuda[:N]")
    parser.add_argument(
        "--out", type=Path, default=Path("my-gpu.json"), help="profile JSON (PNG written beside)"
    )
    parser.add_argument("--max-tokens", type=int, default=4096, help="largest token count timed")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument(
        "--tp", type=int, default=1, help="tensor-parallel degree (times an all-reduce if > 1)"
    )
    parser.add_argument("--threads", type=int, default=None, help="CPU threads for torch (CPU runs)")
    parser.add_argument("--gpu-idle-w", type=float, default=0.0, help="idle power of one GPU, W")
    parser.add_argument("--gpu-busy-w", type=float, default=0.0, help="busy power (e.g. TDP) of one GPU, W")
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
        )
    except ValueError as err:
        parser.error(str(err))
    print(f"wrote {args.out} and {args.out.with_suffix('.png')}")
    print(
        f"held-out MAPE: linear {report['linear']['heldout_mape']:.1%}, "
        f"attention {report['attention']['heldout_mape']:.1%}"
    )
    print(f"decode step at batch 1: {1e3 * float(profile.step_time(decode_seqs=1, kv_tokens=128)):.3f} ms")


if __name__ == "__main__":
    main()
