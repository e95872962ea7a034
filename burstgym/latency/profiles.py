"""Profiles: a GPU x model x tensor-parallel node, with its step-time coefficients, KV capacity,
power model and provenance.

A profile composes three independent parts: fitted kernel constants of the GPU (`GPUConstants`,
one fit per GPU serves every model), a model architecture (`ModelConfig`) and a serving-engine
calibration (`burstgym.latency.engines`). Shipped profiles live in burstgym/profiles/ and are
composed with the default engine; ``load_profile(name, engine=...)`` recomposes one with another.

Any other TP degree of a known model and GPU composes on demand from the GPU's constants
(burstgym/latency/gpus/<gpu>.json: kernel fit, energy roofline, board power) and the model's
architecture: ``load_profile("h100-llama-2-70b-tp4")``; a Hugging Face ``config.json`` given by
path composes the same way: ``load_profile("h100-tp4:/models/Qwen3-32B/config.json")``.
"""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import jax.numpy as jnp
from jax.typing import ArrayLike

from burstgym.latency.configs import ModelConfig, read_json, resolve_json
from burstgym.latency.engines import (
    DEFAULT_ENGINE,
    Engine,
    EngineTerms,
    apply_engine,
    load_engine,
    terms_from_dict,
)
from burstgym.latency.model import LatencyModel, step_time
from burstgym.latency.power import (
    GPUEnergy,
    PowerModel,
    busy_power_w,
    check_power_model,
    compose_power_model,
    flat_power_model,
)

PROFILES_DIR = Path(__file__).resolve().parent.parent / "profiles"
GPUS_DIR = Path(__file__).resolve().parent / "gpus"

# vLLM's default gpu_memory_utilization: the share of GPU memory the engine may use; the rest is
# left to the CUDA context, NCCL buffers and fragmentation.
GPU_MEMORY_UTILIZATION = 0.9
# Token budget of the profiling pass whose activations vLLM reserves before sizing the KV cache
# (its default max_num_batched_tokens for chunked prefill is 8192 in recent releases).
ACTIVATION_RESERVE_TOKENS = 8192


