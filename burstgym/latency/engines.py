"""Serving-engine calibrations: what an engine adds to the kernels in every iteration.

Kernel timings (Vidur's, or your own from ``python -m burstgym.calibrate``) say how long the GPU
computes; a served iteration also pays the engine's CPU work (scheduling, input preparation,
sampling), launch gaps between kernels, and the engine's own tensor-parallel all-reduce, whose
latency includes synchronising the ranks. An engine calibration holds those terms, fitted to
end-to-end measurements, per GPU family:

- ``overhead_s``: per iteration, added to `LatencyModel.overhead_s`;
- ``overhead_seq_s``: per decoding sequence, added to `LatencyModel.overhead_seq_s`;
- ``layer_s``: per layer per iteration, ``layers x layer_s`` added to `LatencyModel.kernel_fixed_s`;
- ``allreduce_step_s``: latency of one step of a ring all-reduce (Thakur, Rabenseifner and Gropp,
  IJHPCA 2005: ``2 (tp - 1)`` steps), so ``allreduce_fixed_s = 2 layers x 2 (tp - 1) x step``;
  ``None`` keeps the NCCL microbenchmark latency of the kernel fit;
- ``allreduce_bw_factor``: multiplies the per-token all-reduce time of the NCCL microbenchmark,
  which already carries the platform's own scaling with the TP degree;
- ``frontend_s``: per request, the API server's latency on every token the client receives
  (request handling and tokenisation before the engine, detokenisation and streaming after it),
  added to `LatencyModel.frontend_s`; 0 for an engine measured without an HTTP front end;
- kernel factors, for an engine whose kernels run differently from the profiled ones (1: as
  profiled): ``layer_factor`` multiplies the per-layer fixed kernel times (launch gaps that CUDA
  graphs remove), ``elementwise_factor`` the element-wise traffic (kernels a compiler fuses),
  ``compute_factor`` the GEMM and attention FLOP time, ``weights_factor`` the weight streaming.

The step-time formula (`burstgym.latency.model.step_time`) is unchanged: an engine only moves
coefficients. Per-layer terms scale with the model's layers, all-reduce terms with its layers,
hidden size and TP degree; a GPU the engine was not fitted on uses its ``default_gpu`` terms.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from burstgym.latency.configs import ModelConfig, read_json, resolve_json
from burstgym.latency.model import LatencyModel

ENGINES_DIR = Path(__file__).resolve().parent / "engines"
DEFAULT_ENGINE = "vllm-ci"
KERNELS_ENGINE = "kernels"  # built in: the kernel model alone, no serving engine


@dataclass(frozen=True)
class EngineTerms:
    """What an engine adds to one GPU's kernel model (seconds, or a pure factor)."""

    overhead_s: float = 0.0  # per iteration (CPU: scheduling, input preparation, sampling)
    overhead_seq_s: float = 0.0  # per decoding sequence (sampling, detokenising, output handling)
    layer_s: float = 0.0  # per layer per iteration (launch gaps between the layer's kernels)
    allreduce_step_s: float | None = None  # one ring step of one all-reduce; None: NCCL microbenchmark
    allreduce_bw_factor: float = 1.0  # multiplies the NCCL microbenchmark's per-token all-reduce time
    frontend_s: float = 0.0  # per request: the API server's latency on every token the client gets
    layer_factor: float = 1.0  # multiplies the kernel fit's per-layer fixed times
    elementwise_factor: float = 1.0  # multiplies the element-wise kernels' time
    compute_factor: float = 1.0  # multiplies GEMM and attention FLOP time
    weights_factor: float = 1.0  # multiplies weight-streaming time


@dataclass(frozen=True)
class Engine:
    """A named engine calibration: terms per GPU family, with where they came from."""

    name: str
    description: str
    gpus: dict[str, EngineTerms]
    default_gpu: str  # family whose terms serve a GPU that has none of its own
    applies: str = ""  # how the terms carry to other GPUs, models and TP degrees
    provenance: dict[str, Any] = field(default_factory=dict)

    def terms_for(self, gpu_name: str) -> tuple[str, EngineTerms]:
        """The family key and terms for a GPU named ``gpu_name`` (``H100-SXM5-80GB`` -> ``h100``)."""
        lower = gpu_name.lower()
        for key in sorted(self.gpus, key=len, reverse=True):
            if key in lower:
                return key, self.gpus[key]
        return self.default_gpu, self.gpus[self.default_gpu]

    def to_dict(self) -> dict[str, Any]:
        """The JSON form `load_engine` reads back."""
        return {
            "name": self.name,
            "description": self.description,
            "default_gpu": self.default_gpu,
            "applies": self.applies,
            "gpus": {k: asdict(v) for k, v in sorted(self.gpus.items())},
            "provenance": self.provenance,
        }


