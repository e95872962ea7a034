"""Independent reference simulator: a plain-Python discrete-event model of the cluster.

It implements docs/semantics.md from scratch, in float64 and absolute time, and shares no
simulation code with the JAX core (only the `LatencyModel` and `PowerModel` coefficient containers
are imported). The differential test feeds both simulators the same stream and routing actions and
compares every request's fate, TTFT and end-to-end latency, the energy and each step's reward.

Structure: each node is an object with its own clock; between two arrivals every node processes its
own events in time order (nodes do not interact), accruing energy and the Little's-law integrals into
the current step as it goes. Every iteration is simulated on its own (the core folds runs of
identical decode iterations into one event; here none is folded, which is what the differential
test holds the folding to). A continuous-batching node keeps its running set as a list in admission
order and its waiting queue as a deque (preempted requests go back to its head); its prefix cache is
a reference count per pinned chunk plus an LRU queue (an ordered dict) of the chunks no running
request holds, evicted from its head. A dynamic-batching node keeps a FCFS deque and the batch in
flight.
"""

from __future__ import annotations

import bisect
import dataclasses
import math
import sys
from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
from numpy.typing import ArrayLike

from burstgym.latency import LatencyModel, PowerModel

if TYPE_CHECKING:
    from burstgym.types import EnvConfig, EnvParams

_IDLE, _BUSY, _ASLEEP, _WAKING = 0, 1, 2, 3
_SCHEDULERS = ("continuous", "dynamic")
_OBJECTIVES = ("latency", "excess", "slo")
_REWARDS = ("accrual", "finish")
_ENDS = ("drain", "cut")

# The coefficients `_step_time` and `_energy` model; a new field in either container must be added here.
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
    "expert_weights_s",
    "expert_fraction",
    "frontend_s",
)
_POWER_FIELDS = ("idle_w", "tdp_w", "static_w", "iteration_j", "token_j", "kv_token_j", "pair_j")


