"""Replay of a real trace (`TraceReplay`): arrival gaps, the paired lengths and the prompts' block ids."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from functools import lru_cache

import jax
import jax.numpy as jnp
import numpy as np

from burstgym.workload.base import check_positive, digest, float_dtype, times_from_gaps
from burstgym.workload.traces import Trace


@dataclass(frozen=True)
class TraceReplay:
    """Replay of a real trace: a random window of consecutive requests per episode.

    Each episode starts at a request index drawn uniformly and replays the following requests'
    inter-arrival gaps, divided by ``rate / native rate`` (time scaling keeps the trace's shape of
    burstiness). Past the end it wraps around to the start, with one mean gap between the last and
    the first request, so the long-run rate is exactly the trace's ``(N - 1) / duration``.
    Used as the arrivals of a `Workload` whose `prompt`/`output` are None, it also supplies the
    lengths of the same window (pairs kept), and, when the trace has block ids (Mooncake), the
    prompts' prefix chunks. Hashes by content digest; the trace becomes a constant of the
    compiled program.
    """

    trace: Trace = field(compare=False, repr=False)
    rate: float | None = None  # mean arrivals per second; None: the trace's own rate
    digest: str = field(init=False)

    def __post_init__(self) -> None:
        arrival, prompt, output = (np.asarray(a) for a in self.trace[:3])
        if not (arrival.ndim == 1 and arrival.shape == prompt.shape == output.shape):
            raise ValueError("trace arrays must be 1-D and of equal length")
        if arrival.size < 2 or not arrival[-1] > arrival[0]:
            raise ValueError("a trace needs at least two requests spanning a positive duration")
        if np.any(np.diff(arrival) < 0):
            raise ValueError("trace arrival times must be non-decreasing")
        if prompt.min() < 1 or output.min() < 1:
            raise ValueError("trace prompt and output lengths must be >= 1")
        if self.rate is not None:
            check_positive(rate=self.rate)
        ids = self.trace.hash_ids
        if ids is not None:
            ids = np.asarray(ids, dtype=np.int32)
            if ids.ndim != 2 or ids.shape[0] != arrival.size:
                raise ValueError("trace hash_ids must be [requests, blocks]")
            if not self.trace.block_tokens > 0:
                raise ValueError("a trace with hash_ids needs block_tokens > 0")
        trace = Trace(
            arrival.astype(np.float64),
            prompt.astype(np.int32),
            output.astype(np.int32),
            ids,
            int(self.trace.block_tokens),
        )
        object.__setattr__(self, "trace", trace)
        parts = [*trace[:3]] + ([] if ids is None else [ids, np.asarray([trace.block_tokens])])
        object.__setattr__(self, "digest", digest(*parts))

    @property
    def native_rate(self) -> float:
        """The trace's own mean arrivals per second, (N - 1) / duration."""
        arrival = self.trace.arrival
        return (arrival.size - 1) / float(arrival[-1] - arrival[0])

    @property
    def mean_rate(self) -> float:
        return self.native_rate if self.rate is None else float(self.rate)

    @property
    def has_prefixes(self) -> bool:
        """Whether the trace names its prompts' blocks (so prefix caching can be replayed)."""
        return self.trace.hash_ids is not None

    @property
    def chunk_tokens(self) -> int:
        """Tokens per block of the trace's ids (0 without ids)."""
        return self.trace.block_tokens if self.has_prefixes else 0

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
        gaps = jnp.asarray(gaps * (self.native_rate / self.mean_rate), float_dtype())
        return times_from_gaps(gaps[self.window(key, n)[:-1]])

    def unique_chunks(self, n: int) -> int:
        """A bound on the distinct block ids in any window of `n` requests (rounded up to 1024s)."""
        return _window_bound(self, n)

    def prefix_ids(self, rows: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        """(chunk_ids [n, B], id_tokens [n], chunk_tokens [U]) of the window `rows`.

        The window's block ids are renumbered densely for the episode (a sort of its ids), so
        the per-node cache arrays hold U entries, the most any window of n requests needs.
        """
        n = rows.shape[0]
        u = self.unique_chunks(n)
        table = jnp.asarray(self.trace.hash_ids)
        ids = table[rows]
        sentinel = jnp.int32(2**31 - 1)
        flat = jnp.where(ids >= 0, ids, sentinel).reshape(-1)
        uniq = jnp.unique(flat, size=u + 1, fill_value=sentinel)
        dense = jnp.searchsorted(uniq, ids).astype(jnp.int32)
        dense = jnp.where(ids >= 0, dense, -1)
        lengths = jnp.asarray(_block_lengths(self))
        chunk_tokens = jnp.where(uniq[:u] < sentinel, lengths[jnp.minimum(uniq[:u], lengths.size - 1)], 0)
        prompt = jnp.asarray(self.trace.prompt)[rows]
        return dense, prompt.astype(jnp.int32), chunk_tokens.astype(jnp.int32)


@lru_cache(maxsize=64)
def _window_bound(replay: TraceReplay, n: int) -> int:
    counts = (replay.trace.hash_ids >= 0).sum(axis=1)
    wrapped = np.concatenate([counts, counts[:n]])
    sums = np.convolve(wrapped, np.ones(n, dtype=np.int64), "valid")[: counts.size]
    return -(-int(sums.max()) // 1024) * 1024


@lru_cache(maxsize=64)
def _block_lengths(replay: TraceReplay) -> np.ndarray:
    """Tokens of each (globally dense) block id of the trace."""
    ids, prompt, g = replay.trace.hash_ids, replay.trace.prompt, replay.trace.block_tokens
    j = np.arange(ids.shape[1])[None, :]
    length = np.clip(prompt[:, None] - j * g, 0, g)
    out = np.zeros(int(ids.max()) + 1, dtype=np.int32)
    valid = ids >= 0
    out[ids[valid]] = length[valid]
    return out
