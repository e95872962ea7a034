"""Workloads: the stream of requests an episode replays (arrival times, prompt and output lengths).

A `Workload` is composed of small parts, Jumanji-style: an arrival process (`PoissonArrivals`,
`GammaArrivals`, `MMPPArrivals`, `DiurnalArrivals`, `TraceReplay`) and a length distribution for
prompts and for outputs (`LogNormalLengths`, `ZipfLengths`, `EmpiricalLengths`, or the trace's own
pairs). Every part is a frozen, hashable dataclass, so a workload can be a static argument of
`jax.jit`; `sample(key, n)` is pure and vmaps over `key`. No part loops over requests in Python.

Every arrival process returns times with ``arrival[0] == 0`` (the episode starts with a request),
and ``mean_rate`` is the long-run arrivals per second, exactly; ``with_rate`` changes it and keeps
every timescale given in seconds (on/off durations, the diurnal period). Sources and reasons for
each part are in docs/workloads.md.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
from dataclasses import dataclass, field
from functools import cached_property
from typing import NamedTuple, Protocol

import jax
import jax.numpy as jnp
import numpy as np

from burstgym.traces import Trace


class Requests(NamedTuple):
    """One episode's request stream, in arrival order."""

    arrival: jax.Array  # [E] float, seconds, non-decreasing, arrival[0] == 0
    prompt: jax.Array  # [E] int32 >= 1, prompt tokens (visible to the router)
    output: jax.Array  # [E] int32 >= 1, output tokens (hidden from the router)


class ArrivalProcess(Protocol):
    """A point process of request arrivals."""

    @property
    def mean_rate(self) -> float: ...

    def with_rate(self, rate: float) -> ArrivalProcess: ...

    def sample(self, key: jax.Array, n: int) -> jax.Array: ...


class LengthDistribution(Protocol):
    """A distribution of token counts (integers >= 1)."""

    @property
    def mean(self) -> float: ...

    def sample(self, key: jax.Array, n: int) -> jax.Array: ...


def _float() -> jnp.dtype:
    """JAX's default float dtype (float32, or float64 under x64)."""
    return jnp.result_type(float)


def _times_from_gaps(gaps: jax.Array) -> jax.Array:
    """Arrival times from the n-1 gaps between n arrivals; the first arrival is at 0.

    `cummax` guards the non-decreasing contract against any reordering of float additions.
    """
    times = jnp.concatenate([jnp.zeros((1,), gaps.dtype), jnp.cumsum(gaps)])
    return jax.lax.cummax(times)


def _gamma(key: jax.Array, shape: float, n: int) -> jax.Array:
    """[n] Gamma(shape, scale 1) draws by Marsaglia and Tsang's method.

    Rejected draws are redrawn, all at once, in a while loop (about 5% per round); this compiles
    several times faster than `jax.random.gamma`, whose cost otherwise dominates `reset`'s
    compile. For shape < 1 it boosts: Gamma(a) = Gamma(a + 1) U^(1/a), in log space.
    """
    a = shape + 1.0 if shape < 1.0 else shape
    d = a - 1.0 / 3.0
    c = 1.0 / math.sqrt(9.0 * d)

    def draw(key: jax.Array) -> tuple[jax.Array, jax.Array]:
        k_normal, k_uniform = jax.random.split(key)
        z = jax.random.normal(k_normal, (n,), _float())
        u = jax.random.uniform(k_uniform, (n,), _float())
        v = (1.0 + c * z) ** 3
        safe_v = jnp.where(v > 0, v, 1.0)
        ok = (v > 0) & (jnp.log(u) < 0.5 * z**2 + d - d * safe_v + d * jnp.log(safe_v))
        return d * safe_v, ok

    def redraw(state: tuple[jax.Array, jax.Array, jax.Array]) -> tuple[jax.Array, jax.Array, jax.Array]:
        key, x, done = state
        key, sub = jax.random.split(key)
        y, ok = draw(sub)
        return key, jnp.where(done, x, y), done | ok

    k_first, k_loop, k_boost = jax.random.split(key, 3)
    x, done = draw(k_first)
    _, x, _ = jax.lax.while_loop(lambda state: ~jnp.all(state[2]), redraw, (k_loop, x, done))
    if shape < 1.0:
        log_u = jnp.log(jax.random.uniform(k_boost, (n,), _float(), minval=jnp.finfo(_float()).tiny))
        x = jnp.exp(jnp.log(x) + log_u / shape)
    return x


def _check_positive(**values: float) -> None:
    for name, value in values.items():
        if not value > 0:
            raise ValueError(f"{name} must be > 0, got {value}")


