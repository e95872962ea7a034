"""What a router can predict, per node, for the arriving request: its TTFT and end-to-end latency
there, the latency it adds to the requests already there, and the objective's increase (the
marginal-cost model).

It reads only what a router can know: the `RouterView` (running and waiting requests, KV blocks in
use, prompt tokens still to prefill, the arriving prompt and its prefix hits per node, the power
state), each node's configuration (latency profile, speed, batch limits: `NodeModel`) and the
workload's lengths (`burstgym.types.LengthStats`, `EnvParams.lengths`: the arriving request's
output length is unknown, its mean stands in). The step-time model is the core's own
(`burstgym.latency.step_time`). The `marginal-cost` router (`agents/marginal_cost.py`) sends each
request to the node of least predicted increase; the observation (`burstgym.observation`) carries
the same per-node predictions, so a learned policy sees what that router computes.

Continuous batching (vLLM V1, Orca, Sarathi-Serve; docs/semantics.md). Every iteration gives each
running sequence one decode token and shares the rest of the token budget (`max_num_batched_tokens`)
between prefills, oldest first; a request's prompt is prefilled after every prompt token queued
ahead of it (FCFS). So on a node with `d` running sequences reading `K` KV tokens and `Q` prompt
tokens still to prefill, the arriving request's uncached prompt `u` (its prompt less the cached
leading blocks, at least its last token computed, as vLLM's `get_computed_blocks`) completes after
`ceil((Q + u) / (budget - d))` iterations, each `step_time(chunk, d, K)`, plus the attention pairs of
its own prompt over its cached prefix (`u (h + (u + 1) / 2)`, the step time is affine in pairs) and
of the queued prompts (taken as mean prompts from scratch). Then it decodes `mean output - 1`
iterations (`step_time(0, b, K')`) in a batch of itself and, on average, `OVERLAP` = half of every
request now on the node: each shares half of its decode (the expected overlap of two independent
exponential lifetimes of the mean, E[min] = m / 2), and `K'` is their context likewise weighted, as it
grows. What it adds to the others: every iteration that carries its tokens is slower for every
sequence in it. During its prefill each request on the node waits what its chunks add beyond the
decode-only iterations of the running sequences that would run anyway; during its decode each waits
one more sequence's decode cost per iteration for the overlap (`OVERLAP` x its decode iterations).
Half an iteration is added when the node is busy (the router does not see where the running
iteration is), the wake-up delay when it sleeps.

Dynamic batching (Triton's dynamic batcher in front of a static-batch engine). One batch runs at a
time; a batch launches when `max_batch_size` requests wait or the oldest has waited
`max_queue_delay`. The request joins the `floor(waiting / max_batch_size)`-th batch to launch; it
launches after the batch in flight (half its expected time left) and the full batches ahead, and not
before its window expires unless it is full. A batch of `b` prefills `b` prompts padded to the
longest and decodes until its longest output is done (`E[max of b]` from the workload's lengths,
`LengthStats`). What it adds to its batch-mates: one more row in every iteration, and a longer
padded prompt and longest output; what it saves them: a batch it fills launches without waiting
for its window.

Under both, the node's front-end latency (`LatencyModel.frontend_s`: request handling before the
engine, streaming after it) adds to the request's TTFT and e2e and to nothing else, as in the
simulators; a mixture-of-experts node's expert reads come with `step_time`.

Energy (`energy_weight > 0`): a sleeping node woken for the request stays awake at least its
`sleep_timeout` after the request leaves, drawing idle instead of sleep power. The cost weighs the
terms as the objective does (`burstgym.reward`): latency + `ttft_weight` x TTFT + `energy_weight` x
joules + `drop_penalty` where the node's queue is full.

Not modelled: KV-cache exhaustion (admission blocked, preemptions), `max_num_seqs`, the requests
still to arrive, and which running requests are still prefilling (all are taken as decoding).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from burstgym import capacity
from burstgym.latency import LatencyModel, step_time
from burstgym.types import ASLEEP, BUSY, SCHEDULERS, WAKING, EnvParams, LengthStats
from burstgym.workload import Workload

if TYPE_CHECKING:  # the observation module builds on this one
    from burstgym.observation import RouterView

# Expected share of one request's decode that another request on its node runs beside it: for two
# independent exponential lifetimes of mean m, E[min] = m / 2 (the workloads' output lengths are
# log-normal, not exponential: an assumption of the model, whose error docs/headroom.md measures).
OVERLAP = 0.5


class NodeModel(NamedTuple):
    """What a router is configured with about each node; every field [N]."""

    latency: LatencyModel  # step-time coefficients
    speed: jax.Array  # float, multiplies every iteration's duration
    max_num_batched_tokens: jax.Array  # float, token budget per iteration (continuous)
    max_batch_size: jax.Array  # float (dynamic)
    max_queue_delay: jax.Array  # float, seconds (dynamic)
    wake_delay: jax.Array  # float, seconds from an arrival at a sleeping node until it runs
    sleep_timeout: jax.Array  # float, seconds idle before sleeping (inf: never)
    awake_w: jax.Array  # float, idle power minus sleep power, watts


class Weights(NamedTuple):
    """The objective's weights (`burstgym.types.EnvParams`)."""

    ttft_weight: jax.Array  # []
    energy_weight: jax.Array  # [] seconds per joule
    drop_penalty: jax.Array  # [] seconds per drop


