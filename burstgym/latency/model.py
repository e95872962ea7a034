"""The step-time formula: how long one forward pass (an iteration) of a batch takes on one node.

The form is the roofline view of transformer inference used, with variations, by Vidur
(Agrawal et al., MLSys 2024), DistServe (Zhong et al., OSDI 2024) and Splitwise (Patel et al.,
ISCA 2024); docs/latency.md states it with its sources and fit errors:

- a per-iteration serving overhead (scheduler, input preparation, sampling) and a per-sequence one;
- a fixed floor per layer (launch and tail latency of the small kernels, plus the serving engine's
  launch gaps between them);
- linear layers as the slower of streaming every weight once at an effective bandwidth and doing
  2 x parameters FLOPs per token at an effective compute rate, joined by a smooth maximum because
  real GEMMs leave the memory roof gradually (tile and wave quantisation); a mixture-of-experts
  model streams, besides its dense weights, the experts its tokens were routed to (the expected
  share of experts ``T`` uniformly routed tokens touch, ``1 - (1 - k/E)^T``);
- memory-bound element-wise work (norms, rotary embedding, activation, residual adds) per token;
- decode attention as a per-layer constant, a per-sequence cost and the KV bytes read;
- prefill attention growing with the (query, key) pairs, i.e. with the prompt length squared;
- tensor-parallel all-reduce, two per layer: a latency per iteration and a cost per token.

Besides the iteration, a served request pays a front-end latency (``frontend_s``): the API server's
request handling and tokenisation before the engine sees it, and detokenisation and streaming of
each token after the engine emits it. The client receives every token ``frontend_s`` after the
engine produced it, so TTFT and end-to-end latency grow by it and inter-token gaps do not; the
engine's schedule is unchanged. The simulators add it to each request's TTFT and E2E.

`LatencyModel` holds the coefficients as a pytree of numbers so the simulator can stack one per
node (a heterogeneous cluster) and vmap over nodes and clusters. Kernel coefficients come from a
GPU fit composed with a model architecture (`burstgym.latency.profiles`); a serving-engine
calibration (`burstgym.latency.engines`) adds to the overhead, per-layer and all-reduce terms.
"""

from __future__ import annotations

from typing import NamedTuple

import jax.numpy as jnp
from jax.typing import ArrayLike


class LatencyModel(NamedTuple):
    """Coefficients of `step_time` (seconds, seconds per unit, or a pure number) and the front-end
    latency of each request."""

    overhead_s: ArrayLike  # per-iteration serving overhead (scheduler, input preparation, sampling)
    overhead_seq_s: ArrayLike  # serving overhead per decoding sequence (sampling, output handling)
    kernel_fixed_s: ArrayLike  # fixed time of the layer kernels (launch, tail, engine gaps), all layers
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
    allreduce_fixed_s: ArrayLike  # tensor-parallel all-reduce: latency per iteration (all layers)
    allreduce_token_s: ArrayLike  # tensor-parallel all-reduce: per token in the pass
    expert_weights_s: ArrayLike = 0.0  # reading every routed expert's weights once (MoE; 0: dense)
    expert_fraction: ArrayLike = 0.0  # k / E, share of a layer's experts one token is routed to
    frontend_s: ArrayLike = 0.0  # per request: tokens reach the client this long after the engine


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
    # MoE: the experts at least one of the pass's tokens was routed to (uniform routing).
    touched = 1.0 - (1.0 - jnp.asarray(model.expert_fraction, dtype=tokens.dtype)) ** tokens
    weights = model.weights_s + model.expert_weights_s * touched
    linear = smooth_max(weights, compute, model.knee_p) + model.elementwise_token_s * tokens
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
