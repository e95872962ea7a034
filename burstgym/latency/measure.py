"""Measuring kernels with torch on the local device (a GPU, or a CPU for smoke runs), fitting the
kernel model to them and writing a profile: the work behind ``python -m burstgym.calibrate``.

One layer's GEMMs and element-wise work are timed at token counts from 1 to ``max_tokens``, decode
and prefill attention over batch x context and prompt lengths, and (with ``tp`` local GPUs) an
NCCL all-reduce. CUDA events on a GPU, ``time.perf_counter`` on a CPU. torch is imported only
inside the functions that need it.
"""

from __future__ import annotations

import datetime as dt
import json
import math
import os
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from burstgym.latency.configs import ModelConfig, load_model_config
from burstgym.latency.engines import DEFAULT_ENGINE, load_engine
from burstgym.latency.fit import (
    AttentionSamples,
    LinearSamples,
    attention_samples,
    fit_allreduce,
    fit_attention_heldout,
    fit_linear_heldout,
    linear_samples,
    predict_attention,
    predict_linear,
)
from burstgym.latency.profiles import GPUConstants, Profile, build_profile


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


# The smallest `max_tokens`: the token grid then holds 10 counts and reaches past the memory-bound
# plateau, which the linear fit (five constants and a tile) needs.
MIN_MAX_TOKENS = 64


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
    engine: str = DEFAULT_ENGINE,
) -> tuple[Profile, dict[str, Any]]:
    """Measure, fit and write a profile (JSON at ``out``, PNG beside it); returns it and its fit report.

    Serving overhead cannot be seen in kernels: the profile is composed with the engine calibration
    ``engine`` (its terms for this GPU, or its default GPU's for one it was not fitted on).
    """
    import torch
    from tqdm import tqdm

    for name, value, low in (
        ("max_tokens", max_tokens, MIN_MAX_TOKENS),
        ("warmup", warmup, 0),
        ("repeats", repeats, 1),
        ("tp", tp, 1),
        ("threads", 1 if threads is None else threads, 1),
    ):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
    for name, watts in (("gpu_idle_w", gpu_idle_w), ("gpu_busy_w", gpu_busy_w)):
        if not (isinstance(watts, (int, float)) and math.isfinite(watts) and watts >= 0):
            raise ValueError(f"{name} must be a finite number >= 0, got {watts!r}")
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
    serving = load_engine(engine)
    gpu = GPUConstants(
        name=str(info["name"]),
        memory_bytes=float(info["memory_bytes"]),
        **lin_fit,
        **att_fit,
        overhead_s=0.0,
        overhead_seq_s=0.0,
        allreduce=allreduce,
    )
    engine_key, _ = serving.terms_for(gpu.name)
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
        "engine": {"name": serving.name, "gpu_terms": engine_key},
        "notes": (
            f"kernels timed with torch on {info['name']}; serving overhead from the engine calibration "
            f"{serving.name} ({engine_key} terms; not measurable from kernels)"
        ),
    }
    power_note = (
        "per-GPU idle/busy power as given on the command line"
        if gpu_busy_w > 0
        else "power unknown for this device: pass --gpu-busy-w/--gpu-idle-w"
    )
    profile = build_profile(
        out.stem, gpu, model, tp, gpu_idle_w, gpu_busy_w, power_note, provenance, engine=serving
    )
    out.write_text(json.dumps(profile.to_dict(), indent=2) + "\n")
    plot_fit(out.with_suffix(".png"), lin, lin_fit, att, att_fit, f"{model.name} on {info['name']}")
    return profile, fit_error