@dataclass(frozen=True)
class GPUConstants:
    """Effective rates and overheads of one GPU, fitted once and shared by every model.

    Rates are effective (what kernels achieve), not datasheet peaks; ``allreduce`` maps a tensor
    parallel degree to ``[fixed seconds, bytes per second]`` of one all-reduce (NCCL microbenchmark).
    ``overhead_s``/``overhead_seq_s`` are a legacy serving overhead (0 in shipped profiles, whose
    serving overhead comes from an engine calibration); an engine replaces them.
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
    overhead_s: float  # legacy serving overhead per iteration (0 when an engine is composed)
    overhead_seq_s: float  # legacy serving overhead per decoding sequence
    allreduce: dict[str, list[float]] = field(default_factory=dict)


def compose_kernels(gpu: GPUConstants, model: ModelConfig, tp: int, serving: bool = True) -> LatencyModel:
    """Kernel coefficients of ``model`` sharded over ``tp`` GPUs of kind ``gpu``.

    :param serving: include the GPU constants' legacy serving overhead (``False`` when an engine
        calibration supplies it).
    """
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
    return LatencyModel(
        overhead_s=gpu.overhead_s if serving else 0.0,
        overhead_seq_s=gpu.overhead_seq_s if serving else 0.0,
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
        prefill_pair_s=layers * model.pair_flops(tp) / gpu.attn_flops,
        allreduce_fixed_s=allreduce_fixed,
        allreduce_token_s=allreduce_token,
        expert_weights_s=model.expert_weight_bytes(tp) / gpu.mem_bw,
        expert_fraction=model.expert_fraction(),
    )


def compose_latency_model(
    gpu: GPUConstants,
    model: ModelConfig,
    tp: int,
    engine: Engine | EngineTerms | str | None = None,
) -> LatencyModel:
    """Coefficients of one node: ``model`` on ``tp`` GPUs of kind ``gpu``, served by ``engine``.

    ``engine=None`` gives the kernels plus the GPU constants' own (legacy) serving overhead; an
    engine name, `Engine` or `EngineTerms` adds that engine's terms instead.
    """
    if engine is None:
        return compose_kernels(gpu, model, tp)
    if not isinstance(engine, EngineTerms):
        engine = load_engine(engine).terms_for(gpu.name)[1]
    return apply_engine(compose_kernels(gpu, model, tp, serving=False), engine, model, tp)


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
    idle_power_w: float  # per node (TP GPUs), awake with the model loaded
    busy_power_w: float  # per node (TP GPUs): board power limit, the cap of `power`
    power_sources: str
    provenance: dict[str, Any]
    engine: str = "none"  # the engine calibration composed into `latency` ("none": legacy profile)
    engine_terms: EngineTerms | None = None  # that engine's terms for this GPU
    power: PowerModel | None = None  # per-node energy model; None: flat at busy_power_w
    energy: GPUEnergy | None = None  # the per-GPU energy-roofline constants `power` came from

    def __post_init__(self) -> None:
        if self.power is None:
            object.__setattr__(self, "power", flat_power_model(self.idle_power_w, self.busy_power_w))

    def step_time(
        self,
        prefill_tokens: ArrayLike = 0,
        decode_seqs: ArrayLike = 0,
        kv_tokens: ArrayLike = 0,
        prefill_pairs: ArrayLike | None = None,
    ) -> jnp.ndarray:
        """Seconds of one iteration on this node; see `step_time`."""
        return step_time(self.latency, prefill_tokens, decode_seqs, kv_tokens, prefill_pairs)

    def iteration_power_w(
        self,
        prefill_tokens: ArrayLike = 0,
        decode_seqs: ArrayLike = 0,
        kv_tokens: ArrayLike = 0,
        prefill_pairs: ArrayLike | None = None,
    ) -> jnp.ndarray:
        """Average watts of the node over one iteration of this work (`burstgym.latency.power`)."""
        prefill_tokens = jnp.asarray(prefill_tokens, dtype=jnp.result_type(float))
        if prefill_pairs is None:
            prefill_pairs = prefill_tokens * (prefill_tokens + 1.0) / 2.0
        duration = self.step_time(prefill_tokens, decode_seqs, kv_tokens, prefill_pairs)
        tokens = prefill_tokens + jnp.asarray(decode_seqs, dtype=prefill_tokens.dtype)
        return busy_power_w(self.power, duration, tokens, kv_tokens, prefill_pairs, 1)

    def to_dict(self) -> dict[str, Any]:
        """The JSON form `load_profile` reads back."""
        out: dict[str, Any] = {
            "name": self.name,
            "tp": self.tp,
            "gpu": asdict(self.gpu),
            "model": asdict(self.model),
            "latency": {k: float(v) for k, v in self.latency._asdict().items()},
            "kv_capacity_tokens": self.kv_capacity_tokens,
            "kv_bytes_per_token": self.kv_bytes_per_token,
        }
        if self.engine_terms is not None:
            out["engine"] = {"name": self.engine, "terms": asdict(self.engine_terms)}
        out["power"] = {
            "idle_power_w": self.idle_power_w,
            "busy_power_w": self.busy_power_w,
            "sources": self.power_sources,
            "model": {k: float(v) for k, v in self.power._asdict().items()},
            "gpu_energy": asdict(self.energy) if self.energy is not None else None,
        }
        out["provenance"] = self.provenance
        return out


def build_profile(
    name: str,
    gpu: GPUConstants,
    model: ModelConfig,
    tp: int,
    gpu_idle_w: float,
    gpu_busy_w: float,
    power_sources: str,
    provenance: dict[str, Any],
    engine: Engine | str | None = None,
    energy: GPUEnergy | None = None,
) -> Profile:
    """Compose a profile from fitted GPU constants, an architecture, an engine and power figures.

    :param gpu_idle_w: idle watts of one GPU (used when ``energy`` is None).
    :param gpu_busy_w: board power limit of one GPU (used when ``energy`` is None).
    :param engine: an engine calibration (name or `Engine`); None composes the legacy overhead of
        ``gpu`` alone.
    :param energy: per-GPU energy-roofline constants; None gives a flat power model.
    """
    if engine is not None:
        engine = load_engine(engine)
        _, terms = engine.terms_for(gpu.name)
        latency = compose_latency_model(gpu, model, tp, terms)
        engine_name: str = engine.name
    else:
        terms, latency, engine_name = None, compose_latency_model(gpu, model, tp), "none"
    if energy is not None:
        kernels = compose_kernels(gpu, model, tp, serving=False)
        power = compose_power_model(energy, kernels, tp, (gpu.mem_bw, gpu.flops))
        idle, busy = float(power.idle_w), float(power.tdp_w)
    else:
        power, idle, busy = None, tp * gpu_idle_w, tp * gpu_busy_w
    return Profile(
        name=name,
        gpu=gpu,
        model=model,
        tp=tp,
        latency=latency,
        kv_capacity_tokens=kv_capacity_tokens(gpu, model, tp),
        kv_bytes_per_token=model.kv_bytes_per_token(tp) * tp,
        idle_power_w=idle,
        busy_power_w=busy,
        power_sources=power_sources,
        provenance=provenance,
        engine=engine_name,
        engine_terms=terms,
        power=power,
        energy=energy,
    )


def with_engine(profile: Profile, engine: Engine | str) -> Profile:
    """``profile`` recomposed with another engine calibration (kernels, KV and power unchanged)."""
    engine = load_engine(engine)
    key, terms = engine.terms_for(profile.gpu.name)
    provenance = {
        **profile.provenance,
        "engine": {
            "name": engine.name,
            "gpu_terms": key,
            "recomposed_from": profile.engine,
            "source_files": engine.provenance.get("source_files", []),
        },
    }
    return dataclasses.replace(
        profile,
        latency=compose_latency_model(profile.gpu, profile.model, profile.tp, terms),
        engine=engine.name,
        engine_terms=terms,
        provenance=provenance,
    )


def list_profiles() -> list[str]:
    """Names of the profiles shipped in burstgym/profiles/."""
    return sorted(p.stem for p in PROFILES_DIR.glob("*.json"))


@dataclass(frozen=True)
class GPUFamily:
    """One GPU's constants for composing profiles: kernel fit, energy roofline and board power."""

    key: str  # short name used in profile names ("h100")
    gpu: GPUConstants
    energy: GPUEnergy
    idle_w: float  # one GPU, awake with a model loaded (an assumption; see provenance)
    busy_w: float  # one GPU's board power limit (datasheet)
    provenance: dict[str, Any]

    def to_dict(self) -> dict[str, Any]:
        """The JSON form `load_gpu` reads back."""
        return {
            "key": self.key,
            "gpu": asdict(self.gpu),
            "energy": asdict(self.energy),
            "idle_w": self.idle_w,
            "busy_w": self.busy_w,
            "provenance": self.provenance,
        }


