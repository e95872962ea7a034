"""Per-iteration latency and power of one LLM-serving node: kernels, engine, power, profiles.

Files by job:

- `model`: `LatencyModel` and `step_time`, the step-time formula the simulator runs (JAX);
- `configs`: `ModelConfig`, model architectures (burstgym/models/, or a Hugging Face config.json);
- `profiles`: `GPUConstants`, `Profile`, composing and loading profiles (burstgym/profiles/, and any
  TP of a known model on a known GPU from burstgym/latency/gpus/);
- `engines`: serving-engine calibrations over the kernel model (burstgym/latency/engines/);
- `power`: `PowerModel` and `energy_j`, power that depends on the work (energy roofline);
- `fit`: fitting kernel constants, engine terms and energy constants to measurements;
- `sources`: readers of the public calibration data; `validate`: the shipped engine fits and their
  held-out checks against end-to-end measurements;
- `serving`: ``python -m burstgym.calibrate fit-serving``; `measure`: timing kernels with torch;
- `requestlog`: reading request logs (benchmark clients, gateways); `replay`: replaying one through
  the simulator (``python -m burstgym.calibrate replay``);
- `cli`: ``python -m burstgym.latency show|list|gpus|models|engines|validate``.
"""

from burstgym.latency.cli import main
from burstgym.latency.configs import (
    DTYPE_BYTES,
    MODELS_DIR,
    ModelConfig,
    list_models,
    load_model_config,
    model_config_from_dict,
)
from burstgym.latency.engines import (
    DEFAULT_ENGINE,
    ENGINES_DIR,
    Engine,
    EngineTerms,
    apply_engine,
    list_engines,
    load_engine,
)
from burstgym.latency.model import LatencyModel, smooth_max, step_time
from burstgym.latency.power import GPUEnergy, PowerModel, busy_power_w, compose_power_model, energy_j
from burstgym.latency.profiles import (
    ACTIVATION_RESERVE_TOKENS,
    GPU_MEMORY_UTILIZATION,
    GPUS_DIR,
    PROFILES_DIR,
    GPUConstants,
    GPUFamily,
    Profile,
    build_profile,
    compose_kernels,
    compose_latency_model,
    compose_profile,
    kv_capacity_tokens,
    list_gpus,
    list_profiles,
    load_gpu,
    load_profile,
    profile_from_dict,
    provisional_h100_llama2_7b,
    show,
    with_engine,
)

__all__ = [
    "ACTIVATION_RESERVE_TOKENS",
    "DEFAULT_ENGINE",
    "DTYPE_BYTES",
    "ENGINES_DIR",
    "GPU_MEMORY_UTILIZATION",
    "GPUS_DIR",
    "MODELS_DIR",
    "PROFILES_DIR",
    "Engine",
    "EngineTerms",
    "GPUConstants",
    "GPUEnergy",
    "GPUFamily",
    "LatencyModel",
    "ModelConfig",
    "PowerModel",
    "Profile",
    "apply_engine",
    "build_profile",
    "busy_power_w",
    "compose_kernels",
    "compose_latency_model",
    "compose_profile",
    "compose_power_model",
    "energy_j",
    "kv_capacity_tokens",
    "list_engines",
    "list_gpus",
    "list_models",
    "list_profiles",
    "load_engine",
    "load_gpu",
    "load_model_config",
    "load_profile",
    "main",
    "model_config_from_dict",
    "profile_from_dict",
    "provisional_h100_llama2_7b",
    "show",
    "smooth_max",
    "step_time",
    "with_engine",
]
