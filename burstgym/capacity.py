"""Nominal capacity: the request rate a node sustains, so a scenario's load means the same on any GPU.

A scenario gives load as a fraction of the cluster's capacity; the arrival rate is
`load x sum over nodes of capacity_rps(node)`. Capacity is the saturation throughput of the
node's scheduler at its largest batch, from the latency model and the mean request lengths:

- continuous batching: the running set holds `b = min(max_num_seqs, kv_capacity / (P + O/2))`
  sequences (mean prompt P, mean output O; a sequence holds on average P + O/2 KV tokens).
  Each request occupies O iterations, so one iteration completes b/O requests; an iteration
  decodes b sequences over b (P + O/2) KV tokens and prefills the newcomers' b P / O tokens.
  Capacity = b / (O x iteration time).
- dynamic batching: a full batch of `max_batch_size` requests prefills together, then decodes
  until its longest member is done (E[max of the batch's outputs] iterations, from samples of
  the length distribution), with the mean number of members still decoding.
  Capacity = max_batch_size / batch time.

This is a nominal figure (no queueing, no chunking or preemption effects): load 1.0 is the
point past which queues must grow, not a measured throughput.
"""

from __future__ import annotations

import jax
import numpy as np

from burstgym.latency import LatencyModel, step_time


def _seconds(model: LatencyModel, prefill: float, decode: float, kv: float, pairs: float) -> float:
    return float(step_time(model, prefill, decode, kv, pairs))


def continuous_capacity_rps(
    model: LatencyModel,
    speed: float,
    max_num_seqs: int,
    kv_capacity_tokens: int,
    mean_prompt: float,
    mean_output: float,
) -> float:
    """Saturation request rate of one continuous-batching node (see module docstring)."""
    ctx = mean_prompt + mean_output / 2.0
    b = max(1.0, min(float(max_num_seqs), kv_capacity_tokens / ctx))
    per_iter = b / mean_output
    t = speed * _seconds(
        model, per_iter * mean_prompt, b, b * ctx, per_iter * mean_prompt * (mean_prompt + 1) / 2.0
    )
    return per_iter / t


def dynamic_capacity_rps(
    model: LatencyModel,
    speed: float,
    max_batch_size: int,
    mean_prompt: float,
    outputs: np.ndarray,
) -> float:
    """Saturation request rate of one dynamic-batching node, given a sample of output lengths."""
    b = int(max_batch_size)
    n = (len(outputs) // b) * b
    batches = np.asarray(outputs[:n], dtype=float).reshape(-1, b)
    longest = float(batches.max(axis=1).mean())
    mean_out = float(batches.mean())
    prefill = _seconds(model, b * mean_prompt, 0.0, 0.0, b * mean_prompt * (mean_prompt + 1) / 2.0)
    steps = max(longest - 1.0, 0.0)
    active = b * max(mean_out - 1.0, 0.0) / max(steps, 1e-9) if steps > 0 else 0.0
    decode = _seconds(model, 0.0, active, active * (mean_prompt + mean_out / 2.0), 0.0) if steps > 0 else 0.0
    return b / (speed * (prefill + steps * decode))


def sample_outputs(workload, n: int = 8192, seed: int = 12345) -> np.ndarray:
    """Output lengths drawn from a workload (for the dynamic-batching capacity)."""
    return np.asarray(workload.sample(jax.random.key(seed), n).output)