# --------------------------------------------------------------------------- arrival processes


@dataclass(frozen=True)
class PoissonArrivals:
    """Poisson arrivals (exponential gaps): the memoryless baseline, cv of gaps = 1."""

    rate: float  # arrivals per second

    def __post_init__(self) -> None:
        _check_positive(rate=self.rate)

    @property
    def mean_rate(self) -> float:
        return float(self.rate)

    def with_rate(self, rate: float) -> PoissonArrivals:
        return dataclasses.replace(self, rate=rate)

    def sample(self, key: jax.Array, n: int) -> jax.Array:
        """[n] arrival times (seconds), starting at 0."""
        return _times_from_gaps(jax.random.exponential(key, (n - 1,), _float()) / self.rate)


@dataclass(frozen=True)
class GammaArrivals:
    """Renewal arrivals with Gamma gaps of a given coefficient of variation.

    BurstGPT (Wang et al., 2024) fits Gamma inter-arrival times to real LLM traffic; cv > 1 is
    bursty (clustered arrivals separated by long silences), cv = 1 is Poisson, cv < 1 is regular.
    """

    rate: float  # arrivals per second
    cv: float = 1.0  # std / mean of the gaps

    def __post_init__(self) -> None:
        _check_positive(rate=self.rate, cv=self.cv)

    @property
    def mean_rate(self) -> float:
        return float(self.rate)

    def with_rate(self, rate: float) -> GammaArrivals:
        return dataclasses.replace(self, rate=rate)

    def sample(self, key: jax.Array, n: int) -> jax.Array:
        """[n] arrival times (seconds), starting at 0."""
        shape = 1.0 / self.cv**2
        gaps = _gamma(key, shape, n - 1) / (shape * self.rate)
        return _times_from_gaps(gaps)


@dataclass(frozen=True)
class MMPPArrivals:
    """Two-state on/off Markov-modulated Poisson process, the classic model of traffic bursts.

    The source alternates between "on" and "off" periods with exponential durations of means
    `mean_on` and `mean_off` seconds; arrivals are Poisson at `rate_on` during on periods and at
    ``rate_off = rate_on / burst_ratio`` during off periods (0 when `burst_ratio` is infinite).
    `rate_on` is set so the long-run mean is exactly `rate`. Each episode starts in the
    stationary state (on with probability mean_on / (mean_on + mean_off)).
    """

    rate: float  # long-run mean arrivals per second
    burst_ratio: float = math.inf  # rate_on / rate_off, >= 1
    mean_on: float = 1.0  # mean on-period duration, seconds
    mean_off: float = 1.0  # mean off-period duration, seconds

    def __post_init__(self) -> None:
        _check_positive(rate=self.rate, mean_on=self.mean_on, mean_off=self.mean_off)
        if not self.burst_ratio >= 1:
            raise ValueError(f"burst_ratio must be >= 1, got {self.burst_ratio}")

    @property
    def mean_rate(self) -> float:
        return float(self.rate)

    @property
    def rate_on(self) -> float:
        """Arrival rate during on periods."""
        return self.rate * (self.mean_on + self.mean_off) / (self.mean_on + self.mean_off / self.burst_ratio)

    @property
    def rate_off(self) -> float:
        """Arrival rate during off periods."""
        return self.rate_on / self.burst_ratio

    def with_rate(self, rate: float) -> MMPPArrivals:
        return dataclasses.replace(self, rate=rate)

    def _num_cycles(self, n: int) -> int:
        """On/off cycles drawn so that they hold n arrivals except with negligible probability.

        Per cycle the integrated rate has mean `rate * cycle` and variance
        ``(rate_on mean_on)^2 + (rate_off mean_off)^2`` (exponential durations); the unit-rate
        target of the n-th arrival has mean and variance n. We take 8 standard deviations and
        round up to a power of two, so that nearby parameters share compiled shapes.
        """
        per_cycle = self.rate * (self.mean_on + self.mean_off)
        var_cycle = (self.rate_on * self.mean_on) ** 2 + (self.rate_off * self.mean_off) ** 2
        cycles = n / per_cycle
        needed = math.ceil(cycles + 8.0 * math.sqrt(n + cycles * var_cycle + 1.0) / per_cycle) + 2
        return 1 << (needed - 1).bit_length()

    def sample(self, key: jax.Array, n: int) -> jax.Array:
        """[n] arrival times (seconds), starting at 0, by time rescaling.

        Arrivals of a unit-rate Poisson process are mapped through the inverse of the
        integrated (piecewise-constant) rate of a drawn on/off path: vectorised, no loop.
        """
        k_state, k_len, k_unit = jax.random.split(key, 3)
        segments = 2 * self._num_cycles(n)
        p_on = self.mean_on / (self.mean_on + self.mean_off)
        starts_on = jax.random.bernoulli(k_state, p_on)
        on = (jnp.arange(segments) % 2 == 0) == starts_on
        mean_len = jnp.where(on, self.mean_on, self.mean_off)
        seg_rate = jnp.where(on, self.rate_on, self.rate_off).astype(_float())
        seg_len = jax.random.exponential(k_len, (segments,), _float()) * mean_len
        # A last segment of unbounded length at the mean rate: only reached if the drawn path
        # holds fewer than n arrivals, which `_num_cycles` makes negligibly rare.
        seg_rate = jnp.append(seg_rate, self.rate)
        seg_start = jnp.concatenate([jnp.zeros((1,), seg_len.dtype), jnp.cumsum(seg_len)])
        mass_start = jnp.concatenate([jnp.zeros((1,), seg_len.dtype), jnp.cumsum(seg_len * seg_rate[:-1])])
        unit = jnp.cumsum(jax.random.exponential(k_unit, (n,), _float()))
        # The last segment with mass_start <= target; zero-rate segments have zero mass, so the
        # segment after them, which starts at the same mass, is chosen instead.
        seg = jnp.searchsorted(mass_start, unit, side="right") - 1
        rate = seg_rate[seg]
        times = seg_start[seg] + (unit - mass_start[seg]) / jnp.where(rate > 0, rate, 1.0)
        return jax.lax.cummax(times - times[0])


