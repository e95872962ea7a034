"""The simulator's data: static configuration, per-episode parameters and state, as pytrees.

Shapes use `N` for nodes, `S` for request slots per node, `E` for requests per episode, `B` for
prefix chunks per request, `U` for distinct prefix chunks per episode and `H` for the positions of a
node's prefix-cache table (`burstgym.prefix_cache.positions`). Every array field says
its shape and dtype; floats use JAX's default float dtype.

Times held in the state are *relative to the current arrival* (the clock's origin moves to each
new arrival), so float32 keeps sub-microsecond resolution however long the episode; the request
log holds latencies, not absolute times.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import jax

from burstgym.chunk_table import ChunkTable
from burstgym.latency import LatencyModel, PowerModel
from burstgym.record import Record
from burstgym.workload import Requests, Workload

# Node phases (NodeState.phase).
IDLE, BUSY, ASLEEP, WAKING = 0, 1, 2, 3
# Request-slot status (Slots.status). DONE: finished during this step, logged and freed at its end.
EMPTY, WAITING, RUNNING, DONE = 0, 1, 2, 3
# Request index of an empty slot: out of bounds, so scatters to the log drop it.
NO_REQUEST = 2**31 - 1

SCHEDULERS = ("continuous", "dynamic")
OBJECTIVES = ("latency", "excess", "slo")
REWARDS = ("accrual", "finish")
ENDS = ("drain", "cut")


@dataclass(frozen=True)
class EnvConfig:
    """Static configuration: fixes array shapes and which code is traced (hashable for jit)."""

    n_nodes: int  # N
    episode_length: int  # E, arrivals routed per episode
    scheduler: str  # "continuous" (vLLM/Orca) or "dynamic" (Triton dynamic batcher)
    workload: Workload  # draws the request stream at reset
    objective: str = "latency"  # "latency", "excess" (latency beyond an idle node's) or "slo" (goodput)
    reward: str = "accrual"  # "accrual" (Little's law, as it accrues) or "finish" (each request when done)
    end: str = "drain"  # "drain": the last step serves everyone (termination); "cut": stop (truncation)
    slots: int = 128  # S, requests a node can hold; more raises a slot-overflow error
    # Narrower slot tables a step may run at (burstgym.env, "Slot widths"); () runs every step at S.
    slot_widths: tuple[int, ...] = (32, 64, 128)
    # Fewer prefix chunks per request a step may run at, on the narrowest slot tables
    # (burstgym.env, "Chunk widths"); () runs every step at the stream's B.
    chunk_widths: tuple[int, ...] = (128,)
    prefix_caching: bool = False  # continuous batching: per-node prefix cache (traced only when True)
    chunk_tokens: int = 512  # G, tokens per prefix-cache chunk (a multiple of every node's block_size)
    # Chunks a node's prefix cache holds at most (burstgym.prefix_cache.entry_bound); sizes its table.
    cache_entries: int = 0
    padding: bool = True  # dynamic batching: pad prompts to the batch's longest, keep finished rows


class NodeParams(NamedTuple):
    """Per-node parameters; every field has shape [N] so clusters may be heterogeneous."""

    latency: LatencyModel  # step-time coefficients, each [N] float
    power: PowerModel  # energy coefficients, each [N] float (burstgym.latency.power)
    speed: jax.Array  # [N] float, multiplies every iteration's duration
    max_num_seqs: jax.Array  # [N] int32, running-set limit (continuous)
    max_num_batched_tokens: jax.Array  # [N] int32, token budget per iteration (continuous)
    block_size: jax.Array  # [N] int32, tokens per KV block
    kv_blocks: jax.Array  # [N] int32, KV blocks on the node (capacity tokens // block_size)
    max_batch_size: jax.Array  # [N] int32 (dynamic)
    max_queue_delay: jax.Array  # [N] float, seconds (dynamic)
    queue_capacity: jax.Array  # [N] int32, waiting requests beyond which arrivals are dropped
    sleep_power_w: jax.Array  # [N] float, watts while asleep
    sleep_timeout: jax.Array  # [N] float, seconds idle and empty before sleeping (inf: never)
    wake_delay: jax.Array  # [N] float, seconds from an arrival to being able to run
    capacity_rps: jax.Array  # [N] float, requests/s the node sustains (burstgym.capacity)
    request_scale: jax.Array  # [N] float, requests a node holds at saturation (observation scale)


class LengthStats(NamedTuple):
    """The workload's request lengths as a router may assume them (never a request's own); `M` is the
    largest batch of the nodes (`max_batch_size`). Read by `burstgym.prediction`."""

    mean_prompt: jax.Array  # [] float, tokens
    mean_output: jax.Array  # [] float, tokens
    longest_prompt: jax.Array  # [M] float, E[longest prompt of b requests], b = 1..M
    longest_output: jax.Array  # [M] float, E[longest output of b requests], b = 1..M


class EnvParams(NamedTuple):
    """Parameters of one cluster, a pytree: vmap over it to sweep scenarios."""

    nodes: NodeParams
    drop_penalty: jax.Array  # [] float, objective cost of one drop (seconds of latency)
    energy_weight: jax.Array  # [] float, objective cost per joule (seconds per J)
    ttft_weight: jax.Array  # [] float, weight of TTFT added to the latency objectives
    reward_scale: jax.Array  # [] float, rewards are divided by it
    ttft_slo: jax.Array  # [] float, seconds
    tpot_slo: jax.Array  # [] float, seconds per output token
    capacity_rate: jax.Array  # [] float, requests/s the cluster sustains (sum of capacity_rps)
    arrival_rate: jax.Array  # [] float, the workload's mean arrivals/s (load x capacity_rate)
    prompt_scale: jax.Array  # [] float, tokens (observation scale: mean prompt)
    age_scale: jax.Array  # [] float, seconds (observation scale for waiting age)
    rate_window: jax.Array  # [] float, seconds, time constant of the arrival-rate estimate
    signal_interval: jax.Array  # [] float, seconds between refreshes of the load signals (0: exact)
    lengths: LengthStats  # the workload's mean lengths and expected longest of a batch (predictions)


class Slots(Record):
    """Requests held by each node, in a fixed table of S slots per node; every field [N, S], packed
    in `ints` [N, S, 10] and `floats` [N, S, 3] (`burstgym.record`).

    Each node's table is ordered: running requests by admission (oldest first), then waiting
    requests in FCFS queue order; free (EMPTY or DONE) slots are holes or trail (see
    `burstgym.scheduler`).

    Fields: `req` int32, request index in the episode stream, NO_REQUEST when the slot is empty;
    `status` int32, EMPTY / WAITING / RUNNING / DONE; `arrival` float, arrival time (relative to
    the current arrival: <= 0); `prompt` int32, prompt tokens; `output` int32, output tokens to
    generate; `computed` int32, tokens whose KV is in cache; `generated` int32, output tokens
    produced so far; `sched` int32, tokens scheduled in the iteration now running (0 if none);
    `pin` int32, leading prefix chunks this request holds in the node's prefix cache; `hit` int32,
    prompt tokens served from the prefix cache at first admission (-1: not yet); `preempted`
    int32, times preempted; `ttft` float, seconds from arrival to the first token (nan until
    then); `e2e` float, seconds from arrival to the last token (nan until then).
    """

    _fields = (
        "req", "status", "arrival", "prompt", "output", "computed", "generated", "sched", "pin", "hit",
        "preempted", "ttft", "e2e",
    )  # fmt: skip
    _floats = frozenset({"arrival", "ttft", "e2e"})
    _fill = {"req": NO_REQUEST, "hit": -1, "ttft": float("nan"), "e2e": float("nan")}
    __slots__ = ()
    req: jax.Array
    status: jax.Array
    arrival: jax.Array
    prompt: jax.Array
    output: jax.Array
    computed: jax.Array
    generated: jax.Array
    sched: jax.Array
    pin: jax.Array
    hit: jax.Array
    preempted: jax.Array
    ttft: jax.Array
    e2e: jax.Array


class NodeState(Record):
    """Per-node scheduler, power and accounting state; every field [N], packed in `ints` [N, 10] and
    `floats` [N, 10] (`burstgym.record`).

    Fields: `phase` int32, IDLE / BUSY / ASLEEP / WAKING; `iter_start` float, start of the
    running iteration or run (BUSY); `iter_end` float, end of the running iteration or run
    (BUSY); `repeat` int32, identical decode iterations the running event covers (1: one);
    `run_d0` float, duration of the first iteration of the running event; `run_growth` float,
    growth of the duration per iteration within a decode run; `busy_w` float, watts drawn by the
    running iteration or run; `wake_end` float, end of waking (WAKING); `idle_since` float, when
    the node last became idle; `last_time` float, time up to which latency and energy are
    accrued; `energy_j` float, energy drawn this episode; `busy_s` float, time spent running
    iterations this episode; `routed` int32, requests routed to the node (accepted or dropped);
    `batch_rows` int32, rows of the batch in flight (dynamic; 0: none); `batch_prompt` int32,
    longest prompt of the batch in flight (dynamic, padding); `batch_gen` int32, tokens each row
    of the batch in flight has produced (dynamic); `prefill_tokens` int32, prompt and recompute
    tokens prefilled this episode; `saved_tokens` int32, tokens served from the prefix cache at
    admission (re-admissions too); `hit_tokens` int32, prompt tokens served from the prefix
    cache at first admission; `admitted_prompt` int32, prompt tokens of first admissions (hit-rate
    denominator).
    """

    _fields = (
        "phase", "iter_start", "iter_end", "repeat", "run_d0", "run_growth", "busy_w",
        "wake_end", "idle_since", "last_time", "energy_j", "busy_s", "routed", "batch_rows",
        "batch_prompt", "batch_gen", "prefill_tokens", "saved_tokens", "hit_tokens",
        "admitted_prompt",
    )  # fmt: skip
    _floats = frozenset(
        {"iter_start", "iter_end", "run_d0", "run_growth", "busy_w", "wake_end", "idle_since", "last_time"}
        | {"energy_j", "busy_s"}
    )
    __slots__ = ()
    phase: jax.Array
    iter_start: jax.Array
    iter_end: jax.Array
    repeat: jax.Array
    run_d0: jax.Array
    run_growth: jax.Array
    busy_w: jax.Array
    wake_end: jax.Array
    idle_since: jax.Array
    last_time: jax.Array
    energy_j: jax.Array
    busy_s: jax.Array
    routed: jax.Array
    batch_rows: jax.Array
    batch_prompt: jax.Array
    batch_gen: jax.Array
    prefill_tokens: jax.Array
    saved_tokens: jax.Array
    hit_tokens: jax.Array
    admitted_prompt: jax.Array


class PrefixCache(NamedTuple):
    """Per-node prefix cache (docs/semantics.md, "Prefix cache"): a table of the chunks the node
    holds, keyed by chunk id, of a fixed size (`burstgym.prefix_cache.positions`).

    A chunk is present on a node when a running request pins it (its entry's `ref > 0`) or when
    it was released after the node's eviction watermark (`stamp > watermark`). Releases get
    increasing stamps, so evicting least-recently-released first is raising the watermark
    (`burstgym.chunk_table`). The node's totals are kept up to date by every change.
    """

    table: ChunkTable  # [N, H] per field (payload: [N, H] int32 tokens of each chunk)
    cached: jax.Array  # [N] int32, KV blocks of the chunks the node holds (pinned or not)
    pinned: jax.Array  # [N] int32, KV blocks of the pinned chunks
    cached_tokens: jax.Array  # [N] int32, tokens of the chunks the node holds (its "tree size")
    entries: jax.Array  # [N] int32, chunks the node holds (at most EnvConfig.cache_entries)
    full: jax.Array  # [N] bool, a chunk found no room: every entry pinned (ERROR_CACHE_FULL)


class RequestLog(NamedTuple):
    """What happened to each request of the episode; all fields [E]."""

    node: jax.Array  # int32, node it was routed to (-1 before routing)
    dropped: jax.Array  # bool
    ttft: jax.Array  # float, seconds from arrival to the first output token (nan until finished)
    e2e: jax.Array  # float, seconds from arrival to the last output token (nan until finished)
    preemptions: jax.Array  # int32, times it was preempted
    hit_tokens: jax.Array  # int32, prompt tokens served from the prefix cache at first admission


class Service(NamedTuple):
    """What each request would take alone on an idle node with an empty cache (the fastest node)."""

    ttft: jax.Array  # [E] float, seconds
    e2e: jax.Array  # [E] float, seconds


class State(NamedTuple):
    """Everything about one cluster's episode."""

    key: jax.Array  # [2] uint32, raw PRNG key data for the next reset
    # the episode's stream, [E + 1] each (the last only marks the cut time); its chunk_tokens is
    # left empty ([0]): a chunk's tokens follow from its place in the sequence (prefix_cache.slot_chunks)
    requests: Requests
    service: Service  # idle-node service times, [E + 1] each
    step: jax.Array  # [] int32, index of the request waiting to be routed
    horizon: jax.Array  # [] int32, the episode ends after routing this many requests (<= E)
    clock: jax.Array  # [] float, seconds from the episode's first arrival to the current arrival
    t_end: jax.Array  # [] float, end of the episode (clock after the drain or cut), nan before
    rate_estimate: jax.Array  # [] float, exponentially weighted arrival rate, req/s
    seen: jax.Array  # [N, K] float, the load signals as last refreshed (burstgym.signals)
    next_refresh: jax.Array  # [] float, clock of the next refresh of `seen`
    slots: Slots
    nodes: NodeState
    cache: PrefixCache
    log: RequestLog
    error: jax.Array  # [] int32, ERROR_* bits: a slot table overflowed or an event loop ran away


# State.error bits, raised as exceptions by the Python faces (burstgym.errors).
ERROR_SLOT_OVERFLOW = 1
ERROR_RUNAWAY = 2
ERROR_STAMP_OVERFLOW = 4
ERROR_CACHE_FULL = 8
