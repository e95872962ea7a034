"""Readers of the public calibration data (shared/data/calibration, see its SOURCES.md) and the
published figures the shipped calibrations are fitted to.

The data files are read where they lie and never copied into the repository; only fitted numbers
are committed, with a note of the file they came from. Each reader states what it excludes and why.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from burstgym.latency.configs import load_model_config
from burstgym.latency.fit import (
    AttentionSamples,
    LinearSamples,
    PowerRuns,
    ServingPoints,
    attention_samples,
    concat_samples,
    fit_allreduce,
    linear_samples,
    serving_points,
)

REPO = Path(__file__).resolve().parents[2]

VIDUR_MODELS = {  # Vidur's folder name -> burstgym model file
    "Llama-2-7b-hf": "llama-2-7b",
    "Meta-Llama-3-8B": "llama-3-8b",
    "Llama-2-70b-hf": "llama-2-70b",
    "Meta-Llama-3-70B": "llama-3-70b",
    "CodeLlama-34b-Instruct-hf": "codellama-34b",
    "phi-2": "phi-2",
}
SPLITWISE_FILE = "splitwise/perf_model_llama2-70b_tp2_tp4.csv"
SPLITWISE_GPUS = {"a100": "a100-80gb", "h100": "h100-80gb"}  # burstgym GPU family -> CSV hardware
SPLITWISE_PCAP = "h100-80gb-pcap"
DISTSERVE_VLLM_FILE = "distserve/profiler-a100-80g.vllm.json"


def data_dir(arg: str | Path | None = None) -> Path:
    """The calibration folder: ``arg``, $BURSTGYM_SHARED_DATA/calibration, or ../shared/data/calibration."""
    if arg:
        return Path(arg)
    env = os.environ.get("BURSTGYM_SHARED_DATA")
    base = Path(env) if env else REPO.parent / "shared" / "data"
    return base / "calibration"


# --- Vidur kernel timings ----------------------------------------------------------------------


def read_vidur_linear(root: Path, gpu: str) -> tuple[dict[tuple[str, int], LinearSamples], list[str]]:
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


def read_vidur_attention(root: Path) -> AttentionSamples:
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


def read_vidur_allreduce(root: Path, platform: str) -> dict[str, tuple[list[float], dict]]:
    """Alpha-beta fits of Vidur's all-reduce timings inside one node (rank 0), by TP degree."""
    df = pd.read_csv(root / "vidur" / "network" / platform / "all_reduce.csv")
    df = df[(df["rank"] == 0) & (df.devices_per_node == df.num_workers)]
    return {
        str(int(n)): fit_allreduce(g["size"].to_numpy(), g["time_stats.all_reduce.median"].to_numpy() * 1e-3)
        for n, g in df.groupby("num_workers")
    }


# --- Splitwise end-to-end measurements ---------------------------------------------------------