@dataclass(frozen=True)
class DiurnalArrivals:
    """A base process whose rate swings: rate(t) = r (1 + amplitude sin(2 pi t / period + phase)).

    The base process is run in operational time and mapped to real time by the inverse of
    ``Lambda(t) = integral of (1 + amplitude sin(...))`` (time rescaling), so with a Poisson base
    this is exactly the non-homogeneous Poisson process; with a Gamma or MMPP base the bursts ride
    on the slow cycle. Real services show daily cycles (Splitwise, BurstGPT). The phase is drawn
    uniformly per episode unless given, so episodes see different parts of the cycle.
    """

    base: ArrivalProcess
    amplitude: float = 0.5  # in [0, 1]
    period: float = 86400.0  # seconds
    phase: float | None = None  # radians; None: uniform per episode

    def __post_init__(self) -> None:
        _check_positive(period=self.period)
        if not 0 <= self.amplitude <= 1:
            raise ValueError(f"amplitude must be in [0, 1], got {self.amplitude}")

    @property
    def mean_rate(self) -> float:
        """Long-run mean (over whole periods): the base rate."""
        return self.base.mean_rate

    def with_rate(self, rate: float) -> DiurnalArrivals:
        return dataclasses.replace(self, base=self.base.with_rate(rate))

    def sample(self, key: jax.Array, n: int) -> jax.Array:
        """[n] arrival times (seconds), starting at 0."""
        k_base, k_phase = jax.random.split(key)
        target = self.base.sample(k_base, n)
        if self.phase is None:
            phase = jax.random.uniform(k_phase, (), _float(), 0.0, 2.0 * math.pi)
        else:
            phase = jnp.asarray(self.phase, _float())
        omega = 2.0 * math.pi / self.period
        swing = self.amplitude / omega  # |Lambda(t) - t| <= 2 * swing

        def integrated(t: jax.Array) -> jax.Array:
            return t + swing * (jnp.cos(phase) - jnp.cos(omega * t + phase))

        # Bisection: Lambda is non-decreasing (amplitude <= 1), and the root lies within 2 * swing
        # of the target. 64 halvings reach float precision for any period.
        def halve(_: int, bounds: tuple[jax.Array, jax.Array]) -> tuple[jax.Array, jax.Array]:
            lo, hi = bounds
            mid = 0.5 * (lo + hi)
            below = integrated(mid) < target
            return jnp.where(below, mid, lo), jnp.where(below, hi, mid)

        lo = jnp.maximum(target - 2.0 * swing, 0.0)
        lo, hi = jax.lax.fori_loop(0, 64, halve, (lo, target + 2.0 * swing))
        times = 0.5 * (lo + hi)
        return jax.lax.cummax(times - times[0])


