"""Per-iteration latency model: how long one forward pass of a batch takes on one node.

The form follows the roofline view of transformer inference (see docs/latency.md and
DESIGN.md): linear layers are the slower of streaming the weights once and doing
2 x parameters FLOPs per token; decode attention reads each sequence's KV cache; prefill
attention grows with the square of the prompt; tensor parallelism adds an all-reduce per
layer; a serving engine adds a fixed per-iteration overhead (scheduler, sampling, launches).

`LatencyModel` holds the coefficients as a pytree so the simulator can vmap over nodes with
different GPUs (a heterogeneous cluster) and over clusters.
"""

from __future__ import annotations

from typing import NamedTuple

import jax.numpy as jnp
from jax.typing import ArrayLike


class LatencyModel(NamedTuple):
    """Coefficients of `step_time`, all in seconds (scalars, or arrays that broadcast)."""

    overhead_s: ArrayLike  # per-iteration serving overhead (scheduling, sampling, kernel launches)
    weights_s: ArrayLike  # reading every weight once from HBM: the memory-bound floor of linear layers
    token_s: ArrayLike  # linear-layer compute per token: 2 x parameters FLOPs / effective FLOP/s
    attn_fixed_s: ArrayLike  # decode attention: per-layer constant, summed over layers
    attn_seq_s: ArrayLike  # decode attention: per decoding sequence
    kv_token_s: ArrayLike  # decode attention: per KV token read (KV bytes per token / bandwidth)
    prefill_pair_s: ArrayLike  # prefill attention: per (query, key) pair
    allreduce_fixed_s: ArrayLike  # tensor-parallel all-reduce: fixed part per iteration
    allreduce_token_s: ArrayLike  # tensor-parallel all-reduce: per token in the pass


def step_time(
    model: LatencyModel,
    prefill_tokens: ArrayLike,
    decode_seqs: ArrayLike,
    kv_tokens: ArrayLike,
    prefill_pairs: ArrayLike | None = None,
) -> jnp.ndarray:
    """Seconds for one iteration; JAX-traceable, broadcasts over its arguments.

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
    linear = jnp.maximum(model.weights_s, model.token_s * tokens)
    decode_attn = jnp.where(
        decode_seqs > 0,
        model.attn_fixed_s + model.attn_seq_s * decode_seqs + model.kv_token_s * kv_tokens,
        0.0,
    )
    prefill_attn = model.prefill_pair_s * prefill_pairs
    allreduce = model.allreduce_fixed_s + model.allreduce_token_s * tokens
    return jnp.where(busy, model.overhead_s + linear + decode_attn + prefill_attn + allreduce, 0.0)


def provisional_h100_llama2_7b() -> LatencyModel:
    """A hand-derived H100 / Llama-2-7B / TP1 model, used until calibrated profiles exist.

    Figures from shared/data/calibration/SOURCES.md (Vidur H100 kernel sums): linear layers
    5.6 ms at 1 token, 83.3 ms at 4096 tokens; KV 512 KiB/token at ~2.2 TB/s effective.
    Prefill attention: 4 x layers x hidden FLOPs per pair (32 x 4096) at ~400 TFLOP/s.
    Overhead 3 ms is an assumption (DistServe's vLLM fits show ~20 ms for OPT-13B on A100 in
    2023-era vLLM; newer engines are lighter).
    """
    return LatencyModel(
        overhead_s=3.0e-3,
        weights_s=5.5e-3,
        token_s=83.3e-3 / 4096,
        attn_fixed_s=32 * 10e-6,
        attn_seq_s=32 * 1e-6,
        kv_token_s=512 * 1024 / 2.2e12,
        prefill_pair_s=4 * 32 * 4096 / 4.0e14,
        allreduce_fixed_s=0.0,
        allreduce_token_s=0.0,
    )