class Estimate(NamedTuple):
    """Predictions for the arriving request on each node; every field [N]."""

    ttft: jax.Array  # seconds to its first token
    e2e: jax.Array  # seconds to its last token
    delay: jax.Array  # seconds of latency it adds to the requests already on the node, summed
    energy: jax.Array  # joules it adds beyond its own work (keeping a sleeping node awake)
    cost: jax.Array  # the objective's increase: e2e + ttft_weight ttft + delay + energy and drop terms


def node_model(params: EnvParams) -> NodeModel:
    """The node configuration a router is given, from the scenario's parameters."""
    p = params.nodes
    f = jnp.asarray(p.speed).dtype
    return NodeModel(
        latency=p.latency,
        speed=p.speed,
        max_num_batched_tokens=jnp.asarray(p.max_num_batched_tokens, f),
        max_batch_size=jnp.asarray(p.max_batch_size, f),
        max_queue_delay=p.max_queue_delay,
        wake_delay=p.wake_delay,
        sleep_timeout=p.sleep_timeout,
        awake_w=p.power.idle_w - p.sleep_power_w,
    )


def length_stats(workload: Workload, max_batch: int) -> LengthStats:
    """The workload's mean lengths and the expected longest of b = 1..`max_batch` requests, from
    the sample `burstgym.capacity` draws (order statistics: E[max of b] = sum_k x_(k) ((k/n)^b -
    ((k-1)/n)^b) over the sorted sample)."""
    prompts, outputs = capacity.sample_lengths(workload)

    def longest(x: np.ndarray) -> np.ndarray:
        x = np.sort(x)
        k = np.arange(1, x.size + 1) / x.size
        b = np.arange(1, max_batch + 1)[:, None]
        return (x * (k**b - (k - 1.0 / x.size) ** b)).sum(axis=1)

    return LengthStats(
        mean_prompt=jnp.asarray(workload.mean_prompt, jnp.float32),
        mean_output=jnp.asarray(workload.mean_output, jnp.float32),
        longest_prompt=jnp.asarray(longest(prompts), jnp.float32),
        longest_output=jnp.asarray(longest(outputs), jnp.float32),
    )


def weights_of(params: EnvParams) -> Weights:
    """The objective's weights from the scenario's parameters."""
    return Weights(params.ttft_weight, params.energy_weight, params.drop_penalty)


def _prefill_seconds(nodes: NodeModel, tokens, decode, kv) -> tuple[jax.Array, jax.Array]:
    """([N] seconds, [N] iterations) to prefill `tokens` prompt tokens in iterations that share the
    token budget with `decode` decoding sequences reading `kv` KV tokens (attention pairs excluded:
    step time is affine in them, so they are added apart)."""
    lat = nodes.latency
    chunk = jnp.maximum(nodes.max_num_batched_tokens - decode, 1.0)
    full = jnp.floor(tokens / chunk)
    rest = tokens - full * chunk
    t_full = step_time(lat, chunk, decode, kv, 0.0)
    t_rest = jnp.where(rest > 0, step_time(lat, rest, decode, kv, 0.0), 0.0)
    return nodes.speed * (full * t_full + t_rest), full + (rest > 0)