def list_gpus() -> list[str]:
    """Keys of the GPUs profiles compose on (burstgym/latency/gpus/)."""
    return sorted(p.stem for p in GPUS_DIR.glob("*.json"))


def _constants(data: dict[str, Any], where: str) -> GPUConstants:
    kwargs: dict[str, Any] = {}
    for f in fields(GPUConstants):
        if f.name == "name":
            kwargs[f.name] = str(data.get("name", "unknown"))
        elif f.name == "allreduce":
            allreduce = data.get("allreduce", {})
            if not isinstance(allreduce, dict):
                raise ValueError(f"{where}: field 'allreduce' must be an object of TP -> [s, B/s]")
            for tp, pair in allreduce.items():
                if not (isinstance(pair, list) and len(pair) == 2):
                    raise ValueError(f"{where}: field 'allreduce.{tp}' must be [seconds, bytes per second]")
                for value in pair:
                    _number({"v": value}, "v", f"{where} [allreduce.{tp}]")
            kwargs[f.name] = {str(k): [float(x) for x in v] for k, v in allreduce.items()}
        else:
            kwargs[f.name] = _number(data, f.name, where)
    return GPUConstants(**kwargs)


def load_gpu(key: str) -> GPUFamily:
    """The constants of GPU ``key`` (see `list_gpus`)."""
    path = GPUS_DIR / f"{key}.json"
    if not path.exists():
        raise ValueError(f"unknown GPU {key!r}; known: {', '.join(list_gpus())}")
    data = read_json(path)
    where = str(path)
    if not isinstance(data, dict):
        raise ValueError(f"{where}: expected a JSON object")
    energy_data = _section(data, "energy", where)
    energy = GPUEnergy(
        **{
            f.name: str(energy_data.get(f.name, ""))
            if f.name in ("name", "source")
            else _number(energy_data, f.name, f"{where} [energy]")
            for f in fields(GPUEnergy)
        }
    )
    return GPUFamily(
        key=key,
        gpu=_constants(_section(data, "gpu", where), f"{where} [gpu]"),
        energy=energy,
        idle_w=_number(data, "idle_w", where),
        busy_w=_number(data, "busy_w", where),
        provenance=_section(data, "provenance", where),
    )