def _digest(*arrays: np.ndarray) -> str:
    """Content digest of numpy arrays, so dataclasses that hold them hash and compare by value."""
    h = hashlib.sha256()
    for a in arrays:
        a = np.ascontiguousarray(a)
        h.update(str((a.dtype, a.shape)).encode())
        h.update(a.tobytes())
    return h.hexdigest()


@dataclass(frozen=True)
class TraceReplay:
    """Replay of a real trace: a random window of consecutive requests per episode.

    Each episode starts at a request index drawn uniformly and replays the following requests'
    inter-arrival gaps, divided by ``rate / native rate`` (time scaling keeps the trace's shape of
    burstiness). Past the end it wraps around to the start, with one mean gap between the last and
    the first request, so the long-run rate is exactly the trace's ``(N - 1) / duration``.
    Used as the arrivals of a `Workload` whose `prompt`/`output` are None, it also supplies the
    lengths of the same window (pairs kept). Hashes by content digest; the trace becomes a
    constant of the compiled program.
    """

    trace: Trace = field(compare=False, repr=False)
    rate: float | None = None  # mean arrivals per second; None: the trace's own rate
    digest: str = field(init=False)

    def __post_init__(self) -> None:
        arrival, prompt, output = (np.asarray(a) for a in self.trace)
        if not (arrival.ndim == 1 and arrival.shape == prompt.shape == output.shape):
            raise ValueError("trace arrays must be 1-D and of equal length")
        if arrival.size < 2 or not arrival[-1] > arrival[0]:
            raise ValueError("a trace needs at least two requests spanning a positive duration")
        if np.any(np.diff(arrival) < 0):
            raise ValueError("trace arrival times must be non-decreasing")
        if prompt.min() < 1 or output.min() < 1:
            raise ValueError("trace prompt and output lengths must be >= 1")
        if self.rate is not None:
            _check_positive(rate=self.rate)
        trace = Trace(arrival.astype(np.float64), prompt.astype(np.int32), output.astype(np.int32))
        object.__setattr__(self, "trace", trace)
        object.__setattr__(self, "digest", _digest(*trace))

    @property
    def native_rate(self) -> float:
        """The trace's own mean arrivals per second, (N - 1) / duration."""
        arrival = self.trace.arrival
        return (arrival.size - 1) / float(arrival[-1] - arrival[0])

    @property
    def mean_rate(self) -> float:
        return self.native_rate if self.rate is None else float(self.rate)

    def with_rate(self, rate: float) -> TraceReplay:
        return dataclasses.replace(self, rate=rate)

    def window(self, key: jax.Array, n: int) -> jax.Array:
        """[n] trace row indices of the episode's window (wrapping around)."""
        size = self.trace.arrival.size
        start = jax.random.randint(key, (), 0, size)
        return (start + jnp.arange(n)) % size

    def sample(self, key: jax.Array, n: int) -> jax.Array:
        """[n] arrival times (seconds), starting at 0: the window's scaled gaps."""
        arrival = self.trace.arrival
        gaps = np.append(np.diff(arrival), (arrival[-1] - arrival[0]) / (arrival.size - 1))
        gaps = jnp.asarray(gaps * (self.native_rate / self.mean_rate), _float())
        return _times_from_gaps(gaps[self.window(key, n)[:-1]])


# --------------------------------------------------------------------------- length distributions


@dataclass(frozen=True)
class LogNormalLengths:
    """Log-normal token counts, rounded and clipped to [min_tokens, max_tokens].

    Prompt and output lengths of chat and code services are close to log-normal over most of their
    range (Splitwise's Azure traces); `median` and `sigma` (of the log) set its centre and spread.
    """

    median: float
    sigma: float
    max_tokens: int
    min_tokens: int = 1

    def __post_init__(self) -> None:
        _check_positive(median=self.median, sigma=self.sigma)
        if not 1 <= self.min_tokens <= self.max_tokens:
            raise ValueError(f"need 1 <= min_tokens <= max_tokens, got {self.min_tokens}, {self.max_tokens}")

    @cached_property
    def mean(self) -> float:
        """Exact mean of the rounded, clipped distribution: min + sum over k of P(Y > k)."""
        k = np.arange(self.min_tokens, self.max_tokens) + 0.5  # Y > k  <=>  X >= k + 0.5
        z = (np.log(k) - math.log(self.median)) / (self.sigma * math.sqrt(2.0))
        survival = 0.5 * (1.0 - np.vectorize(math.erf, otypes=[float])(z))
        return float(self.min_tokens + survival.sum())

    def sample(self, key: jax.Array, n: int) -> jax.Array:
        """[n] int32 token counts."""
        x = self.median * jnp.exp(self.sigma * jax.random.normal(key, (n,), _float()))
        return jnp.clip(jnp.round(x), self.min_tokens, self.max_tokens).astype(jnp.int32)


