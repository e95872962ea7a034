"""Arrival processes: when requests arrive (Poisson, Gamma renewal, on/off MMPP bursts, diurnal).

Every process returns times with ``arrival[0] == 0`` (the episode starts with a request), and
``mean_rate`` is the long-run arrivals per second, exactly; ``with_rate`` changes it and keeps
every timescale given in seconds (on/off durations, the diurnal period). Sources and reasons for
each are in docs/workloads.md. Every part is a frozen, hashable dataclass (a static argument of
`jax.jit`); `sample(key, n)` is pure and vmaps over `key`.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import jax
import jax.numpy as jnp

from burstgym.workload.base import ArrivalProcess, check_positive, float_dtype, times_from_gaps


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
        z = jax.random.normal(k_normal, (n,), float_dtype())
        u = jax.random.uniform(k_uniform, (n,), float_dtype())
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
        tiny = jnp.finfo(float_dtype()).tiny
        log_u = jnp.log(jax.random.uniform(k_boost, (n,), float_dtype(), minval=tiny))
        x = jnp.exp(jnp.log(x) + log_u / shape)
    return x


@dataclass(frozen=True)
class PoissonArrivals:
    """Poisson arrivals (exponential gaps): the memoryless baseline, cv of gaps = 1."""

    rate: float  # arrivals per second

    def __post_init__(self) -> None:
        check_positive(rate=self.rate)

    @property
    def mean_rate(self) -> float:
        return float(self.rate)

    def with_rate(self, rate: float) -> PoissonArrivals:
        return dataclasses.replace(self, rate=rate)

    def sample(self, key: jax.Array, n: int) -> jax.Array:
        """[n] arrival times (seconds), starting at 0."""
        return times_from_gaps(jax.random.exponential(key, (n - 1,), float_dtype()) / self.rate)


@dataclass(frozen=True)
class GammaArrivals:
    """Renewal arrivals with Gamma gaps of a given coefficient of variation.

    BurstGPT (Wang et al., 2024) fits Gamma inter-arrival times to real LLM traffic; cv > 1 is
    bursty (clustered arrivals separated by long silences), cv = 1 is Poisson, cv < 1 is regular.
    """

    rate: float  # arrivals per second
    cv: float = 1.0  # std / mean of the gaps

    def __post_init__(self) -> None:
        check_positive(rate=self.rate, cv=self.cv)

    @property
    def mean_rate(self) -> float:
        return float(self.rate)

    def with_rate(self, rate: float) -> GammaArrivals:
        return dataclasses.replace(self, rate=rate)

    def sample(self, key: jax.Array, n: int) -> jax.Array:
        """[n] arrival times (seconds), starting at 0."""
        shape = 1.0 / self.cv**2
        gaps = _gamma(key, shape, n - 1) / (shape * self.rate)
        return times_from_gaps(gaps)


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
        check_positive(rate=self.rate, mean_on=self.mean_on, mean_off=self.mean_off)
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
        seg_rate = jnp.where(on, self.rate_on, self.rate_off).astype(float_dtype())
        seg_len = jax.random.exponential(k_len, (segments,), float_dtype()) * mean_len
        # A last segment of unbounded length at the mean rate: only reached if the drawn path
        # holds fewer than n arrivals, which `_num_cycles` makes negligibly rare.
        seg_rate = jnp.append(seg_rate, self.rate)
        seg_start = jnp.concatenate([jnp.zeros((1,), seg_len.dtype), jnp.cumsum(seg_len)])
        mass_start = jnp.concatenate([jnp.zeros((1,), seg_len.dtype), jnp.cumsum(seg_len * seg_rate[:-1])])
        unit = jnp.cumsum(jax.random.exponential(k_unit, (n,), float_dtype()))
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
        check_positive(period=self.period)
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
            phase = jax.random.uniform(k_phase, (), float_dtype(), 0.0, 2.0 * math.pi)
        else:
            phase = jnp.asarray(self.phase, float_dtype())
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