def read_splitwise(root: Path, csv_file: Path | None = None) -> pd.DataFrame:
    """Splitwise's Llama-2-70B runs, one row per configuration (repeated runs averaged).

    ``csv_file`` (default: the calibration folder's TP2/TP4 file) may be splitwise-sim's whole
    ``data/perf_model.csv``, whose other models' rows are left out.

    Columns: hardware, tp, prompt, batch, tokens (decode iterations), prefill_s, decode_s (one
    decode iteration), power_frac (average power as a fraction of TDP, NaN where not recorded),
    excluded (a reason, or "").

    Exclusions, by rule:
    - a configuration whose prefill of B prompts took less time than that of B/2 prompts of the same
      length (the batch was not held at once: Llama-2-70B at TP2 and batch 64 on both GPUs, 8x
      faster than batch 32, with a 9x longer run on the A100): its prefill and decode rows;
    - ``h100-80gb-pcap``: every row equals an ``h100-80gb`` row with ``prompt_time`` multiplied by
      exactly 1.3 and ``token_time`` unchanged (checked by `splitwise_pcap_check`), so it is a
      derived copy, not a measurement; it is neither fitted nor scored.
    """
    df = pd.read_csv(csv_file or root / SPLITWISE_FILE)
    if "model" in df.columns:
        df = df[df.model == "llama2-70b"]
    df = df.assign(power_frac=df.average_power.where(df.average_power > 0))
    keys = ["hardware", "tensor_parallel", "prompt_size", "batch_size", "token_size"]
    g = (
        df.groupby(keys)
        .agg(
            prefill_ms=("prompt_time", "mean"),
            decode_ms=("token_time", "mean"),
            power_frac=("power_frac", "mean"),
            runs=("prompt_time", "size"),
        )
        .reset_index()
        .rename(
            columns={
                "tensor_parallel": "tp",
                "prompt_size": "prompt",
                "batch_size": "batch",
                "token_size": "tokens",
            }
        )
    )
    g["prefill_s"] = g.prefill_ms * 1e-3
    g["decode_s"] = g.decode_ms * 1e-3
    excluded = [
        "derived copy of h100-80gb (prompt_time x 1.3)" if h == SPLITWISE_PCAP else "" for h in g.hardware
    ]
    # Prefill of B prompts faster than of B/2 prompts: the run did not hold its nominal batch.
    half = g.set_index(["hardware", "tp", "prompt", "batch", "tokens"]).prefill_s
    for i, r in g.iterrows():
        key = (r.hardware, r.tp, r.prompt, r.batch // 2, r.tokens)
        if r.batch >= 2 and key in half.index and r.prefill_s < half[key]:
            excluded[i] = f"prefill of batch {r.batch} faster than of batch {r.batch // 2}: batch not held"
    g["excluded"] = excluded
    return g


def splitwise_pcap_check(root: Path) -> dict[str, float]:
    """The ratio of ``h100-80gb-pcap`` to ``h100-80gb`` rows: prompt_time (min, max) and the
    largest token_time difference (ms)."""
    df = pd.read_csv(root / SPLITWISE_FILE)
    a = df[df.hardware == "h100-80gb"].reset_index(drop=True)
    b = df[df.hardware == SPLITWISE_PCAP].reset_index(drop=True)
    ratio = b.prompt_time / a.prompt_time
    return {
        "prompt_time_ratio_min": float(ratio.min()),
        "prompt_time_ratio_max": float(ratio.max()),
        "token_time_max_abs_diff_ms": float((b.token_time - a.token_time).abs().max()),
    }


def splitwise_points(table: pd.DataFrame, gpu: str, tp: int | None = None) -> ServingPoints:
    """Decode and prefill points of one GPU family (``a100``/``h100``), all TPs or one.

    A run's ``token_time`` is the mean decode iteration over contexts prompt+1 .. prompt+tokens,
    so its decode point has the batch and a mean context of ``prompt + (tokens + 1) / 2``; its
    ``prompt_time`` is one prefill of the batch. Repeated prefill configurations (runs that differ
    only in their decode length) are one prefill point, their times averaged.
    """
    t = table[(table.hardware == SPLITWISE_GPUS[gpu]) & (table.excluded == "")]
    if tp is not None:
        t = t[t.tp == tp]
    pre = t.groupby(["tp", "prompt", "batch"]).prefill_s.mean().reset_index()
    n_d, n_p = len(t), len(pre)
    return serving_points(
        is_prefill=[False] * n_d + [True] * n_p,
        batch=list(t.batch) + list(pre.batch),
        tokens=list(t.prompt + (t.tokens + 1) / 2) + list(pre.prompt),
        tp=list(t.tp) + list(pre.tp),
        time_s=list(t.decode_s) + list(pre.prefill_s),
    )


def splitwise_power_runs(table: pd.DataFrame, gpu: str, tdp_w: float) -> tuple[PowerRuns, list[str]]:
    """Runs with a recorded average power, as `PowerRuns` (node watts = fraction x TDP x TP).

    Excluded: runs whose average power is under half the median of their GPU and TP (the two
    8192-token prompts, 0.18 and 0.17 of TDP while every other run reads 0.52-0.79, although three
    quarters of each is the same batch-1 decode): not a plausible reading of the run. Returns the
    runs and a note per excluded run.
    """
    t = table[(table.hardware == SPLITWISE_GPUS[gpu]) & (table.excluded == "") & table.power_frac.notna()]
    median = t.groupby("tp").power_frac.transform("median")
    bad = t.power_frac < 0.5 * median
    notes = [
        f"tp{r.tp} prompt {r.prompt} batch {r.batch}: average power {r.power_frac:.3f} of TDP, "
        f"under half the median {m:.3f}"
        for (_, r), m in zip(t[bad].iterrows(), median[bad], strict=True)
    ]
    t = t[~bad]
    runs = PowerRuns(
        tp=t.tp.to_numpy(int),
        batch=t.batch.to_numpy(float),
        prompt=t.prompt.to_numpy(float),
        decode_iters=t.tokens.to_numpy(float),
        prefill_s=t.prefill_s.to_numpy(float),
        decode_iter_s=t.decode_s.to_numpy(float),
        power_w=(t.power_frac * tdp_w * t.tp).to_numpy(float),
    )
    return runs, notes


# --- DistServe's fitted vLLM step times --------------------------------------------------------


def read_distserve(root: Path, engine: str = "vllm") -> dict[str, Any]:
    """DistServe's fitted coefficients (ms): model -> TP -> prefill / decoding_smallbs / ..."""
    return json.loads((root / f"distserve/profiler-a100-80g.{engine}.json").read_text())


def distserve_decode_points(
    root: Path, model: str = "facebook/opt-13b", tp: int = 1, context: int = 512, engine: str = "vllm"
) -> ServingPoints:
    """Decode step times from DistServe's small-batch fit ``a + b * context tokens + c * batch`` (ms)
    at batch 1..94 (its small-batch range) and ``context`` tokens per sequence."""
    coef = read_distserve(root, engine)[model][str(tp)]
    a, b, c = coef["decoding_smallbs"]
    batch = np.arange(1, int(coef["decoding_large_small_bs_threshold"]), dtype=float)
    ms = a + b * batch * context + c * batch
    n = len(batch)
    return serving_points([False] * n, batch, np.full(n, float(context)), np.full(n, tp), ms * 1e-3)


# --- vLLM's own CI latency benchmark (published figures) ---------------------------------------

# vLLM's performance benchmark ("Latency tests": benchmark_latency with 32 input tokens, 128
# output tokens, a fixed batch of 8, dummy weights; mean end-to-end latency of the batch in ms),
# as shown on the vLLM Buildkite pipeline "performance-benchmark". The pages state the GPU and
# the test, not the vLLM version.
VLLM_CI_LATENCY = [
    {
        "gpu": "h100",
        "model": "llama-3-8b",
        "tp": 1,
        "latency_ms": 997.542,
        "test": "latency_llama8B_tp1",
        "url": "https://buildkite.com/vllm/performance-benchmark/builds/9555",
    },
    {
        "gpu": "h100",
        "model": "llama-3-70b",
        "tp": 4,
        "latency_ms": 2444.47,
        "test": "latency_llama70B_tp4",
        "url": "https://buildkite.com/vllm/performance-benchmark/builds/9555",
    },
    {
        "gpu": "h200",
        "model": "llama-3-8b",
        "tp": 1,
        "latency_ms": 834.059,
        "test": "latency_llama8B_tp1",
        "url": "https://buildkite.com/vllm/performance-benchmark/builds/9513",
    },
    {
        "gpu": "h200",
        "model": "llama-3-70b",
        "tp": 4,
        "latency_ms": 2075.08,
        "test": "latency_llama70B_tp4",
        "url": "https://buildkite.com/vllm/performance-benchmark/builds/9513",
    },
    {
        "gpu": "a100",
        "model": "llama-3-8b",
        "tp": 1,
        "latency_ms": 1579.27,
        "test": "latency_llama8B_tp1",
        "url": "https://buildkite.com/vllm/performance-benchmark/builds/9523",
    },
    {
        "gpu": "a100",
        "model": "llama-3-70b",
        "tp": 4,
        "latency_ms": 3990.59,
        "test": "latency_llama70B_tp4",
        "url": "https://buildkite.com/vllm/performance-benchmark/builds/9523",
    },
]
VLLM_CI_SHAPE = {"batch": 8, "input_tokens": 32, "output_tokens": 128}

# The same pipeline's serving test at 1 request/s (ShareGPT prompts, Llama-3-70B, TP4): mean
# inter-token latency in ms. The batch varies with arrivals (a few sequences), so these are a
# check of the decode step at small batch, not fitted.
VLLM_CI_ITL = [
    {
        "gpu": "h100",
        "model": "llama-3-70b",
        "tp": 4,
        "mean_itl_ms": 19.39,
        "test": "serving_llama70B_tp4_sharegpt_qps_1",
        "url": "https://buildkite.com/vllm/performance-benchmark/builds/9555",
    },
    {
        "gpu": "h200",
        "model": "llama-3-70b",
        "tp": 4,
        "mean_itl_ms": 16.5538,
        "test": "serving_llama70B_tp4_sharegpt_qps_1",
        "url": "https://buildkite.com/vllm/performance-benchmark/builds/9513",
    },
]
