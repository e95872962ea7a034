"""Independent reference simulator: a plain-Python discrete-event model of the cluster.

It implements docs/semantics.md from scratch, in float64, and shares no simulation code with the
JAX core (only the `LatencyModel` coefficient container is imported). The differential test feeds
both simulators the same stream and routing actions and compares every request's TTFT and
end-to-end latency.

Structure: each node is an object with its own clock; between two arrivals every node processes
its own events in time order (nodes do not interact), accruing energy and the Little's-law latency
integral into the current step as it goes. A continuous-batching node keeps its waiting queue in a
heap ordered by queue key (arrivals `+i`, preempted requests `-c`); a dynamic-batching node keeps
a FCFS deque.
"""

from __future__ import annotations

import heapq
import math
import sys
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from numpy.typing import ArrayLike

from burstgym.latency import LatencyModel

_IDLE, _BUSY, _ASLEEP, _WAKING = 0, 1, 2, 3
_SCHEDULERS = ("continuous", "dynamic")


@dataclass(frozen=True)
class RefNode:
    """One node's configuration (the fields mirror the JAX `NodeParams`, as Python scalars)."""

    scheduler: str  # "continuous" (vLLM/Orca) or "dynamic" (Triton dynamic batcher)
    latency: LatencyModel  # step-time coefficients, scalars
    speed: float = 1.0  # multiplies every iteration's duration
    max_num_seqs: int = 64  # running-set limit (continuous)
    max_num_batched_tokens: int = 2048  # token budget per iteration (continuous)
    block_size: int = 16  # tokens per KV block (continuous)
    kv_capacity_tokens: int = 100_000  # the node has floor(kv_capacity_tokens / block_size) blocks
    max_batch_size: int = 8  # (dynamic)
    max_queue_delay: float = 0.05  # seconds the oldest waiting request may wait (dynamic)
    queue_capacity: int = 64  # an arrival finding this many waiting requests is dropped
    busy_power_w: float = 700.0  # watts while an iteration runs
    idle_power_w: float = 100.0  # watts while idle or waking
    sleep_power_w: float = 30.0  # watts while asleep
    sleep_timeout: float = math.inf  # seconds idle and empty before sleeping (inf: never)
    wake_delay: float = 0.0  # seconds from the waking arrival to being able to run

    def __post_init__(self) -> None:
        if self.scheduler not in _SCHEDULERS:
            raise ValueError(f"scheduler must be one of {_SCHEDULERS}, got {self.scheduler!r}")
        if LatencyModel._fields != _LATENCY_FIELDS:
            raise ValueError(
                f"latency: LatencyModel fields {LatencyModel._fields} differ from those the reference "
                f"models {_LATENCY_FIELDS}; update burstgym/reference.py `_step_time`"
            )
        for name, c in zip(_LATENCY_FIELDS, self.latency, strict=True):
            if np.ndim(c) != 0:
                raise ValueError(f"latency.{name} must be a scalar, got shape {np.shape(c)}")
        for name in ("max_num_seqs", "max_num_batched_tokens", "block_size", "max_batch_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.kv_capacity_tokens < self.block_size:
            raise ValueError(
                f"kv_capacity_tokens must hold at least one block ({self.block_size}), "
                f"got {self.kv_capacity_tokens}"
            )
        if self.queue_capacity < 0:
            raise ValueError(f"queue_capacity must be >= 0, got {self.queue_capacity}")
        if not self.speed > 0:
            raise ValueError(f"speed must be > 0, got {self.speed}")
        for name in ("max_queue_delay", "sleep_timeout", "wake_delay"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")


@dataclass(frozen=True)
class RefResult:
    """What the reference simulator computed. Per-request arrays are NaN for dropped requests."""

    node: np.ndarray  # [E] int64, node each request was routed to
    dropped: np.ndarray  # [E] bool
    first_token_time: np.ndarray  # [E] float64, absolute time of the first output token
    finish_time: np.ndarray  # [E] float64, absolute time of the last output token
    ttft: np.ndarray  # [E] float64, first_token_time - arrival
    e2e_latency: np.ndarray  # [E] float64, finish_time - arrival
    tpot: np.ndarray  # [E] float64, (finish - first token) / (O - 1), 0 when O == 1
    preemptions: np.ndarray  # [E] int64, times each request was preempted
    slo_met: np.ndarray  # [E] bool, finished with ttft <= ttft_slo and tpot <= tpot_slo
    energy_j: np.ndarray  # [N] float64, energy from a_0 to t_end
    busy_s: np.ndarray  # [N] float64, time spent running iterations
    t_end: float  # max(a_{E-1}, last finish time)
    total_preemptions: int
    objective: float  # sum e2e latency + drop_penalty * drops + energy_weight * energy
    step_objective: np.ndarray  # [E] float64, objective accrued in [a_k, a_{k+1}) (last: to t_end)
    goodput: int  # requests that met both SLOs
    slo_step_reward: np.ndarray  # [E] float64, +1 per SLO-met finish, -drop_penalty per drop (unscaled)


# The coefficients `_step_time` models; a new field in `LatencyModel` must be added here too.
_LATENCY_FIELDS = (
    "overhead_s",
    "overhead_seq_s",
    "kernel_fixed_s",
    "weights_s",
    "token_s",
    "logits_seq_s",
    "knee_p",
    "tile_tokens",
    "elementwise_token_s",
    "attn_fixed_s",
    "attn_seq_s",
    "kv_token_s",
    "prefill_fixed_s",
    "prefill_pair_s",
    "allreduce_fixed_s",
    "allreduce_token_s",
)


def _step_time(
    lat: LatencyModel, prefill_tokens: int, decode_seqs: int, kv_tokens: int, prefill_pairs: float
) -> float:
    """Seconds of one iteration; mirrors `burstgym.latency.step_time` in plain floats.

    `lat` holds Python floats. Linear layers are the p-norm smooth maximum of the weight-streaming
    floor and the compute time, as in `burstgym.latency.smooth_max`.
    """
    tokens = prefill_tokens + decode_seqs
    if tokens == 0:
        return 0.0
    tiled = math.ceil(tokens / lat.tile_tokens) * lat.tile_tokens  # GEMMs compute whole row tiles
    compute = lat.token_s * tiled + lat.logits_seq_s * decode_seqs
    top = max(lat.weights_s, compute, sys.float_info.min)
    p = lat.knee_p
    linear = top * ((lat.weights_s / top) ** p + (compute / top) ** p) ** (1.0 / p)
    t = lat.overhead_s + lat.overhead_seq_s * decode_seqs + lat.kernel_fixed_s
    t += linear + lat.elementwise_token_s * tokens
    if decode_seqs > 0:
        t += lat.attn_fixed_s + lat.attn_seq_s * decode_seqs + lat.kv_token_s * kv_tokens
    if prefill_tokens > 0:
        t += lat.prefill_fixed_s + lat.prefill_pair_s * prefill_pairs
    return t + lat.allreduce_fixed_s + lat.allreduce_token_s * tokens


class _Stream:
    """The episode's requests and the per-request log, shared by all nodes (plain lists for speed)."""

    def __init__(self, arrival: list[float], prompt: list[int], output: list[int]):
        e = len(arrival)
        self.arrival, self.prompt, self.output = arrival, prompt, output
        self.computed = [0] * e
        self.generated = [0] * e
        self.first_token = [math.nan] * e
        self.finish = [math.nan] * e
        self.preemptions = [0] * e
        self.finish_step = [-1] * e
        self.step = 0  # the step whose interval the simulation is now in
        self.step_latency = [0.0] * e  # integral of requests in the cluster over each step
        self.step_energy = [0.0] * e  # joules drawn over each step, all nodes


class _Node:
    """Phase, power and accrual logic common to both schedulers; subclasses schedule iterations."""

    def __init__(self, cfg: RefNode, s: _Stream, t0: float):
        self.cfg, self.s = cfg, s
        self.lat = LatencyModel(*(float(np.asarray(c).item()) for c in cfg.latency))
        self.phase = _IDLE
        self.iter_end = math.inf
        self.wake_end = math.inf
        self.idle_since = t0
        self.last_t = t0  # the node's clock: energy and latency are accrued up to here
        self.in_node = 0  # accepted, unfinished requests on the node
        self.energy = 0.0
        self.busy = 0.0
        self._power = {
            _IDLE: cfg.idle_power_w,
            _BUSY: cfg.busy_power_w,
            _ASLEEP: cfg.sleep_power_w,
            _WAKING: cfg.idle_power_w,
        }

    # -- scheduler interface -------------------------------------------------------------------
    def n_waiting(self) -> int:
        """Requests in the waiting queue (what the drop rule counts)."""
        raise NotImplementedError

    def enqueue(self, i: int) -> None:
        """Append an accepted arrival at the tail of the waiting queue."""
        raise NotImplementedError

    def start_time(self) -> float:
        """When an idle, awake node can start its next iteration (inf: not without an arrival)."""
        raise NotImplementedError

    def start(self, tau: float) -> None:
        """If the start condition holds at `tau`, schedule an iteration: busy until `iter_end`."""
        raise NotImplementedError

    def end_iteration(self, tau: float) -> None:
        """Apply the effects of the iteration ending at `tau`."""
        raise NotImplementedError

    # -- common machinery ----------------------------------------------------------------------
    def accrue(self, t: float) -> None:
        """Integrate energy and requests-in-node from the node's clock up to `t`, into the current step."""
        dt = t - self.last_t
        if dt > 0:
            e = self._power[self.phase] * dt
            self.energy += e
            self.s.step_energy[self.s.step] += e
            self.s.step_latency[self.s.step] += self.in_node * dt
            if self.phase == _BUSY:
                self.busy += dt
            self.last_t = t

    def run_iteration(
        self, tau: float, prefill_tokens: int, decode_seqs: int, kv_tokens: int, prefill_pairs: float
    ) -> None:
        """Become busy from `tau` for one iteration of the given shape."""
        self.phase = _BUSY
        self.iter_end = tau + self.cfg.speed * _step_time(
            self.lat, prefill_tokens, decode_seqs, kv_tokens, prefill_pairs
        )

    def finish_request(self, i: int, tau: float) -> None:
        """Record request `i` finishing at `tau`."""
        self.s.finish[i] = tau
        self.s.finish_step[i] = self.s.step
        self.in_node -= 1

    def next_event(self) -> float:
        """The node's next event time (semantics: "A node's next event time")."""
        if self.phase == _BUSY:
            return self.iter_end
        if self.phase == _WAKING:
            return self.wake_end
        if self.phase == _ASLEEP:
            return math.inf
        start = self.start_time()
        if start < math.inf:
            return start
        if self.in_node == 0 and self.cfg.sleep_timeout < math.inf:
            return self.idle_since + self.cfg.sleep_timeout
        return math.inf

    def handle(self, tau: float) -> None:
        """Process the node's event at `tau` (steps 1-4 of the contract, in order)."""
        self.accrue(tau)
        if self.phase == _BUSY and self.iter_end == tau:
            self.end_iteration(tau)
            self.phase, self.idle_since = _IDLE, tau
        if self.phase == _WAKING and self.wake_end == tau:
            self.phase, self.idle_since = _IDLE, tau
        if (
            self.phase == _IDLE
            and self.in_node == 0
            and self.cfg.sleep_timeout < math.inf
            and tau >= self.idle_since + self.cfg.sleep_timeout
        ):
            self.phase = _ASLEEP
        if self.phase == _IDLE:
            self.start(tau)

    def advance(self, until: float) -> None:
        """Process every event at a time <= `until`, then accrue up to `until`."""
        t = self.next_event()
        while t <= until:
            self.handle(t)
            t = self.next_event()
        self.accrue(until)

    def drain(self) -> None:
        """Process events until the node holds no request."""
        while self.in_node > 0:
            self.handle(self.next_event())

    def arrive(self, i: int, t: float) -> None:
        """Accept request `i` at its arrival time `t` (the node's clock is already at `t`)."""
        self.in_node += 1
        self.enqueue(i)
        if self.phase == _ASLEEP:
            self.phase, self.wake_end = _WAKING, t + self.cfg.wake_delay


class _ContinuousNode(_Node):
    """vLLM/Orca-style iteration-level batching with a token budget, KV blocks and preemption."""

    def __init__(self, cfg: RefNode, s: _Stream, t0: float):
        super().__init__(cfg, s, t0)
        self.n_blocks = cfg.kv_capacity_tokens // cfg.block_size
        self.waiting: list[tuple[int, int]] = []  # heap of (queue key, request)
        self.running: list[int] = []  # in admission order, oldest first
        self.sched: list[tuple[int, int]] = []  # (request, tokens) of the running iteration
        self.preempt_counter = 0

    def n_waiting(self) -> int:
        return len(self.waiting)

    def enqueue(self, i: int) -> None:
        heapq.heappush(self.waiting, (i, i))

    def start_time(self) -> float:
        return self.last_t if self.running or self.waiting else math.inf

    def start(self, tau: float) -> None:
        if not (self.running or self.waiting):
            return
        self.sched = self._plan()
        if not self.sched:  # every running request was preempted: plan again, now admitting
            self.sched = self._plan()
        if not self.sched:
            raise RuntimeError("stall: no request can be scheduled (input validation should prevent it)")
        s = self.s
        # 4. the iteration's shape
        prefill_tokens = decode_seqs = kv_tokens = 0
        prefill_pairs = 0.0
        for i, t in self.sched:
            c = s.computed[i]
            if t == 1 and c == s.prompt[i] + s.generated[i] - 1:
                decode_seqs += 1
                kv_tokens += c
            else:
                prefill_tokens += t
                prefill_pairs += t * (c + (t + 1) / 2)
        self.run_iteration(tau, prefill_tokens, decode_seqs, kv_tokens, prefill_pairs)

    def _plan(self) -> list[tuple[int, int]]:
        """Steps 1-3 of the contract: the (request, tokens > 0) pairs of the next iteration."""
        s, bs = self.s, self.cfg.block_size
        budget = self.cfg.max_num_batched_tokens
        # 1. running requests take tokens greedily, oldest admission first
        sched = []
        for i in self.running:
            need = s.prompt[i] + s.generated[i] - s.computed[i]
            sched.append((i, min(need, max(0, budget))))
            budget -= need
        budget = max(0, budget)
        # 2. KV blocks for the running set; preempt the most recently admitted until the rest fit
        held = [-(-s.computed[i] // bs) for i in self.running]
        new = [-(-(s.computed[i] + t) // bs) - h for (i, t), h in zip(sched, held, strict=True)]
        free = self.n_blocks - sum(held)
        if sum(new) > free:
            keep, need_blocks, freed = len(self.running), sum(new), 0
            while need_blocks > free + freed:
                keep -= 1
                need_blocks -= new[keep]
                freed += held[keep]
            for i in reversed(self.running[keep:]):  # most recently admitted gets the largest key
                self.preempt_counter += 1
                s.computed[i] = 0
                s.preemptions[i] += 1
                heapq.heappush(self.waiting, (-self.preempt_counter, i))
            del self.running[keep:]
            del sched[keep:]
        else:
            # 3. admission, FCFS with head-of-line blocking
            free -= sum(new)
            while self.waiting and len(self.running) < self.cfg.max_num_seqs:
                i = self.waiting[0][1]
                t = min(s.prompt[i] + s.generated[i], budget)
                blocks = -(-t // bs)
                if t <= 0 or blocks > free:
                    break
                heapq.heappop(self.waiting)
                free -= blocks
                budget -= t
                self.running.append(i)
                sched.append((i, t))
        return [(i, t) for i, t in sched if t > 0]

    def end_iteration(self, tau: float) -> None:
        s = self.s
        for i, t in self.sched:
            s.computed[i] += t
            if s.computed[i] == s.prompt[i] + s.generated[i]:
                s.generated[i] += 1
                if s.generated[i] == 1:
                    s.first_token[i] = tau
                if s.generated[i] == s.output[i]:
                    self.running.remove(i)
                    self.finish_request(i, tau)
        self.sched = []


class _DynamicNode(_Node):
    """Triton-style dynamic batcher: one static batch in flight, launched when full or timed out."""

    def __init__(self, cfg: RefNode, s: _Stream, t0: float):
        super().__init__(cfg, s, t0)
        self.waiting: deque[int] = deque()
        self.batch: list[int] = []  # unfinished members of the batch in flight
        self.in_prefill = False  # whether the running iteration is the batch's prefill

    def n_waiting(self) -> int:
        return len(self.waiting)

    def enqueue(self, i: int) -> None:
        self.waiting.append(i)

    def start_time(self) -> float:
        if self.batch or len(self.waiting) >= self.cfg.max_batch_size:
            return self.last_t
        if self.waiting:
            return max(self.last_t, self.s.arrival[self.waiting[0]] + self.cfg.max_queue_delay)
        return math.inf

    def start(self, tau: float) -> None:
        s = self.s
        if self.batch:  # decode iteration of the batch in flight
            kv = sum(s.prompt[i] + s.generated[i] - 1 for i in self.batch)
            self.in_prefill = False
            self.run_iteration(tau, 0, len(self.batch), kv, 0.0)
            return
        w = len(self.waiting)
        if not (
            w >= self.cfg.max_batch_size
            or (w > 0 and tau >= s.arrival[self.waiting[0]] + self.cfg.max_queue_delay)
        ):
            return
        self.batch = [self.waiting.popleft() for _ in range(min(w, self.cfg.max_batch_size))]
        # a one-token prompt is classified as decoding (0 KV tokens), as in continuous step 4
        prompts = [s.prompt[i] for i in self.batch if s.prompt[i] > 1]
        self.in_prefill = True
        self.run_iteration(
            tau, sum(prompts), len(self.batch) - len(prompts), 0, sum(p * (p + 1) / 2 for p in prompts)
        )

    def end_iteration(self, tau: float) -> None:
        s = self.s
        for i in self.batch:
            s.generated[i] += 1
            if self.in_prefill:
                s.computed[i] = s.prompt[i]
                s.first_token[i] = tau
            else:
                s.computed[i] += 1
            if s.generated[i] == s.output[i]:
                self.finish_request(i, tau)
        self.batch = [i for i in self.batch if s.generated[i] < s.output[i]]


def _validate(
    nodes: Sequence[RefNode], arrival: np.ndarray, prompt: np.ndarray, output: np.ndarray, actions: np.ndarray
) -> None:
    """Raise ValueError naming the offending field for inputs the contract excludes."""
    if len(nodes) == 0:
        raise ValueError("nodes must not be empty")
    for name, x in (("arrival", arrival), ("prompt", prompt), ("output", output), ("actions", actions)):
        if x.ndim != 1:
            raise ValueError(f"{name} must be one-dimensional, got shape {x.shape}")
    e = len(arrival)
    if e == 0:
        raise ValueError("arrival must hold at least one request")
    for name, x in (("prompt", prompt), ("output", output), ("actions", actions)):
        if len(x) != e:
            raise ValueError(f"{name} has length {len(x)}, but arrival has length {e}")
        if not np.all(x == np.round(x)):
            raise ValueError(f"{name} must hold integers")
    if not np.all(np.isfinite(arrival)):
        raise ValueError("arrival must be finite")
    bad = np.flatnonzero(np.diff(arrival) < 0)
    if bad.size:
        raise ValueError(f"arrival must be non-decreasing: arrival[{bad[0] + 1}] < arrival[{bad[0]}]")
    for name, x in (("prompt", prompt), ("output", output)):
        bad = np.flatnonzero(x < 1)
        if bad.size:
            raise ValueError(f"{name} must be >= 1: {name}[{bad[0]}] = {x[bad[0]]}")
    bad = np.flatnonzero((actions < 0) | (actions >= len(nodes)))
    if bad.size:
        raise ValueError(f"actions[{bad[0]}] = {actions[bad[0]]} is out of range [0, {len(nodes)})")
    for n, cfg in enumerate(nodes):
        if cfg.scheduler != "continuous":
            continue
        mine = actions == n
        # the longest sequence a request ever computes is P + O - 1 tokens; alone, it must fit
        longest = int((prompt[mine] + output[mine] - 1).max(initial=0))
        if -(-longest // cfg.block_size) > cfg.kv_capacity_tokens // cfg.block_size:
            raise ValueError(
                f"kv_capacity_tokens of node {n} ({cfg.kv_capacity_tokens}) cannot hold a request of "
                f"{longest} tokens routed to it: the node would stall"
            )


def simulate(
    nodes: Sequence[RefNode],
    arrival: ArrayLike,
    prompt: ArrayLike,
    output: ArrayLike,
    actions: ArrayLike,
    *,
    drop_penalty: float = 0.0,
    energy_weight: float = 0.0,
    ttft_slo: float = math.inf,
    tpot_slo: float = math.inf,
) -> RefResult:
    """Run one episode: route request `k` to node `actions[k]` at `arrival[k]`, then drain.

    :param nodes: the cluster, one `RefNode` per node.
    :param arrival: [E] arrival times, non-decreasing.
    :param prompt: [E] prompt tokens, >= 1.
    :param output: [E] output tokens, >= 1.
    :param actions: [E] node index for each request.
    :param drop_penalty: objective cost of one drop (seconds of latency).
    :param energy_weight: objective cost per joule (seconds per J).
    :param ttft_slo: TTFT target in seconds (for `slo_met`, `goodput`, `slo_step_reward`).
    :param tpot_slo: TPOT target in seconds per output token.
    """
    arrival_a = np.asarray(arrival, dtype=np.float64)
    prompt_a, output_a, actions_a = (np.asarray(x) for x in (prompt, output, actions))
    _validate(nodes, arrival_a, prompt_a, output_a, actions_a)
    e = len(arrival_a)
    s = _Stream(arrival_a.tolist(), prompt_a.astype(np.int64).tolist(), output_a.astype(np.int64).tolist())
    t0 = s.arrival[0]
    sim: list[_Node] = [
        _ContinuousNode(c, s, t0) if c.scheduler == "continuous" else _DynamicNode(c, s, t0) for c in nodes
    ]
    route = actions_a.astype(np.int64).tolist()
    dropped = [False] * e
    for k in range(e):
        s.step = k
        node = sim[route[k]]
        if node.n_waiting() >= node.cfg.queue_capacity:
            dropped[k] = True
        else:
            node.arrive(k, s.arrival[k])
        if k + 1 < e:
            for nd in sim:
                nd.advance(s.arrival[k + 1])
    for nd in sim:
        nd.drain()
    finished = [f for f in s.finish if not math.isnan(f)]
    t_end = max([s.arrival[-1], *finished])
    for nd in sim:
        nd.advance(t_end)  # sleep transitions up to t_end, energy to t_end
    return _result(
        s, sim, np.asarray(route), np.asarray(dropped), t_end, drop_penalty, energy_weight, ttft_slo, tpot_slo
    )


def _result(
    s: _Stream,
    sim: list[_Node],
    route: np.ndarray,
    dropped: np.ndarray,
    t_end: float,
    drop_penalty: float,
    energy_weight: float,
    ttft_slo: float,
    tpot_slo: float,
) -> RefResult:
    """Assemble the per-request log, the objective and its per-step decomposition."""
    arrival = np.asarray(s.arrival)
    output = np.asarray(s.output)
    first = np.asarray(s.first_token)
    finish = np.asarray(s.finish)
    ttft = first - arrival
    e2e = finish - arrival
    with np.errstate(invalid="ignore", divide="ignore"):
        tpot = np.where(output > 1, (finish - first) / np.maximum(output - 1, 1), 0.0)
    tpot[dropped] = np.nan
    slo_met = ~dropped & (ttft <= ttft_slo) & (tpot <= tpot_slo)
    energy = np.asarray([nd.energy for nd in sim])
    objective = float(np.nansum(e2e) + drop_penalty * dropped.sum() + energy_weight * energy.sum())
    step_objective = (
        np.asarray(s.step_latency) + energy_weight * np.asarray(s.step_energy) + drop_penalty * dropped
    )
    slo_step_reward = -drop_penalty * dropped.astype(np.float64)
    np.add.at(slo_step_reward, np.asarray(s.finish_step)[slo_met], 1.0)
    return RefResult(
        node=route,
        dropped=dropped,
        first_token_time=first,
        finish_time=finish,
        ttft=ttft,
        e2e_latency=e2e,
        tpot=tpot,
        preemptions=np.asarray(s.preemptions, dtype=np.int64),
        slo_met=slo_met,
        energy_j=energy,
        busy_s=np.asarray([nd.busy for nd in sim]),
        t_end=t_end,
        total_preemptions=int(sum(s.preemptions)),
        objective=objective,
        step_objective=step_objective,
        goodput=int(slo_met.sum()),
        slo_step_reward=slo_step_reward,
    )


def nodes_from_params(scheduler: str, params) -> list[RefNode]:
    """`RefNode`s with the values of a JAX `EnvParams` (reads parameters only, no simulation code)."""
    p = params.nodes
    n = len(np.asarray(p.speed))

    def at(x, i):
        return np.asarray(x)[i].item()

    return [
        RefNode(
            scheduler=scheduler,
            latency=LatencyModel(*(float(at(f, i)) for f in p.latency)),
            speed=float(at(p.speed, i)),
            max_num_seqs=int(at(p.max_num_seqs, i)),
            max_num_batched_tokens=int(at(p.max_num_batched_tokens, i)),
            block_size=int(at(p.block_size, i)),
            kv_capacity_tokens=int(at(p.kv_blocks, i)) * int(at(p.block_size, i)),
            max_batch_size=int(at(p.max_batch_size, i)),
            max_queue_delay=float(at(p.max_queue_delay, i)),
            queue_capacity=int(at(p.queue_capacity, i)),
            busy_power_w=float(at(p.busy_power_w, i)),
            idle_power_w=float(at(p.idle_power_w, i)),
            sleep_power_w=float(at(p.sleep_power_w, i)),
            sleep_timeout=float(at(p.sleep_timeout, i)),
            wake_delay=float(at(p.wake_delay, i)),
        )
        for i in range(n)
    ]