@dataclass(frozen=True)
class ZipfLengths:
    """Bounded Zipf token counts: P(k) proportional to k^-exponent on [min_tokens, max_tokens].

    BurstGPT (Wang et al., 2024) fits Zipf distributions to request (prompt) lengths.
    Sampled by inverting the tabulated CDF.
    """

    exponent: float
    max_tokens: int
    min_tokens: int = 1

    def __post_init__(self) -> None:
        _check_positive(exponent=self.exponent)
        if not 1 <= self.min_tokens <= self.max_tokens:
            raise ValueError(f"need 1 <= min_tokens <= max_tokens, got {self.min_tokens}, {self.max_tokens}")

    @cached_property
    def _pmf(self) -> np.ndarray:
        weights = np.arange(self.min_tokens, self.max_tokens + 1, dtype=np.float64) ** -self.exponent
        return weights / weights.sum()

    @cached_property
    def mean(self) -> float:
        return float(np.dot(self._pmf, np.arange(self.min_tokens, self.max_tokens + 1)))

    def sample(self, key: jax.Array, n: int) -> jax.Array:
        """[n] int32 token counts."""
        cdf = jnp.asarray(np.cumsum(self._pmf)[:-1], _float())
        u = jax.random.uniform(key, (n,), _float())
        return (self.min_tokens + jnp.searchsorted(cdf, u, side="right")).astype(jnp.int32)


@dataclass(frozen=True)
class EmpiricalLengths:
    """Token counts drawn uniformly from given values (e.g. one column of a trace)."""

    values: tuple[int, ...]

    def __post_init__(self) -> None:
        values = tuple(int(v) for v in np.asarray(self.values).ravel())
        if not values or min(values) < 1:
            raise ValueError("EmpiricalLengths needs at least one value, all >= 1")
        object.__setattr__(self, "values", values)

    @property
    def mean(self) -> float:
        return float(np.mean(self.values))

    def sample(self, key: jax.Array, n: int) -> jax.Array:
        """[n] int32 token counts."""
        table = jnp.asarray(self.values, jnp.int32)
        return table[jax.random.randint(key, (n,), 0, table.size)]


# --------------------------------------------------------------------------- the workload


@dataclass(frozen=True)
class Workload:
    """Arrivals plus prompt and output lengths: what `reset` draws for an episode.

    Prompt and output lengths are drawn independently from their distributions. A length left as
    None is taken from the trace of a `TraceReplay` arrival process, from the same rows as the
    arrivals, so a trace's (arrival, prompt, output) triples are replayed together.
    """

    arrivals: ArrivalProcess
    prompt: LengthDistribution | None = None
    output: LengthDistribution | None = None

    def __post_init__(self) -> None:
        if (self.prompt is None or self.output is None) and not isinstance(self.arrivals, TraceReplay):
            raise ValueError("prompt and output lengths may be None only when arrivals is a TraceReplay")

    @property
    def mean_rate(self) -> float:
        """Mean arrivals per second."""
        return self.arrivals.mean_rate

    @property
    def mean_prompt(self) -> float:
        """Expected prompt tokens per request."""
        if self.prompt is None:
            return float(np.mean(self.arrivals.trace.prompt))
        return self.prompt.mean

    @property
    def mean_output(self) -> float:
        """Expected output tokens per request."""
        if self.output is None:
            return float(np.mean(self.arrivals.trace.output))
        return self.output.mean

    def with_rate(self, rate: float) -> Workload:
        """The same workload at a new mean rate (see each arrival process for what is kept)."""
        return dataclasses.replace(self, arrivals=self.arrivals.with_rate(rate))

    def sample(self, key: jax.Array, n: int) -> Requests:
        """Draw an episode of `n` requests; pure and jittable (`n` static), vmappable over `key`."""
        k_arrival, k_prompt, k_output = jax.random.split(key, 3)
        arrival = self.arrivals.sample(k_arrival, n)
        if self.prompt is None or self.output is None:
            rows = self.arrivals.window(k_arrival, n)
        if self.prompt is None:
            prompt = jnp.asarray(self.arrivals.trace.prompt)[rows]
        else:
            prompt = self.prompt.sample(k_prompt, n)
        if self.output is None:
            output = jnp.asarray(self.arrivals.trace.output)[rows]
        else:
            output = self.output.sample(k_output, n)
        return Requests(arrival, prompt, output)
