"""Token-count distributions for prompts and outputs (log-normal, Zipf, empirical)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property

import jax
import jax.numpy as jnp
import numpy as np

from burstgym.workload.base import check_positive, float_dtype


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
        check_positive(median=self.median, sigma=self.sigma)
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
        x = self.median * jnp.exp(self.sigma * jax.random.normal(key, (n,), float_dtype()))
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
        check_positive(exponent=self.exponent)
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
        cdf = jnp.asarray(np.cumsum(self._pmf)[:-1], float_dtype())
        u = jax.random.uniform(key, (n,), float_dtype())
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
