"""Model architectures: the numbers of a decoder the latency and power models need.

A `ModelConfig` is read from a shipped file in burstgym/models/ (by name) or from any Hugging Face
``config.json``. It gives weight bytes per rank under tensor parallelism (Megatron-LM layout),
FLOPs per token, KV-cache bytes per token and the element-wise traffic per token.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

MODELS_DIR = Path(__file__).resolve().parent.parent / "models"

DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "float8_e4m3fn": 1, "float8": 1}


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

    def pair_flops(self, tp: int = 1) -> float:
        """FLOPs per (query, key) attention pair per layer on one rank: QK^T and PV, 2 per MAC."""
        return 4 * (self.num_heads / tp) * self.head_dim


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


def read_json(path: Path) -> Any:
    """Parsed JSON of ``path``; malformed JSON is a ValueError naming the file."""
    try:
        return json.loads(Path(path).read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"{path}: malformed JSON ({err})") from err


def resolve_json(name_or_path: str | Path, directory: Path, kind: str, known: list[str]) -> Path:
    """The JSON file of a shipped `kind` called `name_or_path` in `directory`, or the path given;
    an unknown name lists the `known` ones, a missing file is named."""
    path = Path(name_or_path)
    if path.suffix != ".json":
        path = directory / f"{name_or_path}.json"
        if not path.exists():
            raise ValueError(f"unknown {kind} {str(name_or_path)!r}; known: {', '.join(known)}")
    if not path.exists():
        raise ValueError(f"{kind} file {path} does not exist")
    return path


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
    data = read_json(path)
    name = data.get("name", path.parent.name if path.name == "config.json" else path.stem)
    return model_config_from_dict(data, str(name), str(path))
