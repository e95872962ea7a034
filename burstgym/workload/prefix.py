"""Prompts that share prefixes: shared system prompts and documents, and multi-turn conversations.

Both cut each request's sequence into chunks of `chunk_tokens` tokens and name every chunk, so
that the simulator's prefix cache can tell which chunks a node already holds
(docs/semantics.md, "Prefix cache"). Ids are dense per episode.

- `SharedPrefixes` (a `Workload.prefix` part): each request starts with the prefix of one of
  `groups` groups (a system prompt or a document), drawn with Zipf popularity, followed by its
  own suffix (the `Workload.prompt` length): the shape of SGLang's generated-shared-prefix
  benchmark (bench_serving.py, "generated-shared-prefix": groups of prompts sharing a long system
  prompt, each with its own question).
- `Conversations` (a `Workload.arrivals` part that also writes the prompts): chat sessions of
  several turns; turn t's prompt is the previous turn's prompt and answer plus a new user message
  (the context a chat front end resends), so each turn can reuse the last turn's KV blocks.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from burstgym.workload.base import LengthDistribution, Requests, ceil_div, check_positive, float_dtype
from burstgym.workload.lengths import LogNormalLengths


def max_tokens(dist: LengthDistribution) -> int:
    """The largest token count a length distribution draws."""
    if hasattr(dist, "max_tokens"):
        return int(dist.max_tokens)
    return int(max(dist.values))


@dataclass(frozen=True)
class SharedPrefixes:
    """Requests share one of `groups` prefixes drawn with Zipf popularity.

    Group g (0-based) has popularity proportional to (g + 1)^-zipf_exponent and a prefix of
    `prefix_lengths[g]` tokens, drawn once per workload from `prefix` with `seed` (system prompts
    and documents are fixed; requests pick among them) and rounded up to whole chunks. A fraction
    `shared` of requests carries a group prefix; the rest are unique. The suffix of every request
    is the workload's prompt length; its whole chunks get ids of their own (they are cached, but
    only the same request, re-admitted after a preemption, can hit them).
    """

    groups: int = 64
    zipf_exponent: float = 1.0
    prefix: LogNormalLengths = LogNormalLengths(median=2048.0, sigma=0.5, max_tokens=8192)
    shared: float = 1.0  # fraction of requests with a group prefix
    chunk_tokens: int = 256
    seed: int = 0

    def __post_init__(self) -> None:
        check_positive(groups=self.groups, chunk_tokens=self.chunk_tokens, zipf_exponent=self.zipf_exponent)
        if not 0.0 <= self.shared <= 1.0:
            raise ValueError(f"shared must be in [0, 1], got {self.shared}")

    @property
    def prefix_lengths(self) -> tuple[int, ...]:
        """Tokens of each group's prefix (whole chunks, at least one)."""
        rng = np.random.default_rng(self.seed)
        raw = self.prefix.median * np.exp(self.prefix.sigma * rng.standard_normal(self.groups))
        raw = np.clip(raw, 1, self.prefix.max_tokens)
        chunks = np.maximum(np.ceil(raw / self.chunk_tokens), 1).astype(int)
        return tuple(int(c) * self.chunk_tokens for c in chunks)

    @property
    def popularity(self) -> np.ndarray:
        """[groups] probability of each group."""
        w = np.arange(1, self.groups + 1, dtype=np.float64) ** -self.zipf_exponent
        return w / w.sum()

    @property
    def max_prefix(self) -> int:
        return max(self.prefix_lengths)

    @property
    def mean_prefix(self) -> float:
        """Expected prefix tokens per request."""
        return self.shared * float(np.dot(self.popularity, self.prefix_lengths))

    def apply(self, key: jax.Array, suffix: jax.Array, suffix_max: int) -> tuple[jax.Array, ...]:
        """(prompt, chunk_ids, id_tokens, chunk_tokens) for requests with these suffix lengths."""
        n = suffix.shape[0]
        g_tok = self.chunk_tokens
        k_group, k_shared = jax.random.split(key)
        lengths = jnp.asarray(self.prefix_lengths, jnp.int32)
        group = jax.random.categorical(
            k_group, jnp.log(jnp.asarray(self.popularity, float_dtype())), shape=(n,)
        )
        has = jax.random.bernoulli(k_shared, self.shared, (n,))
        prefix = jnp.where(has, lengths[group], 0)
        bp = self.max_prefix // g_tok  # chunks of the longest group prefix
        bs = suffix_max // g_tok  # whole chunks of the longest suffix
        p_chunks = prefix // g_tok
        s_chunks = suffix // g_tok
        j = jnp.arange(bp + bs)[None, :]
        shared_id = group[:, None] * bp + j
        own_id = self.groups * bp + jnp.arange(n)[:, None] * bs + (j - p_chunks[:, None])
        ids = jnp.where(
            j < p_chunks[:, None], shared_id, jnp.where(j < (p_chunks + s_chunks)[:, None], own_id, -1)
        )
        u = self.groups * bp + n * bs
        chunk_tokens = jnp.full(u, g_tok, jnp.int32)
        id_tokens = (p_chunks + s_chunks) * g_tok
        return (
            (prefix + suffix).astype(jnp.int32),
            ids.astype(jnp.int32),
            id_tokens.astype(jnp.int32),
            chunk_tokens,
        )


