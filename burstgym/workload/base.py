"""What every workload part shares: the request stream's type, the parts' protocols and helpers."""

from __future__ import annotations

import hashlib
from typing import NamedTuple, Protocol

import jax
import jax.numpy as jnp
import numpy as np

INT32_MAX = 2**31 - 1  # the core stores token counts, ids and limits as int32


class Requests(NamedTuple):
    """One episode's request stream, in arrival order.

    Prefix structure (docs/semantics.md, "Prefix cache"): the first `id_tokens[i]` tokens of
    request i's sequence are cut into chunks of `chunk_tokens` tokens (the last may be shorter);
    `chunk_ids[i, j]` names chunk j, and two requests whose ids agree on their first k chunks
    share their first k chunks' tokens. Ids are dense per episode, in [0, U); -1 pads.
    """

    arrival: jax.Array  # [E] float, seconds, non-decreasing, arrival[0] == 0
    prompt: jax.Array  # [E] int32 >= 1, prompt tokens (visible to the router)
    output: jax.Array  # [E] int32 >= 1, output tokens (hidden from the router)
    chunk_ids: jax.Array  # [E, B] int32, prefix-chunk ids of the sequence, -1 past the last
    id_tokens: jax.Array  # [E] int32, tokens of the sequence the chunk ids cover (0: none)
    chunk_tokens: jax.Array  # [U] int32, tokens of each chunk id


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


def no_prefix(n: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(chunk_ids [n, 0], id_tokens [n], chunk_tokens [0]) of a stream without shared prefixes."""
    return jnp.zeros((n, 0), jnp.int32), jnp.zeros(n, jnp.int32), jnp.zeros(0, jnp.int32)


def float_dtype() -> jnp.dtype:
    """JAX's default float dtype (float32, or float64 under x64)."""
    return jnp.result_type(float)


def times_from_gaps(gaps: jax.Array) -> jax.Array:
    """Arrival times from the n-1 gaps between n arrivals; the first arrival is at 0.

    `cummax` guards the non-decreasing contract against any reordering of float additions.
    """
    times = jnp.concatenate([jnp.zeros((1,), gaps.dtype), jnp.cumsum(gaps)])
    return jax.lax.cummax(times)


def check_positive(**values: float) -> None:
    """Raise ValueError naming the first value that is not > 0."""
    for name, value in values.items():
        if not value > 0:
            raise ValueError(f"{name} must be > 0, got {value}")


def digest(*arrays: np.ndarray) -> str:
    """Content digest of numpy arrays, so dataclasses that hold them hash and compare by value."""
    h = hashlib.sha256()
    for a in arrays:
        a = np.ascontiguousarray(a)
        h.update(str((a.dtype, a.shape)).encode())
        h.update(a.tobytes())
    return h.hexdigest()


def ceil_div(a: int, b: int) -> int:
    """Integer ceiling of a / b for positive b."""
    return -(-a // b)


def round_up_pow2(n: int) -> int:
    """The smallest power of two >= n (>= 1), so nearby sizes share compiled shapes."""
    return 1 << max(n - 1, 0).bit_length()


__all__ = [
    "INT32_MAX",
    "ArrivalProcess",
    "LengthDistribution",
    "Requests",
    "ceil_div",
    "check_positive",
    "digest",
    "float_dtype",
    "no_prefix",
    "round_up_pow2",
    "times_from_gaps",
]
