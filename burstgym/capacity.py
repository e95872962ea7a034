"""Node capacity: the request rate a node sustains at saturation, so "load" means the same on any GPU.

A scenario gives load as a fraction of the cluster's capacity; the arrival rate is
`load x sum over nodes of capacity_rps(node)`. Load 1.0 is the saturation point of the workload
actually replayed: the throughput of a node whose queue never empties, computed from the
latency model and a sample of the workload's request lengths (not only their means), including
what binds for long prompts:

- continuous batching: the running set holds `b` sequences, the fewest of `max_num_seqs`, the
  KV-limited count `kv_capacity / C` and the token-budget-limited count. `C` is the KV a
  sequence holds averaged over its decode iterations, `E[O (P + O / 2)] / E[O]` (long outputs
  hold their context longer); a request takes `E[O] + E[ceil(P / budget)] - 1` iterations
  (chunked prefill), so an iteration completes `b / I` requests and carries their prompts:
  `b E[P] / I` prefill tokens and `b E[P (P + 1) / 2] / I` attention pairs (quadratic in the
  prompt), beside `b (E[O] - 1) / I` decoding sequences over their KV. The budget bounds `b` by
  `budget x I / (E[P] + E[O] - 1)`. Capacity = `b / (I x iteration time)`.
- dynamic batching: a full batch of `max_batch_size` requests prefills together (padded to its
  longest prompt, with `padding`), then decodes until its longest member is done (every row
  with padding, the unfinished members without); sampled batches give the expectations.
  Capacity = `max_batch_size / E[batch time]`.

Prefix-cache hits are not counted (they depend on routing): with shared prefixes a cluster can
carry more than load 1.0 of the same workload. `tests/test_capacity.py` holds the figure to the
simulator: at load 0.9 queues stay bounded, at 1.1 they grow.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import numpy as np

from burstgym.latency import LatencyModel, step_time
from burstgym.workload import Conversations, PoissonArrivals, TraceReplay, Workload
from burstgym.workload.base import Requests, round_up_pow2

SAMPLE = 8192  # requests drawn to estimate the length moments
SEED = 12345


class Capacity(NamedTuple):
    """A node's saturation throughput and how many requests it then holds."""

    rps: float  # requests per second
    concurrency: float  # requests in the running set (continuous) or batch (dynamic) at saturation


def _seconds(model: LatencyModel, prefill: float, decode: float, kv: float, pairs: float) -> float:
    return float(step_time(model, prefill, decode, kv, pairs))


def sample_lengths(workload: Workload, n: int = SAMPLE, seed: int = SEED) -> tuple[np.ndarray, np.ndarray]:
    """(prompts, outputs) of `n` requests drawn from the workload, as float arrays."""
    req = _draw(lengths_only(workload), n, jax.random.key(seed))
    return np.asarray(req.prompt, dtype=np.float64), np.asarray(req.output, dtype=np.float64)


def lengths_only(workload: Workload) -> Workload:
    """The workload with what cannot change its lengths made the same, so that workloads differing
    only in it (the unit-rate workload a scenario's capacity is estimated from and the same at the
    scenario's rate) share one compiled draw: a generated arrival process (Poisson, Gamma, MMPP,
    diurnal) becomes Poisson arrivals at rate 1 (`Workload.sample` draws arrivals from a key of
    their own), and a trace replay plays at the trace's own rate (the episode's window of rows
    does not depend on the rate). Conversations are kept whole: which turns fall in an episode
    depends on the rate."""
    if isinstance(workload.arrivals, Conversations):
        return workload
    if isinstance(workload.arrivals, TraceReplay):
        return dataclasses.replace(workload, arrivals=dataclasses.replace(workload.arrivals, rate=None))
    return dataclasses.replace(workload, arrivals=PoissonArrivals(1.0))