def _pairs_seconds(nodes: NodeModel, pairs) -> jax.Array:
    return nodes.speed * nodes.latency.prefill_pair_s * pairs


def _continuous(view: RouterView, nodes: NodeModel, lengths: LengthStats) -> tuple[jax.Array, ...]:
    """(ttft, e2e, delay) [N] under continuous batching (see the module docstring)."""
    lat = nodes.latency
    prompt = view.prompt
    block = jnp.maximum(view.block_size, 1).astype(prompt.dtype)
    hit = jnp.minimum(view.hit_tokens, block * jnp.floor((prompt - 1.0) / block))
    own = prompt - hit
    d = view.running
    kv = view.kv_used * block
    queued = view.prefill_tokens
    own_pairs = own * (hit + (own + 1.0) / 2.0)
    queued_pairs = queued * (lengths.mean_prompt + 1.0) / 2.0
    ahead, ahead_iterations = _prefill_seconds(nodes, queued, d, kv)
    through, through_iterations = _prefill_seconds(nodes, queued + own, d, kv)
    ahead = ahead + _pairs_seconds(nodes, queued_pairs)
    through = through + _pairs_seconds(nodes, queued_pairs + own_pairs)
    now = nodes.speed * step_time(lat, jnp.minimum(queued, nodes.max_num_batched_tokens), d, kv, 0.0)
    residual = jnp.where(view.phase == BUSY, 0.5 * now, 0.0)
    ttft = _wake(view, nodes) + residual + through

    others = view.running + view.waiting
    out = lengths.mean_output
    steps = jnp.maximum(out - 1.0, 0.0)
    grow = jnp.maximum(out - 2.0, 0.0) / 2.0  # mean extra context of a sequence over its decode
    # Each request already on the node shares a fraction OVERLAP of this one's decode iterations.
    batch = 1.0 + OVERLAP * others
    context = OVERLAP * (kv + queued) + prompt + batch * grow
    t_dec = nodes.speed * step_time(lat, 0.0, batch, context, 0.0)
    e2e = ttft + steps * t_dec

    t_without = nodes.speed * step_time(lat, 0.0, batch - 1.0, context - prompt - grow, 0.0)
    per_iteration = t_dec - jnp.where(batch > 1.0, t_without, 0.0)
    # The others lose what the request's prefill adds to iterations that run anyway: its chunks'
    # time beyond a decode-only iteration of the running sequences.
    decode_only = jnp.where(d > 0, nodes.speed * step_time(lat, 0.0, d, kv, 0.0), 0.0)
    slower_prefill = (through - ahead) - (through_iterations - ahead_iterations) * decode_only
    delay = others * slower_prefill + OVERLAP * others * steps * per_iteration
    return ttft, e2e, delay


