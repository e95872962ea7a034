"""Per-iteration latency model: how long one forward pass of a batch takes on one node.

The form is the roofline view of transformer inference used, with variations, by Vidur
(Agrawal et al., MLSys 2024), DistServe (Zhong et al., OSDI 2024) and Splitwise (Patel et al.,
ISCA 2024); docs/latency.md states it with its sources and fit errors:

- a per-iteration serving overhead (scheduler, input preparation, sampling) plus a fixed kernel
  floor per layer (launch and tail latency of the small kernels);
- linear layers as the slower of streaming every weight once at an effective bandwidth and doing
  2 x parameters FLOPs per token at an effective compute rate, joined by a smooth maximum because
  real GEMMs leave the memory roof gradually (tile and wave quantisation);
- memory-bound element-wise work (norms, rotary embedding, activation, residual adds) per token;
- decode attention as a per-layer constant, a per-sequence cost and the KV bytes read;
- prefill attention growing with the (query, key) pairs, i.e. with the prompt length squared;
- tensor-parallel all-reduce, two per layer, of the activations of every token.

`LatencyModel` holds the coefficients as a pytree of numbers so the simulator can stack one per
node (a heterogeneous cluster) and vmap over nodes and clusters. The coefficients are composed
from a model architecture (`ModelConfig`, data in burstgym/models/) and fitted GPU constants
(`GPUConstants`, one fit per GPU serves every model); `Profile` bundles them with KV capacity,
power and provenance, and is what `load_profile` returns.
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, NamedTuple

import jax.numpy as jnp
from jax.typing import ArrayLike

PROFILES_DIR = Path(__file__).resolve().parent / "profiles"
MODELS_DIR = Path(__file__).resolve().parent / "models"

DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "float8_e4m3fn": 1, "float8": 1}

# vLLM's default gpu_memory_utilization: the share of GPU memory the engine may use; the rest is
# left to the CUDA context, NCCL buffers and fragmentation.
GPU_MEMORY_UTILIZATION = 0.9
# Token budget of the profiling pass whose activations vLLM reserves before sizing the KV cache
# (its default max_num_batched_tokens for chunked prefill is 8192 in recent releases).
ACTIVATION_RESERVE_TOKENS = 8192


class LatencyModel(NamedTuple):
    """Coefficients of `step_time`: seconds, seconds per unit, or (``knee_p``) a pure number."""

    overhead_s: ArrayLike  # per-iteration serving overhead (scheduler, input preparation, sampling)
    overhead_seq_s: ArrayLike  # serving overhead per decoding sequence (sampling, output handling)
    kernel_fixed_s: ArrayLike  # fixed GPU time of the layer kernels (launch and tail), all layers
    weights_s: ArrayLike  # reading every weight once: the memory-bound floor of the linear layers
    token_s: ArrayLike  # linear-layer compute per token: 2 x body parameters FLOPs / effective FLOP/s
    logits_seq_s: ArrayLike  # LM-head compute per sampled sequence: 2 x vocab x hidden / FLOP/s
    knee_p: ArrayLike  # exponent of the smooth maximum of memory and compute time (large: sharp knee)
    tile_tokens: ArrayLike  # GEMM row tile: compute is paid for whole tiles of tokens (1: no tiling)
    elementwise_token_s: ArrayLike  # norms, rotary, activation, residual adds, embedding: per token
    attn_fixed_s: ArrayLike  # decode attention: per-layer constant, summed over layers
    attn_seq_s: ArrayLike  # decode attention: per decoding sequence
    kv_token_s: ArrayLike  # decode attention: per KV token read (KV bytes per token / bandwidth)
    prefill_fixed_s: ArrayLike  # prefill attention: per-layer constant, summed over layers
    prefill_pair_s: ArrayLike  # prefill attention: per (query, key) pair
    allreduce_fixed_s: ArrayLike  # tensor-parallel all-reduce: fixed part per iteration
    allreduce_token_s: ArrayLike  # tensor-parallel all-reduce: per token in the pass


def smooth_max(a: ArrayLike, b: ArrayLike, p: ArrayLike) -> jnp.ndarray:
    """The p-norm ``(a^p + b^p)^(1/p)`` of two non-negative times: ``max(a, b)`` as ``p`` grows.

    A roofline's hard maximum overstates how sharply a GEMM turns compute-bound; the p-norm
    keeps the two asymptotes and rounds the knee (fitted per GPU).
    """
    a = jnp.asarray(a, dtype=jnp.result_type(float))
    b = jnp.asarray(b, dtype=a.dtype)
    top = jnp.maximum(jnp.maximum(a, b), jnp.finfo(a.dtype).tiny)
    return top * ((a / top) ** p + (b / top) ** p) ** (1.0 / p)


def step_time(
    model: LatencyModel,
    prefill_tokens: ArrayLike,
    decode_seqs: ArrayLike,
    kv_tokens: ArrayLike,
    prefill_pairs: ArrayLike | None = None,
) -> jnp.ndarray:
    """Seconds for one iteration; JAX-traceable, broadcasts over its arguments, 0 for an empty batch.

    :param model: the node's coefficients.
    :param prefill_tokens: prompt (or recompute) tokens processed in the iteration.
    :param decode_seqs: sequences decoding one token in the iteration.
    :param kv_tokens: context tokens (KV entries) read by the decoding sequences.
    :param prefill_pairs: attention (query, key) pairs of the prefill chunks; when omitted the
        prefill is taken as one prompt from scratch, ``prefill_tokens * (prefill_tokens + 1) / 2``.
    """
    prefill_tokens = jnp.asarray(prefill_tokens, dtype=jnp.result_type(float))
    decode_seqs = jnp.asarray(decode_seqs, dtype=prefill_tokens.dtype)
    kv_tokens = jnp.asarray(kv_tokens, dtype=prefill_tokens.dtype)
    if prefill_pairs is None:
        prefill_pairs = prefill_tokens * (prefill_tokens + 1.0) / 2.0
    tokens = prefill_tokens + decode_seqs
    busy = tokens > 0
    # GEMM kernels compute whole row tiles (CUTLASS/cuBLAS M-tiles), so compute steps per tile.
    tiled = jnp.ceil(tokens / model.tile_tokens) * model.tile_tokens
    compute = model.token_s * tiled + model.logits_seq_s * decode_seqs
    linear = smooth_max(model.weights_s, compute, model.knee_p) + model.elementwise_token_s * tokens
    decode_attn = jnp.where(
        decode_seqs > 0,
        model.attn_fixed_s + model.attn_seq_s * decode_seqs + model.kv_token_s * kv_tokens,
        0.0,
    )
    prefill_attn = jnp.where(
        prefill_tokens > 0, model.prefill_fixed_s + model.prefill_pair_s * prefill_pairs, 0.0
    )
    allreduce = model.allreduce_fixed_s + model.allreduce_token_s * tokens
    serving = model.overhead_s + model.overhead_seq_s * decode_seqs
    total = serving + model.kernel_fixed_s + linear + decode_attn + prefill_attn + allreduce
    return jnp.where(busy, total, 0.0)


@dataclass(frozen=True)
class ModelConfig:
    """The architecture numbers the latency model needs (Hugging Face ``config.json`` names)."""

    name: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    ffn_size: int
    vocab_size: int
    gated_mlp: bool
    dtype: str
    tie_word_embeddings: bool = False

    @property
    def dtype_bytes(self) -> int:
        """Bytes per weight, activation and KV element."""
        return DTYPE_BYTES[self.dtype]

    def layer_params(self, tp: int = 1) -> float:
        """Linear-layer parameters of one transformer layer held by one of ``tp`` ranks.

        QKV and output projections plus the MLP (three matrices when gated, as in Llama's SwiGLU;
        two otherwise); Megatron-style tensor parallelism splits each evenly.
        """
        q = self.hidden_size * self.num_heads * self.head_dim
        kv = 2 * self.hidden_size * self.num_kv_heads * self.head_dim
        out = self.num_heads * self.head_dim * self.hidden_size
        mlp = (3 if self.gated_mlp else 2) * self.hidden_size * self.ffn_size
        return (q + kv + out + mlp) / tp

    def lm_head_params(self, tp: int = 1) -> float:
        """LM-head parameters per rank (vocabulary-parallel under tensor parallelism)."""
        return self.vocab_size * self.hidden_size / tp

    def weight_bytes(self, tp: int = 1) -> float:
        """Bytes of weights one rank holds: layers, LM head and (unless tied) the embedding table."""
        embedding = 0 if self.tie_word_embeddings else self.vocab_size * self.hidden_size / tp
        params = self.num_layers * self.layer_params(tp) + self.lm_head_params(tp) + embedding
        return params * self.dtype_bytes

    def streamed_weight_bytes(self, tp: int = 1) -> float:
        """Bytes one rank reads per forward pass: every layer and the LM head (the embedding is
        gathered row by row, not streamed)."""
        return (self.num_layers * self.layer_params(tp) + self.lm_head_params(tp)) * self.dtype_bytes

    def kv_bytes_per_token(self, tp: int = 1) -> int:
        """KV-cache bytes per token on one rank: 2 (K and V) x layers x KV heads x head dim x bytes."""
        kv_heads = max(self.num_kv_heads // tp, 1)
        return 2 * self.num_layers * kv_heads * self.head_dim * self.dtype_bytes

    def elementwise_bytes_per_token(self, tp: int = 1) -> float:
        """HBM bytes per token per layer of the memory-bound non-GEMM kernels.

        Two RMS/LayerNorms (read and write the hidden state), rotary embedding (read and write
        Q and K), the activation (gated: read two FFN halves, write one) and two residual adds
        (read two, write one hidden state).
        """
        h, b = self.hidden_size, self.dtype_bytes
        norms = 2 * 2 * h
        rotary = 2 * (self.num_heads + self.num_kv_heads) * self.head_dim / tp
        act = (3 if self.gated_mlp else 2) * self.ffn_size / tp
        adds = 2 * 3 * h
        return (norms + rotary + act + adds) * b


def _field(data: dict[str, Any], keys: tuple[str, ...], where: str, default: Any = None) -> Any:
    for key in keys:
        if key in data:
            return data[key]
    if default is not None:
        return default
    raise ValueError(f"{where}: missing field {keys[0]!r}")


def model_config_from_dict(data: dict[str, Any], name: str, where: str) -> ModelConfig:
    """Build a `ModelConfig` from a Hugging Face ``config.json`` (or a burstgym model file).

    Names follow Llama (``num_hidden_layers``...), with GPT-2/OPT aliases. The MLP counts as
    gated when the file says ``gated_mlp`` or uses SiLU (Llama/Mistral/Qwen SwiGLU).
    """
    if not isinstance(data, dict):
        raise ValueError(f"{where}: expected a JSON object")
    layers = _field(data, ("num_hidden_layers", "n_layer"), where)
    hidden = _field(data, ("hidden_size", "n_embd", "d_model"), where)
    heads = _field(data, ("num_attention_heads", "n_head"), where)
    kv_heads = _field(data, ("num_key_value_heads",), where, default=heads)
    ints = {
        "num_hidden_layers": layers,
        "hidden_size": hidden,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
    }
    for key, value in ints.items():
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ValueError(f"{where}: field {key!r} must be a positive integer, got {value!r}")
    head_dim = _field(data, ("head_dim",), where, default=hidden // heads)
    ffn = _field(data, ("intermediate_size", "ffn_dim", "n_inner"), where, default=4 * hidden)
    vocab = _field(data, ("vocab_size",), where)
    act = str(data.get("hidden_act", data.get("activation_function", "")))
    gated = bool(data.get("gated_mlp", act in ("silu", "swish", "swiglu")))
    dtype = str(data.get("torch_dtype", data.get("dtype", "bfloat16")))
    for key, value in (("head_dim", head_dim), ("intermediate_size", ffn), ("vocab_size", vocab)):
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ValueError(f"{where}: field {key!r} must be a positive integer, got {value!r}")
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"{where}: field 'torch_dtype' {dtype!r} is not one of {sorted(DTYPE_BYTES)}")
    return ModelConfig(
        name=name,
        num_layers=layers,
        hidden_size=hidden,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        ffn_size=ffn,
        vocab_size=vocab,
        gated_mlp=gated,
        dtype=dtype,
        tie_word_embeddings=bool(data.get("tie_word_embeddings", False)),
    )


def list_models() -> list[str]:
    """Names of the model architectures shipped in burstgym/models/."""
    return sorted(p.stem for p in MODELS_DIR.glob("*.json"))


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"{path}: malformed JSON ({err})") from err


def load_model_config(name_or_path: str | Path) -> ModelConfig:
    """A shipped architecture by name (``llama-3-8b``) or any Hugging Face ``config.json`` path."""
    path = Path(name_or_path)
    if path.suffix != ".json" and not path.exists():
        path = MODELS_DIR / f"{name_or_path}.json"
        if not path.exists():
            raise ValueError(
                f"unknown model {str(name_or_path)!r}; known: {', '.join(list_models())}"
                " (or pass the path of a Hugging Face config.json)"
            )
    if not path.exists():
        raise ValueError(f"model config {path} does not exist")
    data = _read_json(path)
    name = data.get("name", path.parent.name if path.name == "config.json" else path.stem)
    return model_config_from_dict(data, str(name), str(path))


@dataclass(frozen=True)
class GPUConstants:
    """Effective rates and overheads of one GPU, fitted once and shared by every model.

    Rates are effective (what kernels achieve), not datasheet peaks; ``allreduce`` maps a tensor
    parallel degree to ``[fixed seconds, bytes per second]`` of one all-reduce.
    """

    name: str
    memory_bytes: float  # HBM per GPU
    mem_bw: float  # bytes/s streaming weights in the linear layers
    flops: float  # FLOP/s of the linear layers when compute-bound
    knee_p: float  # smooth-maximum exponent of the linear-layer roofline
    tile_tokens: float  # GEMM row tile the compute side is quantised to
    layer_fixed_s: float  # fixed GPU time of one layer's non-attention kernels
    elementwise_bw: float  # bytes/s of the element-wise kernels
    attn_layer_fixed_s: float  # decode attention kernel: constant per layer
    attn_seq_layer_s: float  # decode attention kernel: per sequence per layer
    attn_bw: float  # bytes/s reading the KV cache in decode attention
    prefill_layer_fixed_s: float  # prefill attention kernel: constant per layer
    attn_flops: float  # FLOP/s of prefill attention (4 x heads x head_dim FLOPs per pair)
    overhead_s: float  # serving engine CPU time per iteration
    overhead_seq_s: float  # serving engine CPU time per decoding sequence
    allreduce: dict[str, list[float]] = field(default_factory=dict)


def compose_latency_model(gpu: GPUConstants, model: ModelConfig, tp: int) -> LatencyModel:
    """Coefficients of one node: ``model`` sharded over ``tp`` GPUs of kind ``gpu``."""
    layers = model.num_layers
    if tp > 1:
        if str(tp) not in gpu.allreduce:
            raise ValueError(
                f"GPU {gpu.name} has no all-reduce fit for TP={tp}; fitted: {sorted(gpu.allreduce, key=int)}"
            )
        ar_fixed, ar_bw = gpu.allreduce[str(tp)]
        # Megatron layout: one all-reduce after attention and one after the MLP, per layer.
        allreduce_fixed = 2 * layers * ar_fixed
        allreduce_token = 2 * layers * model.hidden_size * model.dtype_bytes / ar_bw
    else:
        allreduce_fixed = allreduce_token = 0.0
    pair_flops = 4 * (model.num_heads / tp) * model.head_dim  # QK^T and PV, 2 FLOPs per MAC
    return LatencyModel(
        overhead_s=gpu.overhead_s,
        overhead_seq_s=gpu.overhead_seq_s,
        kernel_fixed_s=layers * gpu.layer_fixed_s,
        weights_s=model.streamed_weight_bytes(tp) / gpu.mem_bw,
        token_s=2 * layers * model.layer_params(tp) / gpu.flops,
        logits_seq_s=2 * model.lm_head_params(tp) / gpu.flops,
        knee_p=gpu.knee_p,
        tile_tokens=gpu.tile_tokens,
        elementwise_token_s=(
            layers * model.elementwise_bytes_per_token(tp) + model.hidden_size * model.dtype_bytes
        )
        / gpu.elementwise_bw,
        attn_fixed_s=layers * gpu.attn_layer_fixed_s,
        attn_seq_s=layers * gpu.attn_seq_layer_s,
        kv_token_s=model.kv_bytes_per_token(tp) / gpu.attn_bw,
        prefill_fixed_s=layers * gpu.prefill_layer_fixed_s,
        prefill_pair_s=layers * pair_flops / gpu.attn_flops,
        allreduce_fixed_s=allreduce_fixed,
        allreduce_token_s=allreduce_token,
    )


def kv_capacity_tokens(gpu: GPUConstants, model: ModelConfig, tp: int) -> int:
    """KV tokens a node holds: (usable memory - weights - activation reserve) / KV bytes per token.

    Per rank, as vLLM sizes its cache: ``GPU_MEMORY_UTILIZATION`` of HBM, minus the weight shard,
    minus the activations of a ``ACTIVATION_RESERVE_TOKENS`` forward pass (hidden state and the
    FFN intermediate); every rank holds its share of each token's KV heads.
    """
    h, b = model.hidden_size, model.dtype_bytes
    activations = ACTIVATION_RESERVE_TOKENS * (2 * h + 2 * model.ffn_size / tp) * b
    free = GPU_MEMORY_UTILIZATION * gpu.memory_bytes - model.weight_bytes(tp) - activations
    if free <= 0:
        raise ValueError(f"{model.name} at TP={tp} does not fit in {gpu.name} memory")
    return int(free // model.kv_bytes_per_token(tp))


@dataclass(frozen=True)
class Profile:
    """A GPU x model x TP combination: latency coefficients, KV capacity, power and provenance."""

    name: str
    gpu: GPUConstants
    model: ModelConfig
    tp: int
    latency: LatencyModel
    kv_capacity_tokens: int
    kv_bytes_per_token: int  # per node: summed over the TP ranks
    idle_power_w: float  # per node (TP GPUs)
    busy_power_w: float  # per node (TP GPUs)
    power_sources: str
    provenance: dict[str, Any]

    def step_time(
        self,
        prefill_tokens: ArrayLike = 0,
        decode_seqs: ArrayLike = 0,
        kv_tokens: ArrayLike = 0,
        prefill_pairs: ArrayLike | None = None,
    ) -> jnp.ndarray:
        """Seconds of one iteration on this node; see `step_time`."""
        return step_time(self.latency, prefill_tokens, decode_seqs, kv_tokens, prefill_pairs)

    def to_dict(self) -> dict[str, Any]:
        """The JSON form `load_profile` reads back."""
        return {
            "name": self.name,
            "tp": self.tp,
            "gpu": asdict(self.gpu),
            "model": asdict(self.model),
            "latency": {k: float(v) for k, v in self.latency._asdict().items()},
            "kv_capacity_tokens": self.kv_capacity_tokens,
            "kv_bytes_per_token": self.kv_bytes_per_token,
            "power": {
                "idle_power_w": self.idle_power_w,
                "busy_power_w": self.busy_power_w,
                "sources": self.power_sources,
            },
            "provenance": self.provenance,
        }


def build_profile(
    name: str,
    gpu: GPUConstants,
    model: ModelConfig,
    tp: int,
    gpu_idle_w: float,
    gpu_busy_w: float,
    power_sources: str,
    provenance: dict[str, Any],
) -> Profile:
    """Compose a profile from fitted GPU constants, an architecture and per-GPU power figures."""
    return Profile(
        name=name,
        gpu=gpu,
        model=model,
        tp=tp,
        latency=compose_latency_model(gpu, model, tp),
        kv_capacity_tokens=kv_capacity_tokens(gpu, model, tp),
        kv_bytes_per_token=model.kv_bytes_per_token(tp) * tp,
        idle_power_w=tp * gpu_idle_w,
        busy_power_w=tp * gpu_busy_w,
        power_sources=power_sources,
        provenance=provenance,
    )


def list_profiles() -> list[str]:
    """Names of the profiles shipped in burstgym/profiles/."""
    return sorted(p.stem for p in PROFILES_DIR.glob("*.json"))


def _number(data: dict[str, Any], key: str, where: str) -> float:
    if key not in data:
        raise ValueError(f"{where}: missing field {key!r}")
    value = data[key]
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{where}: field {key!r} must be a finite number, got {value!r}")
    return float(value)


def _section(data: dict[str, Any], key: str, where: str) -> dict[str, Any]:
    value = data.get(key)
    if not isinstance(value, dict):
        raise ValueError(f"{where}: missing or non-object field {key!r}")
    return value


def profile_from_dict(data: Any, where: str) -> Profile:
    """Validate and build a `Profile` from its JSON form; errors name ``where`` and the field."""
    if not isinstance(data, dict):
        raise ValueError(f"{where}: expected a JSON object")
    lat = _section(data, "latency", where)
    latency = LatencyModel(*(_number(lat, f, f"{where} [latency]") for f in LatencyModel._fields))
    for key in ("knee_p", "tile_tokens"):
        if getattr(latency, key) <= 0:
            raise ValueError(f"{where} [latency]: field {key!r} must be positive")
    gpu_data = _section(data, "gpu", where)
    gpu_kwargs: dict[str, Any] = {}
    for f in fields(GPUConstants):
        if f.name == "name":
            gpu_kwargs[f.name] = str(gpu_data.get("name", "unknown"))
        elif f.name == "allreduce":
            gpu_kwargs[f.name] = dict(gpu_data.get("allreduce", {}))
        else:
            gpu_kwargs[f.name] = _number(gpu_data, f.name, f"{where} [gpu]")
    model_data = _section(data, "model", where)
    model_kwargs = {f.name: model_data.get(f.name) for f in fields(ModelConfig)}
    missing = [k for k, v in model_kwargs.items() if v is None]
    if missing:
        raise ValueError(f"{where} [model]: missing field {missing[0]!r}")
    power = _section(data, "power", where)
    provenance = _section(data, "provenance", where)
    tp = _number(data, "tp", where)
    kv_capacity = _number(data, "kv_capacity_tokens", where)
    kv_bytes = _number(data, "kv_bytes_per_token", where)
    for key, value in (("tp", tp), ("kv_capacity_tokens", kv_capacity), ("kv_bytes_per_token", kv_bytes)):
        if value < 1 or value != int(value):
            raise ValueError(f"{where}: field {key!r} must be a positive integer, got {value!r}")
    return Profile(
        name=str(data.get("name", Path(where).stem)),
        gpu=GPUConstants(**gpu_kwargs),
        model=ModelConfig(**model_kwargs),
        tp=int(tp),
        latency=latency,
        kv_capacity_tokens=int(kv_capacity),
        kv_bytes_per_token=int(kv_bytes),
        idle_power_w=_number(power, "idle_power_w", f"{where} [power]"),
        busy_power_w=_number(power, "busy_power_w", f"{where} [power]"),
        power_sources=str(power.get("sources", "")),
        provenance=provenance,
    )


def load_profile(name_or_path: str | Path) -> Profile:
    """A shipped profile by name (``h100-llama-3-8b-tp1``, see `list_profiles`) or a JSON path."""
    path = Path(name_or_path)
    if path.suffix != ".json":
        path = PROFILES_DIR / f"{name_or_path}.json"
        if not path.exists():
            raise ValueError(f"unknown profile {str(name_or_path)!r}; known: {', '.join(list_profiles())}")
    if not path.exists():
        raise ValueError(f"profile file {path} does not exist")
    return profile_from_dict(_read_json(path), str(path))


def provisional_h100_llama2_7b() -> LatencyModel:
    """The H100 / Llama-2-7B / TP1 coefficients (kept for callers that predate profiles)."""
    return load_profile("h100-llama-2-7b-tp1").latency


def show(profile: Profile, batches: list[int], contexts: list[int]) -> str:
    """A text table of decode step times (ms) over batch size x context length, plus prefill times."""
    lines = [
        f"{profile.name}: {profile.gpu.name}, {profile.model.name}, TP={profile.tp} "
        f"({profile.provenance.get('kind', '?')})",
        f"KV capacity {profile.kv_capacity_tokens} tokens, {profile.kv_bytes_per_token} B/token; "
        f"power idle {profile.idle_power_w:.0f} W, busy {profile.busy_power_w:.0f} W",
        "decode step time (ms), rows: batch size, columns: context tokens per sequence",
        "batch " + "".join(f"{c:>10d}" for c in contexts),
    ]
    for b in batches:
        row = [1e3 * float(profile.step_time(decode_seqs=b, kv_tokens=b * c)) for c in contexts]
        lines.append(f"{b:>5d} " + "".join(f"{t:>10.2f}" for t in row))
    lines.append(
        "prefill of one prompt (ms): "
        + ", ".join(
            f"{p}: {1e3 * float(profile.step_time(prefill_tokens=p)):.1f}" for p in (128, 512, 2048, 8192)
        )
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    """``python -m burstgym.latency show|list``: inspect the shipped profiles."""
    parser = argparse.ArgumentParser(prog="python -m burstgym.latency", description=main.__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    show_p = sub.add_parser("show", help="table of step times over batch x context")
    show_p.add_argument("profile", help="profile name or path to a profile JSON")
    show_p.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 64, 128, 256])
    show_p.add_argument("--contexts", type=int, nargs="+", default=[128, 512, 1024, 2048, 4096, 8192])
    sub.add_parser("list", help="names of the shipped profiles")
    args = parser.parse_args(argv)
    if args.command == "list":
        print("\n".join(list_profiles()))
        return
    try:
        profile = load_profile(args.profile)
    except ValueError as err:
        parser.error(str(err))
    print(show(profile, args.batches, args.contexts))


if __name__ == "__main__":
    main()