KERNELS = Engine(
    name=KERNELS_ENGINE,
    description="the kernel model alone: no serving-engine overhead (a lower bound on step time)",
    gpus={"any": EngineTerms()},
    default_gpu="any",
    applies="adds nothing; all-reduce is the NCCL microbenchmark fit of the GPU",
)


def terms_from_dict(data: Any, where: str) -> EngineTerms:
    """Validate one GPU's terms; errors name ``where`` and the field."""
    if not isinstance(data, dict):
        raise ValueError(f"{where}: expected a JSON object of engine terms")
    known = {f for f in EngineTerms.__dataclass_fields__}
    unknown = sorted(set(data) - known)
    if unknown:
        raise ValueError(f"{where}: unknown engine term {unknown[0]!r}; known: {', '.join(sorted(known))}")
    kwargs: dict[str, Any] = {}
    for key, value in data.items():
        if key == "allreduce_step_s" and value is None:
            kwargs[key] = None
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise ValueError(f"{where}: field {key!r} must be a finite number, got {value!r}")
        if value < 0:
            raise ValueError(f"{where}: field {key!r} must be >= 0, got {value!r}")
        kwargs[key] = float(value)
    return EngineTerms(**kwargs)


def engine_from_dict(data: Any, where: str) -> Engine:
    """Validate and build an `Engine` from its JSON form."""
    if not isinstance(data, dict):
        raise ValueError(f"{where}: expected a JSON object")
    gpus = data.get("gpus")
    if not isinstance(gpus, dict) or not gpus:
        raise ValueError(f"{where}: missing or empty field 'gpus'")
    terms = {str(k): terms_from_dict(v, f"{where} [gpus.{k}]") for k, v in gpus.items()}
    default_gpu = str(data.get("default_gpu", next(iter(terms))))
    if default_gpu not in terms:
        raise ValueError(f"{where}: default_gpu {default_gpu!r} is not one of {sorted(terms)}")
    return Engine(
        name=str(data.get("name", Path(where).stem)),
        description=str(data.get("description", "")),
        gpus=terms,
        default_gpu=default_gpu,
        applies=str(data.get("applies", "")),
        provenance=dict(data.get("provenance", {})),
    )


def list_engines() -> list[str]:
    """Names of the shipped engine calibrations (burstgym/latency/engines/) and the built-in ``kernels``."""
    return sorted([p.stem for p in ENGINES_DIR.glob("*.json")] + [KERNELS_ENGINE])


def load_engine(name_or_path: str | Path | Engine) -> Engine:
    """A shipped engine by name (see `list_engines`), a path to an engine JSON, or an `Engine`."""
    if isinstance(name_or_path, Engine):
        return name_or_path
    if str(name_or_path) == KERNELS_ENGINE:
        return KERNELS
    path = resolve_json(name_or_path, ENGINES_DIR, "engine", list_engines())
    return engine_from_dict(read_json(path), str(path))


def apply_engine(kernels: LatencyModel, terms: EngineTerms, model: ModelConfig, tp: int) -> LatencyModel:
    """``kernels`` (a kernel-only model of ``model`` at TP ``tp``) plus the engine's terms."""
    layers = model.num_layers
    if terms.allreduce_step_s is None or tp <= 1:
        allreduce_fixed = kernels.allreduce_fixed_s
    else:
        # Megatron layout: two all-reduces per layer; a ring all-reduce takes 2 (tp - 1) steps.
        allreduce_fixed = 2 * layers * 2 * (tp - 1) * terms.allreduce_step_s
    return kernels._replace(
        overhead_s=kernels.overhead_s + terms.overhead_s,
        overhead_seq_s=kernels.overhead_seq_s + terms.overhead_seq_s,
        kernel_fixed_s=kernels.kernel_fixed_s * terms.layer_factor + layers * terms.layer_s,
        attn_fixed_s=kernels.attn_fixed_s * terms.layer_factor,
        prefill_fixed_s=kernels.prefill_fixed_s * terms.layer_factor,
        elementwise_token_s=kernels.elementwise_token_s * terms.elementwise_factor,
        token_s=kernels.token_s * terms.compute_factor,
        logits_seq_s=kernels.logits_seq_s * terms.compute_factor,
        prefill_pair_s=kernels.prefill_pair_s * terms.compute_factor,
        weights_s=kernels.weights_s * terms.weights_factor,
        expert_weights_s=kernels.expert_weights_s * terms.weights_factor,
        allreduce_fixed_s=allreduce_fixed,
        allreduce_token_s=kernels.allreduce_token_s * terms.allreduce_bw_factor,
        frontend_s=kernels.frontend_s + terms.frontend_s,
    )