def compose_profile(
    gpu: str, model: str | Path, tp: int, engine: Engine | str | None = None, name: str | None = None
) -> Profile:
    """A profile of ``model`` (a shipped name or a Hugging Face ``config.json`` path) on ``tp``
    GPUs ``gpu`` (see `list_gpus`), composed with ``engine`` (default: `DEFAULT_ENGINE`)."""
    from burstgym.latency.configs import load_model_config

    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
        raise ValueError(f"tp must be a positive integer, got {tp!r}")
    family = load_gpu(gpu)
    config = load_model_config(model)
    heads = (config.num_heads, config.num_kv_heads)
    if tp > 1 and any(h % tp and tp % h for h in heads):
        raise ValueError(
            f"{config.name}: {heads[0]} attention and {heads[1]} KV heads do not shard over TP={tp}"
        )
    source = family.provenance
    provenance = {
        "kind": source.get("kind", "derived"),
        "detail": f"composed from the {family.gpu.name} constants (burstgym/latency/gpus/{gpu}.json: "
        f"{source.get('detail', '')}) and the {config.name} architecture"
        + ("" if str(model) == config.name else f" ({model})"),
        "gpu": source,
        "power": {"gpu_energy": family.energy.source},
    }
    return build_profile(
        name or f"{gpu}-{config.name}-tp{tp}",
        family.gpu,
        config,
        tp,
        family.idle_w,
        family.busy_w,
        str(source.get("power_sources", "")),
        provenance,
        engine=engine or DEFAULT_ENGINE,
        energy=family.energy,
    )


_COMPOSED = re.compile(r"^(?P<gpu>[a-z0-9]+)-(?P<model>.+)-tp(?P<tp>[0-9]+)$")
_FROM_CONFIG = re.compile(r"^(?P<gpu>[a-z0-9]+)-tp(?P<tp>[0-9]+):(?P<config>.+)$")


def _composed(spec: str) -> Profile | None:
    """The profile a name such as ``h100-llama-2-70b-tp4`` or ``h100-tp4:/path/config.json`` stands
    for, composed on demand; None when ``spec`` is not of either form with a known GPU and model."""
    from burstgym.latency.configs import list_models

    m = _FROM_CONFIG.match(spec)
    if m and m["gpu"] in list_gpus():
        return compose_profile(m["gpu"], Path(m["config"]), int(m["tp"]), name=spec)
    m = _COMPOSED.match(spec)
    if m and m["gpu"] in list_gpus() and m["model"] in list_models():
        return compose_profile(m["gpu"], m["model"], int(m["tp"]))
    return None


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


def _power(power: dict[str, Any], where: str) -> tuple[PowerModel | None, GPUEnergy | None]:
    model = power.get("model")
    if model is None:
        return None, None
    if not isinstance(model, dict):
        raise ValueError(f"{where} [power]: field 'model' must be an object")
    pm = PowerModel(*(_number(model, f, f"{where} [power.model]") for f in PowerModel._fields))
    check_power_model(pm, f"{where} [power.model]")
    energy_data = power.get("gpu_energy")
    energy = None
    if isinstance(energy_data, dict):
        kwargs: dict[str, Any] = {}
        for f in fields(GPUEnergy):
            if f.name in ("name", "source"):
                kwargs[f.name] = str(energy_data.get(f.name, ""))
            else:
                kwargs[f.name] = _number(energy_data, f.name, f"{where} [power.gpu_energy]")
        energy = GPUEnergy(**kwargs)
    return pm, energy