@dataclass(frozen=True)
class Conversations:
    """Multi-turn chat sessions, replayed open loop.

    Sessions start as a Poisson process at `rate / E[turns]` per second; a session has a
    geometric number of turns (mean `mean_turns` before truncation at `max_turns`); the gap from
    one turn's arrival to the next is exponential with mean `think_time` seconds (the user reads
    the answer and types; the answer itself is assumed to arrive well within that time, which
    holds while latencies stay below the think time). Turn t's prompt is `system_tokens` of a
    system prompt shared by every session, then every earlier user message and answer, then the
    new user message (the workload's prompt length); its output is the workload's output length.
    The ids cover the whole chunks of each turn's sequence (prompt and answer), so the next turn
    can hit the answer's blocks as in vLLM, which caches generated tokens' blocks too.

    Sessions started up to `warmup_turns x think_time` before the episode, so an episode opens on
    conversations already under way (their earlier turns are not replayed).
    """

    rate: float = 1.0  # turns (requests) per second
    mean_turns: float = 4.0
    max_turns: int = 8
    think_time: float = 10.0  # seconds
    system_tokens: int = 512  # a whole number of chunks
    chunk_tokens: int = 512

    def __post_init__(self) -> None:
        check_positive(rate=self.rate, mean_turns=self.mean_turns, think_time=self.think_time)
        check_positive(max_turns=self.max_turns, chunk_tokens=self.chunk_tokens)
        if self.mean_turns < 1:
            raise ValueError(f"mean_turns must be >= 1, got {self.mean_turns}")
        if self.system_tokens < 0 or self.system_tokens % self.chunk_tokens:
            raise ValueError(
                f"system_tokens must be a whole number of {self.chunk_tokens}-token chunks, "
                f"got {self.system_tokens}"
            )

    @property
    def mean_rate(self) -> float:
        return float(self.rate)

    def with_rate(self, rate: float) -> Conversations:
        return dataclasses.replace(self, rate=rate)

    @property
    def turn_probabilities(self) -> np.ndarray:
        """[max_turns] P(a session has t + 1 turns): geometric, truncated and renormalised."""
        p = 1.0 / self.mean_turns
        w = p * (1.0 - p) ** np.arange(self.max_turns)
        return w / w.sum()

    @property
    def expected_turns(self) -> float:
        return float(np.dot(self.turn_probabilities, np.arange(1, self.max_turns + 1)))

    def _sessions(self, n: int) -> int:
        """Sessions drawn per episode: enough that n turns fall in the window but with negligible odds."""
        window = n / self.rate + self.max_turns * self.think_time * 2.0
        expected = window * self.rate / self.expected_turns
        return int(math.ceil(2.0 * expected + 8.0 * math.sqrt(expected) + 16))

    def chunks_per_session(self, user: LengthDistribution, answer: LengthDistribution) -> int:
        """Chunks of a session's longest possible token stream beyond the system prompt."""
        longest = self.max_turns * (max_tokens(user) + max_tokens(answer))
        return ceil_div(longest, self.chunk_tokens)

    def max_prompt(self, user: LengthDistribution, answer: LengthDistribution) -> int:
        """The longest prompt a turn can have."""
        return (
            self.system_tokens
            + (self.max_turns - 1) * (max_tokens(user) + max_tokens(answer))
            + max_tokens(user)
        )

    def sample_requests(
        self, key: jax.Array, n: int, user: LengthDistribution, answer: LengthDistribution
    ) -> Requests:
        """An episode of `n` turns in arrival order (times from 0), with their prompts and ids."""
        m, t_max, g = self._sessions(n), self.max_turns, self.chunk_tokens
        k_start, k_turns, k_think, k_user, k_answer = jax.random.split(key, 5)
        fdt = float_dtype()
        warm = self.max_turns * self.think_time * 2.0
        session_rate = self.rate / self.expected_turns
        start = jnp.cumsum(jax.random.exponential(k_start, (m,), fdt)) / session_rate - warm
        probs = jnp.asarray(self.turn_probabilities, fdt)
        turns = jax.random.categorical(k_turns, jnp.log(probs), shape=(m,)) + 1
        think = jax.random.exponential(k_think, (m, t_max), fdt) * self.think_time
        times = start[:, None] + jnp.cumsum(think, axis=1) - think[:, :1]
        u = user.sample(k_user, m * t_max).reshape(m, t_max)
        o = answer.sample(k_answer, m * t_max).reshape(m, t_max)
        context = self.system_tokens + jnp.cumsum(u + o, axis=1) - (u + o)
        prompt = context + u
        valid = (jnp.arange(t_max)[None, :] < turns[:, None]) & (times >= 0)
        key_time = jnp.where(valid, times, jnp.inf).reshape(-1)
        order = jnp.argsort(key_time)[:n]
        chosen_time = key_time[order]
        # A shortfall of valid turns is negligibly rare (see `_sessions`); keep the contract anyway.
        last = jnp.max(jnp.where(jnp.isfinite(chosen_time), chosen_time, -jnp.inf))
        chosen_time = jnp.where(jnp.isfinite(chosen_time), chosen_time, last)
        arrival = jax.lax.cummax(chosen_time - chosen_time[0])
        session = order // t_max
        p = prompt.reshape(-1)[order].astype(jnp.int32)
        out = o.reshape(-1)[order].astype(jnp.int32)
        # Dense session numbers for this episode, in order of first appearance.
        first = jnp.full(m, n, jnp.int32).at[session].min(jnp.arange(n, dtype=jnp.int32))
        dense = jnp.searchsorted(jnp.sort(first), first[session]).astype(jnp.int32)
        ks = self.system_tokens // g
        bs = self.chunks_per_session(user, answer)
        n_chunks = (p + out - 1) // g
        j = jnp.arange(ks + bs)[None, :]
        ids = jnp.where(j < ks, j, ks + dense[:, None] * bs + (j - ks))
        ids = jnp.where(j < n_chunks[:, None], ids, -1).astype(jnp.int32)
        u_total = ks + n * bs
        return Requests(
            arrival=arrival.astype(fdt),
            prompt=p,
            output=out,
            chunk_ids=ids,
            id_tokens=(n_chunks * g).astype(jnp.int32),
            chunk_tokens=jnp.full(u_total, g, jnp.int32),
        )