@dataclass(frozen=True)
class RefNode:
    """One node's configuration (the fields mirror the JAX `NodeParams` and the per-cluster switches
    of `EnvConfig`, as Python scalars)."""

    scheduler: str  # "continuous" (vLLM/Orca) or "dynamic" (Triton dynamic batcher)
    latency: LatencyModel  # step-time coefficients, scalars
    power: PowerModel = PowerModel(100.0, 700.0, 700.0, 0.0, 0.0, 0.0, 0.0)  # energy coefficients
    speed: float = 1.0  # multiplies every iteration's duration
    max_num_seqs: int = 64  # running-set limit (continuous)
    max_num_batched_tokens: int = 2048  # token budget per iteration (continuous)
    block_size: int = 16  # tokens per KV block (continuous)
    kv_blocks: int = 6250  # KV blocks of the node (continuous)
    max_batch_size: int = 8  # (dynamic)
    max_queue_delay: float = 0.05  # seconds the oldest waiting request may wait (dynamic)
    queue_capacity: int = 64  # an arrival finding this many waiting requests is dropped
    sleep_power_w: float = 30.0  # watts while asleep
    sleep_timeout: float = math.inf  # seconds idle and empty before sleeping (inf: never)
    wake_delay: float = 0.0  # seconds from the waking arrival to being able to run
    prefix_caching: bool = False  # continuous: per-node prefix cache over the stream's chunks
    padding: bool = True  # dynamic: pad prompts to the batch's longest, finished rows stay

    def __post_init__(self) -> None:
        if self.scheduler not in _SCHEDULERS:
            raise ValueError(f"scheduler must be one of {_SCHEDULERS}, got {self.scheduler!r}")
        for name, container, fields in (
            ("latency", LatencyModel, _LATENCY_FIELDS),
            ("power", PowerModel, _POWER_FIELDS),
        ):
            if container._fields != fields:
                raise ValueError(
                    f"{name}: {container.__name__} fields {container._fields} differ from those the "
                    f"reference models {fields}; update burstgym/reference.py"
                )
            for field, c in zip(fields, getattr(self, name), strict=True):
                if np.ndim(c) != 0:
                    raise ValueError(f"{name}.{field} must be a scalar, got shape {np.shape(c)}")
        for field, c in zip(_POWER_FIELDS, self.power, strict=True):
            if not (math.isfinite(float(c)) and float(c) >= 0):
                raise ValueError(f"power.{field} must be a finite number >= 0, got {c!r}")
        p = self.power
        if not float(p.idle_w) <= float(p.static_w) <= float(p.tdp_w):
            raise ValueError(
                f"power needs idle_w <= static_w <= tdp_w, got {p.idle_w}, {p.static_w}, {p.tdp_w}"
            )
        for name in ("max_num_seqs", "max_num_batched_tokens", "block_size", "kv_blocks", "max_batch_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.queue_capacity < 0:
            raise ValueError(f"queue_capacity must be >= 0, got {self.queue_capacity}")
        if not self.speed > 0:
            raise ValueError(f"speed must be > 0, got {self.speed}")
        for name in ("max_queue_delay", "sleep_timeout", "wake_delay", "sleep_power_w"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")


@dataclass(frozen=True)
class RefResult:
    """What the reference simulator computed. Per-request values are NaN (or -1) for requests that
    were dropped or, with `end="cut"`, had not finished by the cut."""

    node: np.ndarray  # [E] int64, node each request was routed to
    dropped: np.ndarray  # [E] bool
    first_token_time: np.ndarray  # [E] float64, absolute time the client gets the first output token
    finish_time: np.ndarray  # [E] float64, absolute time the client gets the last output token
    ttft: np.ndarray  # [E] float64, first_token_time - arrival (finished requests)
    e2e_latency: np.ndarray  # [E] float64, finish_time - arrival
    tpot: np.ndarray  # [E] float64, (finish - first token) / (O - 1), 0 when O == 1
    preemptions: np.ndarray  # [E] int64, times each request was preempted
    hit_tokens: np.ndarray  # [E] int64, prompt tokens served from the cache at first admission (-1: never)
    slo_met: np.ndarray  # [E] bool, finished with ttft <= ttft_slo and tpot <= tpot_slo
    service_ttft: np.ndarray  # [E] float64, TTFT alone on an idle node (the fastest); NaN unless excess
    service_e2e: np.ndarray  # [E] float64, e2e alone on an idle node (the fastest); NaN unless excess
    energy_j: np.ndarray  # [N] float64, energy from a_0 to t_end
    busy_s: np.ndarray  # [N] float64, time spent running iterations
    prefill_tokens: np.ndarray  # [N] int64, prompt and recompute tokens prefilled (padding included)
    saved_tokens: np.ndarray  # [N] int64, tokens served from the prefix cache at every admission
    evicted_blocks: np.ndarray  # [N] int64, KV blocks of the chunks the prefix cache evicted
    t_end: float  # drain: max(a_{E-1}, last finish); cut: the cut time
    total_preemptions: int
    step_cost: np.ndarray  # [E] float64, objective accrued in step k (the reward is -step_cost / scale)
    objective: float  # the episode's objective: step_cost.sum()
    goodput: int  # finished requests that met both SLOs


def _step_time(
    lat: LatencyModel, prefill_tokens: float, decode_seqs: float, kv_tokens: float, prefill_pairs: float
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
    weights = lat.weights_s + lat.expert_weights_s * (1.0 - (1.0 - lat.expert_fraction) ** tokens)
    top = max(weights, compute, sys.float_info.min)
    p = lat.knee_p
    linear = top * ((weights / top) ** p + (compute / top) ** p) ** (1.0 / p)
    t = lat.overhead_s + lat.overhead_seq_s * decode_seqs + lat.kernel_fixed_s
    t += linear + lat.elementwise_token_s * tokens
    if decode_seqs > 0:
        t += lat.attn_fixed_s + lat.attn_seq_s * decode_seqs + lat.kv_token_s * kv_tokens
    if prefill_tokens > 0:
        t += lat.prefill_fixed_s + lat.prefill_pair_s * prefill_pairs
    return t + lat.allreduce_fixed_s + lat.allreduce_token_s * tokens


def _energy(power: PowerModel, duration: float, tokens: float, kv_tokens: float, pairs: float) -> float:
    """Joules of one iteration: the energy roofline, capped at the board limit (burstgym.latency.power)."""
    affine = (
        power.static_w * duration
        + power.iteration_j
        + power.token_j * tokens
        + power.kv_token_j * kv_tokens
        + power.pair_j * pairs
    )
    return min(power.tdp_w * duration, affine)


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


class _Stream:
    """The episode's requests, their prefix chunks and the per-request and per-step logs (plain lists)."""

    def __init__(
        self,
        arrival: list[float],
        prompt: list[int],
        output: list[int],
        chunks: list[tuple[list[int], list[int]]],
        chunk_tokens: list[int],
    ):
        e = len(arrival)
        self.arrival, self.prompt, self.output = arrival, prompt, output
        self.chunks = chunks  # per request: (chunk ids, token end of each chunk), leading chunks only
        self.chunk_tokens = chunk_tokens  # tokens of each chunk id
        self.computed = [0] * e
        self.generated = [0] * e
        self.pin = [0] * e  # leading chunks the request holds in its node's cache
        self.hit = [-1] * e
        self.first_token = [math.nan] * e
        self.finish = [math.nan] * e
        self.preemptions = [0] * e
        self.finish_step = [-1] * e
        self.step = 0  # the step whose interval the simulation is now in
        self.step_latency = [0.0] * e  # integral of requests in the cluster over each step
        self.step_ttft = [0.0] * e  # integral of requests still waiting for a first token
        self.step_energy = [0.0] * e  # joules drawn over each step, all nodes

    def seq_len(self, i: int) -> int:
        return self.prompt[i] + self.generated[i]

    def end_of(self, i: int, n: int) -> int:
        """Token end of request i's first n chunks."""
        return self.chunks[i][1][n - 1] if n > 0 else 0

    def covered(self, i: int, tokens: int) -> int:
        """Leading chunks of request i wholly inside its first `tokens` tokens."""
        return bisect.bisect_right(self.chunks[i][1], tokens)


class _Node:
    """Phase, power and accrual logic common to both schedulers; subclasses schedule iterations."""

    def __init__(self, cfg: RefNode, s: _Stream, t0: float):
        self.cfg, self.s = cfg, s
        self.lat = LatencyModel(*(float(np.asarray(c).item()) for c in cfg.latency))
        self.pw = PowerModel(*(float(np.asarray(c).item()) for c in cfg.power))
        self.phase = _IDLE
        self.iter_end = math.inf
        self.wake_end = math.inf
        self.idle_since = t0
        self.last_t = t0  # the node's clock: energy and latency are accrued up to here
        self.in_node = 0  # accepted, unfinished requests on the node
        self.no_token = 0  # of which without a first token yet
        self.busy_w = 0.0  # watts of the running iteration
        self.energy = 0.0
        self.busy = 0.0
        self.prefill_tokens = 0
        self.saved_tokens = 0
        self.evicted_blocks = 0

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
        """Plan and start an iteration at `tau` (the start condition holds)."""
        raise NotImplementedError

    def end_iteration(self, tau: float) -> None:
        """Apply the effects of the iteration ending at `tau`."""
        raise NotImplementedError

    # -- common machinery ----------------------------------------------------------------------
    def power_w(self) -> float:
        if self.phase == _BUSY:
            return self.busy_w
        return self.cfg.sleep_power_w if self.phase == _ASLEEP else self.pw.idle_w

    def accrue(self, t: float) -> None:
        """Integrate energy and requests-in-node from the node's clock up to `t`, into the current step."""
        dt = t - self.last_t
        if dt > 0:
            e = self.power_w() * dt
            self.energy += e
            k = self.s.step
            self.s.step_energy[k] += e
            self.s.step_latency[k] += self.in_node * dt
            self.s.step_ttft[k] += self.no_token * dt
            if self.phase == _BUSY:
                self.busy += dt
            self.last_t = t

    def run_iteration(
        self, tau: float, prefill_tokens: float, decode_seqs: float, kv_tokens: float, pairs: float
    ) -> None:
        """Become busy from `tau` for one iteration of the given shape."""
        d = self.cfg.speed * _step_time(self.lat, prefill_tokens, decode_seqs, kv_tokens, pairs)
        e = _energy(self.pw, d, prefill_tokens + decode_seqs, kv_tokens, pairs)
        self.phase = _BUSY
        self.iter_end = tau + d
        self.busy_w = e / d if d > 0 else 0.0
        self.prefill_tokens += int(prefill_tokens)

    def emit(self, i: int, tau: float) -> bool:
        """Request i produces an output token at `tau`; True when that was its last."""
        s = self.s
        s.generated[i] += 1
        if s.generated[i] == 1:
            s.first_token[i] = tau + self.lat.frontend_s  # the client gets it after the front end
            self.no_token -= 1
        if s.generated[i] < s.output[i]:
            return False
        s.finish[i] = tau + self.lat.frontend_s
        s.finish_step[i] = s.step
        self.in_node -= 1
        return True

    def next_event(self) -> float:
        """The node's next event time (semantics: "Node state")."""
        if self.phase == _BUSY:
            return self.iter_end
        if self.phase == _WAKING:
            return self.wake_end
        if self.phase == _ASLEEP:
            return math.inf
        start = self.start_time()
        if start < math.inf:
            return start
        if self.in_node == 0:
            return self.idle_since + self.cfg.sleep_timeout
        return math.inf

    def handle(self, tau: float) -> None:
        """Process the node's event at `tau` (steps 1-4 of the contract, in order)."""
        self.accrue(tau)
        if self.phase == _BUSY:
            self.end_iteration(tau)
            self.phase, self.idle_since = _IDLE, tau
        elif self.phase == _WAKING:
            self.phase, self.idle_since = _IDLE, tau
        if self.phase == _IDLE and self.in_node == 0 and tau >= self.idle_since + self.cfg.sleep_timeout:
            self.phase = _ASLEEP
        if self.phase == _IDLE and self.start_time() <= tau:
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
        self.no_token += 1
        # the front-end latency adds to the request's TTFT and e2e: charged when it is accepted
        self.s.step_latency[self.s.step] += self.lat.frontend_s
        self.s.step_ttft[self.s.step] += self.lat.frontend_s
        self.enqueue(i)
        if self.phase == _ASLEEP:
            self.phase, self.wake_end = _WAKING, t + self.cfg.wake_delay


class _Cache:
    """A node's prefix cache: pinned chunks with their holders' count, and an LRU queue of the
    chunks no running request holds (least recently released first)."""

    def __init__(self, blocks: list[int]):
        self.blocks = blocks  # KV blocks of each chunk id on this node
        self.ref: dict[int, int] = {}
        self.free: OrderedDict[int, None] = OrderedDict()
        self.pinned = 0  # blocks of the pinned chunks
        self.cached = 0  # blocks of the unpinned cached chunks

    def present(self, u: int) -> bool:
        return u in self.ref or u in self.free

    def pin(self, u: int) -> None:
        if u in self.ref:
            self.ref[u] += 1
            return
        if u in self.free:
            del self.free[u]
            self.cached -= self.blocks[u]
        self.ref[u] = 1
        self.pinned += self.blocks[u]

    def unpin(self, u: int) -> None:
        self.ref[u] -= 1
        if self.ref[u] == 0:
            del self.ref[u]
            self.pinned -= self.blocks[u]
            self.free[u] = None
            self.cached += self.blocks[u]

    def evict(self, deficit: int) -> int:
        """Evict least recently released chunks until `deficit` blocks are free; blocks evicted."""
        evicted = 0
        while deficit > 0 and self.free:
            u, _ = self.free.popitem(last=False)
            b = self.blocks[u]
            self.cached -= b
            deficit -= b
            evicted += b
        return evicted


class _ContinuousNode(_Node):
    """vLLM/Orca-style iteration-level batching with a token budget, KV blocks, preemption and
    (optionally) automatic prefix caching."""

    def __init__(self, cfg: RefNode, s: _Stream, t0: float):
        super().__init__(cfg, s, t0)
        bs = cfg.block_size
        self.cache = _Cache([_ceil_div(c, bs) for c in s.chunk_tokens]) if cfg.prefix_caching else None
        self.waiting: deque[int] = deque()
        self.running: list[int] = []  # in admission order, oldest first
        self.sched: list[tuple[int, int]] = []  # (request, tokens) of the running iteration

    def n_waiting(self) -> int:
        return len(self.waiting)

    def enqueue(self, i: int) -> None:
        self.waiting.append(i)

    def start_time(self) -> float:
        return self.last_t if self.running or self.waiting else math.inf

    def start(self, tau: float) -> None:
        self.sched = self._plan()
        if not self.sched:  # every running request was preempted: plan again, now admitting
            self.sched = self._plan()
        if not self.sched:
            raise RuntimeError("stall: no request can be scheduled (input validation should prevent it)")
        s = self.s
        self._check_capacity(dict(self.sched))
        prefill_tokens = decode_seqs = kv_tokens = 0
        pairs = 0.0
        for i, t in self.sched:
            c = s.computed[i]
            if t == 1 and c == s.seq_len(i) - 1:
                decode_seqs += 1
                kv_tokens += c
            else:
                prefill_tokens += t
                pairs += t * (c + (t + 1) / 2)
        self.run_iteration(tau, prefill_tokens, decode_seqs, kv_tokens, pairs)

    def _private(self, i: int, tokens: int) -> int:
        """Blocks request i holds outside the cache once `tokens` of its tokens are computed."""
        pend = self.s.end_of(i, self.s.pin[i]) if self.cache is not None else 0
        return _ceil_div(max(tokens - pend, 0), self.cfg.block_size)

    def _check_capacity(self, t: dict[int, int]) -> None:
        """Physics guard: the running set's private blocks (after the planned iteration) plus the
        cached chunks never exceed the node's KV blocks."""
        used = sum(self._private(i, self.s.computed[i] + t.get(i, 0)) for i in self.running)
        if self.cache is not None:
            used += self.cache.pinned + self.cache.cached
        if used > self.cfg.kv_blocks:
            raise RuntimeError(f"KV blocks over capacity: {used} > {self.cfg.kv_blocks}")

    def _evict(self, deficit: int) -> None:
        self.evicted_blocks += self.cache.evict(deficit)

    def _plan(self) -> list[tuple[int, int]]:
        """Steps 1-3 of the contract: the (request, tokens > 0) pairs of the next iteration."""
        s, cache = self.s, self.cache
        budget = self.cfg.max_num_batched_tokens
        # 1. running requests take tokens greedily, oldest admission first
        t: dict[int, int] = {}
        left = budget
        for i in self.running:
            need = s.seq_len(i) - s.computed[i]
            t[i] = min(need, max(0, left))
            left -= need
        # 2. KV blocks: preempt the most recently admitted until the rest fit
        private = [self._private(i, s.computed[i]) for i in self.running]
        extra = [self._private(i, s.computed[i] + t[i]) - private[n] for n, i in enumerate(self.running)]
        pinned = cache.pinned if cache is not None else 0
        available = self.cfg.kv_blocks - sum(private) - pinned  # free blocks plus evictable chunks
        preempted: list[int] = []
        if sum(extra) > available:
            keep = len(self.running) - 1
            while keep > 0 and sum(extra[:keep]) > available + self._freed(keep, private):
                keep -= 1
            preempted = self.running[keep:]
            del self.running[keep:]
            for i in reversed(preempted):  # newest first, each its last chunk first
                if cache is not None:
                    for u in reversed(s.chunks[i][0][: s.pin[i]]):
                        cache.unpin(u)
                s.pin[i] = 0
                s.computed[i] = 0
                s.preemptions[i] += 1
            self.waiting.extendleft(reversed(preempted))  # earliest-admitted first at the head
        if cache is not None:
            # chunks the running requests complete in this iteration are cached now; evict for growth
            grown = 0
            for i in self.running:
                new_pin = max(s.pin[i], s.covered(i, s.computed[i] + t[i]))
                for u in s.chunks[i][0][s.pin[i] : new_pin]:
                    cache.pin(u)
                s.pin[i] = new_pin
                grown += self._private(i, s.computed[i] + t[i])
            self._evict(grown + cache.pinned + cache.cached - self.cfg.kv_blocks)
        sched = [(i, t[i]) for i in self.running]
        # 3. admission, only when nothing was preempted
        if not preempted:
            left = budget - sum(t.values())
            if cache is None:
                self._admit_fcfs(sched, left, available - sum(extra))
            else:
                self._admit_cached(sched, left, grown)
        return [(i, n) for i, n in sched if n > 0]

    def _freed(self, keep: int, private: list[int]) -> int:
        """Blocks that preempting the running requests after the first `keep` would free or make
        evictable: their private blocks and the chunks no kept request pins."""
        freed = sum(private[keep:])
        if self.cache is not None:
            s = self.s
            kept = {u for i in self.running[:keep] for u in s.chunks[i][0][: s.pin[i]]}
            gone = {u for i in self.running[keep:] for u in s.chunks[i][0][: s.pin[i]]} - kept
            freed += sum(self.cache.blocks[u] for u in gone)
        return freed

    def _admit_fcfs(self, sched: list[tuple[int, int]], left: int, free: int) -> None:
        """Admission without a cache: FCFS with head-of-line blocking."""
        s, bs = self.s, self.cfg.block_size
        while self.waiting and len(self.running) < self.cfg.max_num_seqs:
            i = self.waiting[0]
            tw = min(s.seq_len(i), left)
            blocks = _ceil_div(tw, bs)
            if tw <= 0 or blocks > free:
                break
            self.waiting.popleft()
            free -= blocks
            left -= tw
            self.running.append(i)
            sched.append((i, tw))
            if s.hit[i] < 0:
                s.hit[i] = 0

    def _admit_cached(self, sched: list[tuple[int, int]], left: int, private: int) -> None:
        """Admission with the prefix cache, one request at a time in queue order (vLLM V1)."""
        s, bs, cache = self.s, self.cfg.block_size, self.cache
        while self.waiting:
            i = self.waiting[0]
            ids, ends = s.chunks[i]
            h = 0
            while h < len(ids) and cache.present(ids[h]):
                h += 1
            seq = s.seq_len(i)
            hit = min(s.end_of(i, h), bs * ((seq - 1) // bs))  # at least one token is computed
            t = max(0, min(seq - hit, left))
            done = hit + t
            new_pin = max(h, s.covered(i, done))
            own = _ceil_div(max(done - s.end_of(i, new_pin), 0), bs)
            claim = sum(cache.blocks[u] for u in ids[:h] if u not in cache.ref)
            fresh = sum(cache.blocks[u] for u in ids[h:new_pin] if not cache.present(u))
            available = self.cfg.kv_blocks - private - cache.pinned
            if t <= 0 or own + fresh + claim > available or len(self.running) >= self.cfg.max_num_seqs:
                break
            self.waiting.popleft()
            for u in ids[:new_pin]:
                cache.pin(u)
            private += own
            self._evict(private + cache.pinned + cache.cached - self.cfg.kv_blocks)
            s.computed[i] = hit
            s.pin[i] = new_pin
            if s.hit[i] < 0:
                s.hit[i] = hit
            self.saved_tokens += hit
            left -= t
            self.running.append(i)
            sched.append((i, t))

    def end_iteration(self, tau: float) -> None:
        s = self.s
        finished = set()
        for i, t in self.sched:
            s.computed[i] += t
            if s.computed[i] == s.seq_len(i) and self.emit(i, tau):
                finished.add(i)
        for i in (j for j in self.running if j in finished):  # admission order, each last chunk first
            if self.cache is not None:
                for u in reversed(s.chunks[i][0][: s.pin[i]]):
                    self.cache.unpin(u)
            s.pin[i] = 0
        self.running = [i for i in self.running if i not in finished]
        self.sched = []


class _DynamicNode(_Node):
    """Triton-style dynamic batcher: one static batch in flight, launched when full or timed out."""

    def __init__(self, cfg: RefNode, s: _Stream, t0: float):
        super().__init__(cfg, s, t0)
        self.waiting: deque[int] = deque()
        self.batch: list[int] = []  # members of the batch in flight (finished ones included)
        self.longest = 0  # the batch's longest prompt

    def n_waiting(self) -> int:
        return len(self.waiting)

    def enqueue(self, i: int) -> None:
        self.waiting.append(i)

    def _open(self) -> list[int]:
        """Unfinished members of the batch in flight."""
        s = self.s
        return [i for i in self.batch if s.generated[i] < s.output[i]]

    def start_time(self) -> float:
        if self._open() or len(self.waiting) >= self.cfg.max_batch_size:
            return self.last_t
        if self.waiting:
            return max(self.last_t, self.s.arrival[self.waiting[0]] + self.cfg.max_queue_delay)
        return math.inf

    def start(self, tau: float) -> None:
        s = self.s
        rows = self._open()
        if rows:  # a decode iteration of the batch in flight
            if self.cfg.padding:  # every row over the padded context, finished members included
                n = len(self.batch)
                kv = n * (self.longest + s.generated[rows[0]] - 1)
                self.run_iteration(tau, 0, n, kv, 0.0)
            else:
                kv = sum(s.seq_len(i) - 1 for i in rows)
                self.run_iteration(tau, 0, len(rows), kv, 0.0)
            return
        self.batch = [self.waiting.popleft() for _ in range(min(len(self.waiting), self.cfg.max_batch_size))]
        for i in self.batch:
            if s.hit[i] < 0:
                s.hit[i] = 0
        prompts = [s.prompt[i] for i in self.batch]
        self.longest = max(prompts)
        # a one-token prompt is classified as decoding (0 KV tokens), as in continuous step 4
        if self.cfg.padding:
            n, p = len(prompts), self.longest
            if p <= 1:
                self.run_iteration(tau, 0, n, 0, 0.0)
            else:
                self.run_iteration(tau, n * p, 0, 0, n * p * (p + 1) / 2)
        else:
            big = [p for p in prompts if p > 1]
            self.run_iteration(tau, sum(big), len(prompts) - len(big), 0, sum(p * (p + 1) / 2 for p in big))

    def end_iteration(self, tau: float) -> None:
        for i in self._open():
            self.s.computed[i] = self.s.seq_len(i)
            self.emit(i, tau)


def _alone(cfg: RefNode, prompt: int, output: int) -> tuple[float, float]:
    """(TTFT, e2e) of one request alone on an idle node with an empty cache and no batching window."""
    lone = dataclasses.replace(
        cfg, max_queue_delay=0.0, sleep_timeout=math.inf, prefix_caching=False, queue_capacity=1
    )
    s = _Stream([0.0], [prompt], [output], [([], [])], [])
    node = _ContinuousNode(lone, s, 0.0) if cfg.scheduler == "continuous" else _DynamicNode(lone, s, 0.0)
    node.arrive(0, 0.0)
    node.drain()
    return s.first_token[0], s.finish[0]


def _validate_options(
    objective: str, reward: str, end: str, t_cut: float | None, arrival: np.ndarray
) -> None:
    """Raise ValueError naming the episode option the contract excludes."""
    for name, value, valid in (
        ("objective", objective, _OBJECTIVES),
        ("reward", reward, _REWARDS),
        ("end", end, _ENDS),
    ):
        if value not in valid:
            raise ValueError(f"{name} must be one of {valid}, got {value!r}")
    if end == "cut":
        if t_cut is None or not math.isfinite(t_cut) or t_cut < arrival[-1]:
            raise ValueError(f"t_cut must be a finite time >= the last arrival with end='cut', got {t_cut!r}")


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
        if _ceil_div(longest, cfg.block_size) > cfg.kv_blocks:
            raise ValueError(
                f"kv_blocks of node {n} ({cfg.kv_blocks}) cannot hold a request of {longest} tokens "
                f"routed to it: the node would stall"
            )


def _chunks(
    nodes: Sequence[RefNode],
    e: int,
    chunk_ids: ArrayLike | None,
    id_tokens: ArrayLike | None,
    chunk_tokens: ArrayLike | None,
    grain: int,
) -> tuple[list[tuple[list[int], list[int]]], list[int]]:
    """Each request's leading chunks (ids, token ends) and each chunk id's tokens, validated."""
    given = [x is not None for x in (chunk_ids, id_tokens, chunk_tokens)]
    if any(given) and not all(given):
        raise ValueError("chunk_ids, id_tokens and chunk_tokens must be given together")
    if not all(given):
        return [([], []) for _ in range(e)], []
    ids = np.asarray(chunk_ids)
    tok = np.asarray(id_tokens)
    lengths = np.asarray(chunk_tokens)
    if ids.ndim != 2 or ids.shape[0] != e:
        raise ValueError(f"chunk_ids must have shape [{e}, B], got {ids.shape}")
    if tok.shape != (e,):
        raise ValueError(f"id_tokens must have shape [{e}], got {tok.shape}")
    if lengths.ndim != 1:
        raise ValueError(f"chunk_tokens must be one-dimensional, got shape {lengths.shape}")
    if not (isinstance(grain, (int, np.integer)) and grain >= 1):
        raise ValueError(f"grain must be a positive integer, got {grain!r}")
    for n, cfg in enumerate(nodes):
        if cfg.prefix_caching and grain % cfg.block_size:
            raise ValueError(
                f"grain ({grain}) must be a multiple of node {n}'s block_size ({cfg.block_size})"
            )
    if ((ids < -1) | (ids >= len(lengths))).any():
        raise ValueError(f"chunk_ids must lie in [-1, {len(lengths)})")
    out = []
    for i in range(e):
        used = [j for j in range(ids.shape[1]) if j * grain < tok[i]]
        valid = [int(ids[i, j]) for j in used if ids[i, j] >= 0]
        if valid != [int(ids[i, j]) for j in used[: len(valid)]]:
            raise ValueError(f"chunk_ids[{i}] has a -1 before a chunk id: ids must lead, -1 pads")
        ends = [min((j + 1) * grain, int(tok[i])) for j in range(len(valid))]
        for j, u in enumerate(valid):
            if lengths[u] != ends[j] - j * grain:
                raise ValueError(
                    f"chunk_tokens[{u}] = {lengths[u]}, but chunk {j} of request {i} has "
                    f"{ends[j] - j * grain} tokens"
                )
        out.append((valid, ends))
    return out, [int(x) for x in lengths]


def simulate(
    nodes: Sequence[RefNode],
    arrival: ArrayLike,
    prompt: ArrayLike,
    output: ArrayLike,
    actions: ArrayLike,
    *,
    chunk_ids: ArrayLike | None = None,
    id_tokens: ArrayLike | None = None,
    chunk_tokens: ArrayLike | None = None,
    grain: int = 512,
    objective: str = "latency",
    reward: str = "accrual",
    end: str = "drain",
    t_cut: float | None = None,
    drop_penalty: float = 0.0,
    energy_weight: float = 0.0,
    ttft_weight: float = 0.0,
    ttft_slo: float = math.inf,
    tpot_slo: float = math.inf,
) -> RefResult:
    """Run one episode: route request `k` to node `actions[k]` at `arrival[k]`, then drain or cut.

    :param nodes: the cluster, one `RefNode` per node.
    :param arrival: [E] arrival times, non-decreasing.
    :param prompt: [E] prompt tokens, >= 1.
    :param output: [E] output tokens, >= 1.
    :param actions: [E] node index for each request.
    :param chunk_ids: [E, B] prefix-chunk ids of each request's sequence, -1 pads (`Requests`).
    :param id_tokens: [E] tokens of each sequence the chunk ids cover.
    :param chunk_tokens: [U] tokens of each chunk id.
    :param grain: tokens per chunk (`EnvConfig.chunk_tokens`).
    :param objective: "latency", "excess" or "slo".
    :param reward: "accrual" (latency credited as it accrues) or "finish" (when a request finishes).
    :param end: "drain" (serve every accepted request) or "cut" (stop at `t_cut`).
    :param t_cut: the end of the last step with `end="cut"` (the next arrival of the stream).
    :param drop_penalty: objective cost of one drop (seconds of latency).
    :param energy_weight: objective cost per joule (seconds per J).
    :param ttft_weight: weight of TTFT added to the latency objectives.
    :param ttft_slo: TTFT target in seconds.
    :param tpot_slo: TPOT target in seconds per output token.
    """
    arrival_a = np.asarray(arrival, dtype=np.float64)
    prompt_a, output_a, actions_a = (np.asarray(x) for x in (prompt, output, actions))
    _validate(nodes, arrival_a, prompt_a, output_a, actions_a)
    _validate_options(objective, reward, end, t_cut, arrival_a)
    e = len(arrival_a)
    chunks, lengths = _chunks(nodes, e, chunk_ids, id_tokens, chunk_tokens, grain)
    p_list, o_list = prompt_a.astype(np.int64).tolist(), output_a.astype(np.int64).tolist()
    s = _Stream(arrival_a.tolist(), p_list, o_list, chunks, lengths)
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
            until = s.arrival[k + 1]
        else:
            until = s.arrival[k] if end == "drain" else float(t_cut)
        for nd in sim:
            nd.advance(until)
    t_end = until
    if end == "drain":
        for nd in sim:
            nd.drain()
        t_end = max(nd.last_t for nd in sim)
        for nd in sim:
            nd.advance(t_end)  # sleep transitions up to t_end, energy to t_end
    service = np.full((2, e), np.nan)
    if objective == "excess":
        for k in range(e):
            times = np.asarray([_alone(c, p_list[k], o_list[k]) for c in nodes])
            service[:, k] = times.min(axis=0)
    opts = dict(
        objective=objective,
        reward=reward,
        drop_penalty=drop_penalty,
        energy_weight=energy_weight,
        ttft_weight=ttft_weight,
        ttft_slo=ttft_slo,
        tpot_slo=tpot_slo,
    )
    return _result(s, sim, np.asarray(route), np.asarray(dropped), t_end, service, **opts)


def _result(
    s: _Stream,
    sim: list[_Node],
    route: np.ndarray,
    dropped: np.ndarray,
    t_end: float,
    service: np.ndarray,
    *,
    objective: str,
    reward: str,
    drop_penalty: float,
    energy_weight: float,
    ttft_weight: float,
    ttft_slo: float,
    tpot_slo: float,
) -> RefResult:
    """Assemble the per-request log, the per-step objective and its sum."""
    arrival = np.asarray(s.arrival)
    output = np.asarray(s.output)
    finish = np.asarray(s.finish)
    done = np.isfinite(finish)
    first = np.where(done, np.asarray(s.first_token), np.nan)
    ttft = first - arrival
    e2e = finish - arrival
    with np.errstate(invalid="ignore", divide="ignore"):
        tpot = np.where(output > 1, (finish - first) / np.maximum(output - 1, 1), 0.0)
    tpot[~done] = np.nan
    slo_met = done & (ttft <= ttft_slo) & (tpot <= tpot_slo)
    e = len(arrival)
    step = np.asarray(s.finish_step)
    energy = energy_weight * np.asarray(s.step_energy)
    drops = drop_penalty * dropped
    finished = np.zeros(e)
    if objective == "slo":
        np.add.at(finished, step[slo_met], -1.0)
    else:
        cost = e2e + ttft_weight * ttft
        if objective == "excess":
            cost = cost - service[1] - ttft_weight * service[0]
        np.add.at(finished, step[done], cost[done])
    if objective == "slo" or reward == "finish":
        step_cost = finished + drops + energy
    else:
        step_cost = np.asarray(s.step_latency) + ttft_weight * np.asarray(s.step_ttft) + drops + energy
        if objective == "excess":
            step_cost = step_cost - np.where(dropped, 0.0, service[1] + ttft_weight * service[0])
    hit = np.asarray(s.hit, dtype=np.int64)
    return RefResult(
        node=route,
        dropped=dropped,
        first_token_time=first,
        finish_time=finish,
        ttft=ttft,
        e2e_latency=e2e,
        tpot=tpot,
        preemptions=np.asarray(s.preemptions, dtype=np.int64),
        hit_tokens=np.where(dropped, -1, hit),
        slo_met=slo_met,
        service_ttft=service[0],
        service_e2e=service[1],
        energy_j=np.asarray([nd.energy for nd in sim]),
        busy_s=np.asarray([nd.busy for nd in sim]),
        prefill_tokens=np.asarray([nd.prefill_tokens for nd in sim], dtype=np.int64),
        saved_tokens=np.asarray([nd.saved_tokens for nd in sim], dtype=np.int64),
        evicted_blocks=np.asarray([nd.evicted_blocks for nd in sim], dtype=np.int64),
        t_end=t_end,
        total_preemptions=int(sum(s.preemptions)),
        step_cost=step_cost,
        objective=float(step_cost.sum()),
        goodput=int(slo_met.sum()),
    )


def nodes_from_params(cfg: EnvConfig, params: EnvParams) -> list[RefNode]:
    """`RefNode`s with the values of a JAX `EnvConfig` and `EnvParams` (reads parameters only, no
    simulation code)."""
    p = params.nodes
    n = len(np.asarray(p.speed))

    def at(x, i):
        return np.asarray(x)[i].item()

    return [
        RefNode(
            scheduler=cfg.scheduler,
            latency=LatencyModel(*(float(at(f, i)) for f in p.latency)),
            power=PowerModel(*(float(at(f, i)) for f in p.power)),
            speed=float(at(p.speed, i)),
            max_num_seqs=int(at(p.max_num_seqs, i)),
            max_num_batched_tokens=int(at(p.max_num_batched_tokens, i)),
            block_size=int(at(p.block_size, i)),
            kv_blocks=int(at(p.kv_blocks, i)),
            max_batch_size=int(at(p.max_batch_size, i)),
            max_queue_delay=float(at(p.max_queue_delay, i)),
            queue_capacity=int(at(p.queue_capacity, i)),
            sleep_power_w=float(at(p.sleep_power_w, i)),
            sleep_timeout=float(at(p.sleep_timeout, i)),
            wake_delay=float(at(p.wake_delay, i)),
            prefix_caching=bool(cfg.prefix_caching),
            padding=bool(cfg.padding),
        )
        for i in range(n)
    ]