def profile_from_dict(data: Any, where: str) -> Profile:
    """Validate and build a `Profile` from its JSON form; errors name ``where`` and the field."""
    if not isinstance(data, dict):
        raise ValueError(f"{where}: expected a JSON object")
    lat = _section(data, "latency", where)
    # Fields with a default (MoE terms, front-end latency) may be absent from older files.
    latency = LatencyModel(
        **{
            f: _number(lat, f, f"{where} [latency]")
            for f in LatencyModel._fields
            if f in lat or f not in LatencyModel._field_defaults
        }
    )
    if not 0.0 <= float(latency.expert_fraction) <= 1.0:
        raise ValueError(f"{where} [latency]: field 'expert_fraction' must be in [0, 1]")
    for key in ("expert_weights_s", "frontend_s"):
        if getattr(latency, key) < 0:
            raise ValueError(f"{where} [latency]: field {key!r} must be >= 0")
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
    model_kwargs = {f.name: model_data.get(f.name, f.default) for f in fields(ModelConfig)}
    missing = [k for k, v in model_kwargs.items() if v is None or v is dataclasses.MISSING]
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
    engine_name, terms = "none", None
    if "engine" in data:
        engine = _section(data, "engine", where)
        engine_name = str(engine.get("name", "unnamed"))
        terms = terms_from_dict(engine.get("terms"), f"{where} [engine.terms]")
    power_model, energy = _power(power, where)
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
        engine=engine_name,
        engine_terms=terms,
        power=power_model,
        energy=energy,
    )


def load_profile(name_or_path: str | Path, engine: Engine | str | None = None) -> Profile:
    """A shipped profile by name (``h100-llama-3-8b-tp1``, see `list_profiles`) or a JSON path.

    :param engine: a serving-engine calibration (see `list_engines`) to recompose the profile
        with. ``None`` keeps the profile as stored: shipped profiles are composed with the default
        engine (``DEFAULT_ENGINE``), one written by ``python -m burstgym.calibrate fit-serving``
        with the engine fitted to its measurements.
    """
    if not isinstance(name_or_path, (str, Path)):
        raise ValueError(f"profile must be a name or a path, got {name_or_path!r}")
    shipped = PROFILES_DIR / f"{name_or_path}.json"
    spec = str(name_or_path)
    plain_path = Path(spec).suffix == ".json" and not _FROM_CONFIG.match(spec)
    composed = None if shipped.exists() or plain_path else _composed(spec)
    if composed is not None:
        return composed if engine is None else with_engine(composed, engine)
    try:
        path = resolve_json(name_or_path, PROFILES_DIR, "profile", list_profiles())
    except ValueError as err:
        if "unknown profile" in str(err):
            raise ValueError(
                f"{err}; or <gpu>-<model>-tp<N> (GPUs: {', '.join(list_gpus())}; models: python -m "
                "burstgym.latency models), or <gpu>-tp<N>:<path to a Hugging Face config.json>"
            ) from None
        raise
    profile = profile_from_dict(read_json(path), str(path))
    if engine is None:
        return profile
    return with_engine(profile, engine)


def provisional_h100_llama2_7b() -> LatencyModel:
    """The H100 / Llama-2-7B / TP1 coefficients (kept for callers that predate profiles)."""
    return load_profile("h100-llama-2-7b-tp1").latency


def show(profile: Profile, batches: list[int], contexts: list[int]) -> str:
    """A text table of decode step times (ms) over batch size x context length, plus prefill times."""
    lines = [
        f"{profile.name}: {profile.gpu.name}, {profile.model.name}, TP={profile.tp} "
        f"({profile.provenance.get('kind', '?')}), engine {profile.engine}",
        f"KV capacity {profile.kv_capacity_tokens} tokens, {profile.kv_bytes_per_token} B/token; "
        f"power idle {profile.idle_power_w:.0f} W, limit {profile.busy_power_w:.0f} W",
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
    c = contexts[len(contexts) // 2]
    lines.append(
        f"node power (W) at {c} context tokens: "
        + ", ".join(
            f"decode batch {b}: {float(profile.iteration_power_w(decode_seqs=b, kv_tokens=b * c)):.0f}"
            for b in (batches[0], batches[-1])
        )
        + f", prefill 2048: {float(profile.iteration_power_w(prefill_tokens=2048)):.0f}"
    )
    return "\n".join(lines)


__all__ = [
    "ACTIVATION_RESERVE_TOKENS",
    "DEFAULT_ENGINE",
    "GPU_MEMORY_UTILIZATION",
    "PROFILES_DIR",
    "GPUConstants",
    "Profile",
    "GPUS_DIR",
    "GPUFamily",
    "build_profile",
    "compose_kernels",
    "compose_profile",
    "list_gpus",
    "load_gpu",
    "compose_latency_model",
    "kv_capacity_tokens",
    "list_profiles",
    "load_profile",
    "profile_from_dict",
    "provisional_h100_llama2_7b",
    "show",
    "with_engine",
]