@functools.partial(jax.jit, static_argnums=(0, 1))
def _draw(workload: Workload, n: int, key: jax.Array) -> Requests:
    """`workload.sample(key, n)` as one compiled program per workload and size: run operation by
    operation, its ~60 operations each compile apart at a process's first scenario."""
    return workload.sample(key, n)


def continuous_capacity(
    model: LatencyModel,
    speed: float,
    max_num_seqs: int,
    max_num_batched_tokens: int,
    kv_capacity_tokens: int,
    prompts: np.ndarray,
    outputs: np.ndarray,
) -> Capacity:
    """Saturation throughput of one continuous-batching node (see the module docstring)."""
    p, o = prompts, outputs
    held = float(np.mean(o * (p + o / 2.0)) / np.mean(o))
    iterations = float(np.mean(o) + np.mean(np.ceil(p / max_num_batched_tokens)) - 1.0)
    per_iter_tokens = float(np.mean(p) + np.mean(o) - 1.0) / iterations  # tokens per running request
    b = min(float(max_num_seqs), kv_capacity_tokens / held, max_num_batched_tokens / per_iter_tokens)
    b = max(b, 1.0)
    done = b / iterations
    decode = b * float(np.mean(o) - 1.0) / iterations
    t = speed * _seconds(
        model, done * float(np.mean(p)), decode, decode * held, done * float(np.mean(p * (p + 1.0) / 2.0))
    )
    return Capacity(done / t, b)


def dynamic_capacity(
    model: LatencyModel,
    speed: float,
    max_batch_size: int,
    prompts: np.ndarray,
    outputs: np.ndarray,
    padding: bool,
) -> Capacity:
    """Saturation throughput of one dynamic-batching node, from batches of sampled requests.

    Up to 64 batches of `max_batch_size` consecutive requests; the decode iterations of every
    batch are timed in one call (rows padded with empty iterations, which take no time).
    """
    b = int(max_batch_size)
    n = (len(outputs) // b) * b
    bp = prompts[:n].reshape(-1, b)[:64]
    bo = outputs[:n].reshape(-1, b)[:64]
    steps = bo.max(axis=1).astype(np.int64) - 1  # decode iterations of each batch
    g = np.arange(1, round_up_pow2(int(steps.max(initial=0))) + 1)  # iterations, padded
    zero = np.zeros(len(bp))
    if padding:
        top = bp.max(axis=1)
        prefill = _step_times(model, b * top, zero, zero, b * top * (top + 1) / 2.0)
        live = g[None, :] <= steps[:, None]
        rows = np.where(live, float(b), 0.0)  # decoding sequences of each batch's iterations
        kv = np.where(live, b * (top[:, None] + g[None, :] - 1.0), 0.0)
    else:
        prefill = _step_times(model, bp.sum(axis=1), zero, zero, (bp * (bp + 1) / 2).sum(axis=1))
        rows = np.zeros((len(bo), g.size))
        kv = np.zeros((len(bo), g.size))
        for i, (ps, os_, k) in enumerate(zip(bp, bo, steps, strict=True)):
            alive = (os_[None, :] > g[:k, None]).astype(float)
            rows[i, :k] = alive.sum(axis=1)
            kv[i, :k] = (alive * (ps[None, :] + g[:k, None] - 1)).sum(axis=1)
    decode = _step_times(model, np.zeros_like(rows), rows, kv, np.zeros_like(rows))
    times = [
        float(p) + float(np.sum(d[:k]))
        for p, d, k in zip(np.asarray(prefill), np.asarray(decode), steps, strict=True)
    ]
    return Capacity(b / (speed * float(np.mean(times))), float(b))


@jax.jit
def _step_times(
    model: LatencyModel, prefill: np.ndarray, decode: np.ndarray, kv: np.ndarray, pairs: np.ndarray
) -> jax.Array:
    """`step_time` over arrays of iterations, compiled once per shape (eagerly, every operation
    would compile for every new length)."""
    return step_time(model, prefill, decode, kv, pairs)
