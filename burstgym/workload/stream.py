"""`Workload`: arrivals, lengths and shared prefixes composed into the stream an episode replays."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from functools import cached_property

import jax
import jax.numpy as jnp
import numpy as np

from burstgym.workload.base import ArrivalProcess, LengthDistribution, Requests, no_prefix
from burstgym.workload.prefix import Conversations, SharedPrefixes, max_tokens
from burstgym.workload.replay import TraceReplay

_MEAN_SAMPLE = 16384  # requests drawn to estimate the mean prompt of workloads without a closed form


@dataclass(frozen=True)
class Workload:
    """Arrivals plus prompt and output lengths (and shared prefixes): what `reset` draws for an episode.

    - `arrivals`: an arrival process, a `TraceReplay` (whose trace supplies any length left None
      and, for Mooncake traces, the prompts' block ids), or `Conversations` (which builds each
      turn's prompt from `prompt` as the user message and `output` as the answer length);
    - `prompt`, `output`: length distributions, drawn independently;
    - `prefix`: optional `SharedPrefixes`: prompts become a group prefix plus a `prompt`-long suffix.
    """

    arrivals: ArrivalProcess
    prompt: LengthDistribution | None = None
    output: LengthDistribution | None = None
    prefix: SharedPrefixes | None = None

    def __post_init__(self) -> None:
        replay = isinstance(self.arrivals, TraceReplay)
        if (self.prompt is None or self.output is None) and not replay:
            raise ValueError("prompt and output lengths may be None only when arrivals is a TraceReplay")
        if self.prefix is not None and (replay or isinstance(self.arrivals, Conversations)):
            raise ValueError(
                "shared prefixes (prefix=) apply to generated prompts, not traces or conversations"
            )

    @property
    def mean_rate(self) -> float:
        """Mean arrivals per second."""
        return self.arrivals.mean_rate

    @property
    def chunk_tokens(self) -> int:
        """Tokens per prefix-cache chunk of this workload's ids (0: no shared prefixes)."""
        if self.prefix is not None:
            return self.prefix.chunk_tokens
        if isinstance(self.arrivals, Conversations):
            return self.arrivals.chunk_tokens
        if isinstance(self.arrivals, TraceReplay) and self.prompt is None:
            return self.arrivals.chunk_tokens
        return 0

    @property
    def max_prompt(self) -> int:
        """The longest prompt the workload can draw."""
        if isinstance(self.arrivals, Conversations):
            return self.arrivals.max_prompt(self.prompt, self.output)
        if self.prompt is None:
            return int(np.max(self.arrivals.trace.prompt))
        return max_tokens(self.prompt) + (self.prefix.max_prefix if self.prefix is not None else 0)

    @property
    def max_output(self) -> int:
        """The longest output the workload can draw."""
        if self.output is None:
            return int(np.max(self.arrivals.trace.output))
        return max_tokens(self.output)

    @cached_property
    def mean_prompt(self) -> float:
        """Expected prompt tokens per request."""
        if isinstance(self.arrivals, Conversations):
            return float(np.mean(np.asarray(self.sample(jax.random.key(0), _MEAN_SAMPLE).prompt)))
        if self.prompt is None:
            return float(np.mean(self.arrivals.trace.prompt))
        return self.prompt.mean + (self.prefix.mean_prefix if self.prefix is not None else 0.0)

    @cached_property
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
        k_arrival, k_prompt, k_output, k_prefix = jax.random.split(key, 4)
        if isinstance(self.arrivals, Conversations):
            return self.arrivals.sample_requests(k_arrival, n, self.prompt, self.output)
        arrival = self.arrivals.sample(k_arrival, n)
        replay = isinstance(self.arrivals, TraceReplay)
        rows = self.arrivals.window(k_arrival, n) if replay else None
        if self.prompt is None:
            prompt = jnp.asarray(self.arrivals.trace.prompt)[rows]
        else:
            prompt = self.prompt.sample(k_prompt, n)
        if self.output is None:
            output = jnp.asarray(self.arrivals.trace.output)[rows]
        else:
            output = self.output.sample(k_output, n)
        ids, id_tokens, chunk_tokens = no_prefix(n)
        if self.prefix is not None:
            prompt, ids, id_tokens, chunk_tokens = self.prefix.apply(
                k_prefix, prompt, max_tokens(self.prompt)
            )
        elif replay and self.prompt is None and self.arrivals.has_prefixes:
            ids, id_tokens, chunk_tokens = self.arrivals.prefix_ids(rows)
        return Requests(
            arrival, prompt.astype(jnp.int32), output.astype(jnp.int32), ids, id_tokens, chunk_tokens
        )