def _dynamic(
    view: RouterView, nodes: NodeModel, lengths: LengthStats, padding: bool
) -> tuple[jax.Array, ...]:
    """(ttft, e2e, delay) [N] under a batching window (see the module docstring)."""
    lat = nodes.latency
    size = nodes.max_batch_size
    mean_p, out = lengths.mean_prompt, lengths.mean_output
    m = lengths.longest_output.shape[0]

    def longest(table: jax.Array, b: jax.Array) -> jax.Array:
        return jnp.where(b > 0, table[jnp.clip(b.astype(jnp.int32), 1, m) - 1], 0.0)

    def batch(b: jax.Array, prompt: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
        """(prefill tokens, attention pairs) of a batch of b generated requests and `prompt`."""
        if padding:
            row = longest(lengths.longest_prompt, b)
            rows = b
            if prompt is not None:
                row, rows = jnp.maximum(row, prompt), b + 1.0
            return rows * row, rows * row * (row + 1.0) / 2.0
        tokens, pairs = b * mean_p, b * mean_p * (mean_p + 1.0) / 2.0
        if prompt is not None:
            tokens, pairs = tokens + prompt, pairs + prompt * (prompt + 1.0) / 2.0
        return tokens, pairs

    def prefill(tokens: jax.Array, pairs: jax.Array) -> jax.Array:
        return jnp.where(tokens > 0, nodes.speed * step_time(lat, tokens, 0.0, 0.0, pairs), 0.0)

    def decode(rows: jax.Array, context: jax.Array) -> jax.Array:
        """Seconds of one decode iteration of `rows` rows reading `context` KV tokens."""
        return jnp.where(rows > 0, nodes.speed * step_time(lat, 0.0, rows, context, 0.0), 0.0)

    def batch_seconds(b: jax.Array) -> jax.Array:
        tokens, pairs = batch(b)
        last = longest(lengths.longest_output, b)
        return prefill(tokens, pairs) + jnp.maximum(last - 1.0, 0.0) * decode(b, tokens + b * last / 2.0)

    in_flight = jnp.where(view.running > 0, 0.5 * batch_seconds(view.running), 0.0)
    ahead = jnp.floor(view.waiting / size)  # full batches that launch before ours
    mates = view.waiting - ahead * size  # requests already waiting in our batch
    rows = mates + 1.0
    full = rows >= size
    oldest = jnp.where((ahead == 0) & (mates > 0), view.window_age, 0.0)
    window = jnp.maximum(nodes.max_queue_delay - oldest, 0.0)
    free_at = in_flight + ahead * batch_seconds(size)
    start = jnp.where(full, free_at, jnp.maximum(free_at, window))
    tokens, pairs = batch(mates, view.prompt)
    ttft = _wake(view, nodes) + start + prefill(tokens, pairs)
    steps = jnp.maximum(out - 1.0, 0.0)
    grow = jnp.maximum(out - 2.0, 0.0) / 2.0  # mean generated context over the decode iterations
    t_dec = decode(rows, tokens + rows * grow)
    e2e = ttft + steps * t_dec

    # The batch-mates lose a row in every iteration and prefill a longer padded prompt; a batch the
    # request fills launches now rather than when its window expires.
    alone_tokens, alone_pairs = batch(mates)
    slower = prefill(tokens, pairs) - prefill(alone_tokens, alone_pairs)
    slower = slower + steps * (t_dec - decode(mates, alone_tokens + mates * grow))
    sooner = jnp.where(full, jnp.maximum(window - free_at, 0.0), 0.0)
    delay = mates * (slower - sooner)
    return ttft, e2e, delay


def _wake(view: RouterView, nodes: NodeModel) -> jax.Array:
    return jnp.where(
        view.phase == ASLEEP, nodes.wake_delay, jnp.where(view.phase == WAKING, 0.5 * nodes.wake_delay, 0.0)
    )


def estimate(
    view: RouterView,
    nodes: NodeModel,
    lengths: LengthStats,
    weights: Weights,
    scheduler: str = "continuous",
    padding: bool = True,
) -> Estimate:
    """Per node, the arriving request's predicted TTFT and e2e latency, the latency it adds to the
    requests already there, the energy it adds, and the resulting increase of the objective (one
    cluster: per-node fields [N]; see the module docstring for the model)."""
    if scheduler not in SCHEDULERS:
        raise ValueError(f"scheduler must be one of {SCHEDULERS}, got {scheduler!r}")
    if scheduler == "continuous":
        ttft, e2e, delay = _continuous(view, nodes, lengths)
    else:
        ttft, e2e, delay = _dynamic(view, nodes, lengths, padding)
    asleep = (view.phase == ASLEEP) | (view.phase == WAKING)
    awake = jnp.where(jnp.isfinite(nodes.sleep_timeout), nodes.sleep_timeout, 0.0)
    energy = jnp.where(asleep, nodes.awake_w * (awake + e2e), 0.0)
    # The client gets every token the front end's latency after the engine emits it: TTFT and e2e
    # grow by it, the engine's schedule (and so the delay to the others and the energy) does not.
    front = nodes.latency.frontend_s
    ttft, e2e = ttft + front, e2e + front
    cost = (
        e2e
        + weights.ttft_weight * ttft
        + delay
        + weights.energy_weight * energy
        + jnp.where(view.accepts, 0.0, weights.drop_penalty)
    )
    return Estimate(ttft, e2e, delay, energy, cost)
