"""Model architectures: the numbers of a decoder the latency and power models need.

A `ModelConfig` is read from a shipped file in burstgym/models/ (by name) or from any Hugging Face
``config.json`` (given by path; nothing is downloaded). It gives weight bytes per rank under tensor
parallelism (Megatron-LM layout), FLOPs per token, KV-cache bytes per token and the element-wise
traffic per token.

Mixture-of-experts models (Mixtral's ``num_local_experts`` / ``num_experts_per_tok``; Qwen-MoE's
``num_experts``, ``moe_intermediate_size`` and ``shared_expert_intermediate_size``) route each token
through ``experts_per_token`` of ``num_experts`` expert MLPs in every layer. A forward pass computes
the routed experts only (FLOPs), but reads the weights of every expert that at least one of its
tokens was routed to: with uniform routing, ``num_experts * (1 - (1 - k / num_experts) ** tokens)``
experts per layer (Mixtral: Jiang et al., "Mixtral of Experts", arXiv:2401.04088; the expected
number of distinct experts a batch touches). Under tensor parallelism every expert is sharded over
the ranks (vLLM's default without expert parallelism).
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
    num_experts: int = 0  # routed expert MLPs per layer (0: a dense model)
    experts_per_token: int = 0  # experts each token is routed to
    expert_ffn_size: int = 0  # intermediate size of one expert MLP
    shared_ffn_size: int = 0  # intermediate size of the always-active shared expert MLP(s), 0: none

    @property
    def dtype_bytes(self) -> int:
        """Bytes per weight, activation and KV element."""
        return DTYPE_BYTES[self.dtype]

    @property
    def is_moe(self) -> bool:
        """True for a mixture-of-experts model."""
        return self.num_experts > 0

    def _mlp(self, ffn: int) -> float:
        """Parameters of one MLP of intermediate size ``ffn`` (three matrices when gated, as in
        Llama's SwiGLU; two otherwise)."""
        return (3 if self.gated_mlp else 2) * self.hidden_size * ffn

    def dense_layer_params(self, tp: int = 1) -> float:
        """Parameters of one layer every forward pass reads whatever the routing, on one of ``tp``
        ranks: QKV and output projections, and the MLP (dense model) or the router and shared
        expert (MoE). Megatron-style tensor parallelism splits each evenly."""
        q = self.hidden_size * self.num_heads * self.head_dim
        kv = 2 * self.hidden_size * self.num_kv_heads * self.head_dim
        out = self.num_heads * self.head_dim * self.hidden_size
        if self.is_moe:
            mlp = self.hidden_size * self.num_experts + self._mlp(self.shared_ffn_size)
        else:
            mlp = self._mlp(self.ffn_size)
        return (q + kv + out + mlp) / tp

    def expert_params(self, tp: int = 1) -> float:
        """Parameters of one routed expert of one layer on one of ``tp`` ranks (0 for a dense model)."""
        return self._mlp(self.expert_ffn_size) / tp if self.is_moe else 0.0

    def layer_params(self, tp: int = 1) -> float:
        """Linear-layer parameters one token goes through in one layer, on one of ``tp`` ranks: the
        dense part plus its ``experts_per_token`` experts (all of a dense layer)."""
        return self.dense_layer_params(tp) + self.experts_per_token * self.expert_params(tp)

    def stored_layer_params(self, tp: int = 1) -> float:
        """Linear-layer parameters of one layer one of ``tp`` ranks holds (every expert)."""
        return self.dense_layer_params(tp) + self.num_experts * self.expert_params(tp)

    def lm_head_params(self, tp: int = 1) -> float:
        """LM-head parameters per rank (vocabulary-parallel under tensor parallelism)."""
        return self.vocab_size * self.hidden_size / tp

    def weight_bytes(self, tp: int = 1) -> float:
        """Bytes of weights one rank holds: layers, LM head and (unless tied) the embedding table."""
        embedding = 0 if self.tie_word_embeddings else self.vocab_size * self.hidden_size / tp
        params = self.num_layers * self.stored_layer_params(tp) + self.lm_head_params(tp) + embedding
        return params * self.dtype_bytes

    def streamed_weight_bytes(self, tp: int = 1) -> float:
        """Bytes one rank reads per forward pass whatever the routing: every layer's dense part and
        the LM head (the embedding is gathered row by row, not streamed)."""
        return (self.num_layers * self.dense_layer_params(tp) + self.lm_head_params(tp)) * self.dtype_bytes

    def expert_weight_bytes(self, tp: int = 1) -> float:
        """Bytes of every routed expert of every layer on one rank: what a pass reads when its
        tokens touch all experts (0 for a dense model)."""
        return self.num_layers * self.num_experts * self.expert_params(tp) * self.dtype_bytes

    def expert_fraction(self) -> float:
        """Share of a layer's experts one token is routed to, k / E (0 for a dense model)."""
        return self.experts_per_token / self.num_experts if self.is_moe else 0.0

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
        ffn = (
            self.experts_per_token * self.expert_ffn_size + self.shared_ffn_size
            if self.is_moe
            else self.ffn_size
        )
        act = (3 if self.gated_mlp else 2) * ffn / tp
        adds = 2 * 3 * h
        return (norms + rotary + act + adds) * b

    def pair_flops(self, tp: int = 1) -> float:
        """FLOPs per (query, key) attention pair per layer on one rank: QK^T and PV, 2 per MAC."""
        return 4 * (self.num_heads / tp) * self.head_dim


def _field(data: dict[str, Any], keys: tuple[str, ...], where: str, default: Any = None) -> Any:
    for key in keys:
        if data.get(key) is not None:
            return data[key]
    if default is not None:
        return default
    raise ValueError(f"{where}: missing field {keys[0]!r}")


def model_config_from_dict(data: dict[str, Any], name: str, where: str) -> ModelConfig:
    """Build a `ModelConfig` from a Hugging Face ``config.json`` (or a burstgym model file).

    Names follow Llama (``num_hidden_layers``...), with GPT-2/OPT aliases. The MLP counts as
    gated when the file says ``gated_mlp`` or uses SiLU (Llama/Mistral/Qwen SwiGLU). Mixture-of-
    experts fields: ``num_local_experts`` / ``num_experts`` / ``n_routed_experts``,
    ``num_experts_per_tok``, ``moe_intermediate_size`` (default ``intermediate_size``), and a shared
    expert as ``shared_expert_intermediate_size`` or ``n_shared_experts``. Architectures whose cost
    this model does not describe are refused with the field named: multi-head latent attention
    (``kv_lora_rank``), MoE models with dense layers among the expert layers, quantized weights.
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
    for key, what in (
        ("kv_lora_rank", "multi-head latent attention"),
        ("quantization_config", "quantized weights"),
        ("first_k_dense_replace", "dense layers among the expert layers"),
        ("mlp_only_layers", "dense layers among the expert layers"),
    ):
        if data.get(key):
            raise ValueError(f"{where}: field {key!r}: {what} is not modelled")
    if data.get("decoder_sparse_step", 1) not in (1, None):
        raise ValueError(
            f"{where}: field 'decoder_sparse_step': dense layers among the expert layers is not modelled"
        )
    moe = _moe(data, ffn, where)
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
        **moe,
    )


def _moe(data: dict[str, Any], ffn: int, where: str) -> dict[str, int]:
    """The mixture-of-experts fields of a config (empty for a dense model)."""
    experts = _field(data, ("num_local_experts", "num_experts", "n_routed_experts"), where, default=0)
    if experts in (0, 1):
        return {}
    top_k = _field(data, ("num_experts_per_tok", "experts_per_token"), where)
    expert_ffn = _field(data, ("moe_intermediate_size", "expert_ffn_size"), where, default=ffn)
    shared = _field(data, ("shared_expert_intermediate_size", "shared_ffn_size"), where, default=0)
    n_shared = _field(data, ("n_shared_experts",), where, default=0)
    values = {
        "num_experts": experts,
        "num_experts_per_tok": top_k,
        "moe_intermediate_size": expert_ffn,
        "shared_expert_intermediate_size": shared,
        "n_shared_experts": n_shared,
    }
    for key, value in values.items():
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ValueError(f"{where}: field {key!r} must be an integer >= 0, got {value!r}")
    if not 1 <= top_k <= experts:
        raise ValueError(f"{where}: field 'num_experts_per_tok' must be in [1, {experts}], got {top_k!r}")
    return {
        "num_experts": experts,
        "experts_per_token": top_k,
        "expert_ffn_size": expert_ffn,
        "shared_ffn_size": shared + n_shared * expert_ffn,
    }


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
