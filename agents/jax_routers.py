"""Every heuristic and production router as a pure JAX function of one cluster's router view.

Each NumPy router of `agents.heuristics` and `agents.production` has a twin here with the same
rule, thresholds and tie-breaks, written for one cluster (per-node fields [N], scalars []) so
that it can be vmapped over clusters and scanned over an episode inside one jitted call
(`burstgym.rollout`):

    router = make_jax_router("least-tokens")          # or twin(make_router("least-tokens", 4))
    state = router.init(n_nodes, seed)                # RouterState
    action, state = router.act(state, view, mask)     # view: RouterView of [N] fields, mask: [N] bool

The state is a `RouterState` for every router (so one episode can switch between routers): the
decision counter (`counter`, the NumPy routers' `Router.counter`: the index of the decision in the
episode, which round-robin deals from and which rotates the tie-break offset), a PRNG key and the
smooth weighted round-robin credit of weighted-skew.

Exactness. The deterministic twins decide exactly as their NumPy routers on the float32 views the
environment produces (tests/test_jax_rollout.py checks it on random views with ties and masked
nodes, and on whole episodes). Where the NumPy rule computes in float64 from float32 signals, the
twin computes the same value exactly in float32 arithmetic:
- `dynamo-kv`: the cost `kv_used + ceil(prompt / block) + prefill blocks` is exact in float64
  for power-of-two block sizes (vLLM's are); the twin holds it as an exact float32 pair (TwoSum)
  and compares the pairs lexicographically, which orders like the exact value.
- `aibrix-prefix`: "running <= mean + sample std" is decided in exact integer arithmetic when the
  running counts are integers (they are counts), as `d^2 (n - 1) <= n sum_{i<j} (r_i - r_j)^2`
  with `d = n r - sum r` (in float32 otherwise, which may differ from float64 within rounding).
Three NumPy routers draw from NumPy's generator, which JAX cannot reproduce: `random` and
`power-of-two` draw their nodes, `llm-d` its tie-break keys, from JAX's PRNG instead (a key per
episode from the router's seed and the episode's seed), with the same rule and distribution
(`exact = False`). `llm-d`'s score is computed in float32, where NumPy uses float64: both agree
on dyadic values; elsewhere they may order scores within float32 rounding of each other apart.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import math
from dataclasses import dataclass
from typing import Any, ClassVar, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from agents import heuristics, production
from burstgym.observation import RouterView
from burstgym.types import IDLE


class RouterState(NamedTuple):
    """A JAX router's state in one cluster (the same structure for every router)."""

    counter: jax.Array  # [] int32, decisions made this episode (Router.counter)
    key: jax.Array  # [2] uint32, raw PRNG key data (jax.random.key_data)
    current: jax.Array  # [N] int32, smooth weighted round-robin credit (weighted-skew; else zeros)


def argmin(score: jax.Array, mask: jax.Array, counter: jax.Array, *then: jax.Array) -> jax.Array:
    """`agents.heuristics.Router.argmin` for one cluster: the allowed node of least `score`; exact
    ties go to the least of each key in `then` in turn, then to the first tied node at or after
    `counter mod N` (the rotating offset). With no allowed finite score every node is a candidate."""
    n = score.shape[0]
    rotation = (jnp.arange(n, dtype=jnp.int32) - counter) % n
    tied = mask & jnp.isfinite(score)
    tied = jnp.where(tied.any(), tied, True)
    for key in (score, *then):
        k = jnp.where(tied, key, jnp.inf)
        tied = tied & (k == k.min())
    return jnp.argmin(jnp.where(tied, rotation, n)).astype(jnp.int32)


def two_sum(a: jax.Array, b: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(s, e) with s = fl(a + b) and s + e = a + b exactly (Knuth's TwoSum); ordering pairs
    lexicographically orders the exact sums."""
    s = a + b
    bb = s - a
    e = (a - (s - bb)) + (b - bb)
    return s, e


def _outstanding(view: RouterView) -> jax.Array:
    return view.running + view.waiting


def _match_rate(view: RouterView) -> jax.Array:
    return view.hit_tokens / jnp.maximum(view.prompt, 1.0)


@dataclass(frozen=True)
class JaxRouter:
    """Base of the JAX twins: frozen (hashable, a static argument of jit), parameters as fields."""

    name: str = ""
    seed: int = 0
    numpy_class: ClassVar[type[heuristics.Router]] = heuristics.Router
    exact: ClassVar[bool] = True  # decides exactly as the NumPy twin (False: it draws from a PRNG)
    params: ClassVar[tuple[str, ...]] = ()  # NumPy router attributes copied into the twin

    def __post_init__(self):
        if not self.name:
            object.__setattr__(self, "name", self.numpy_class.name)

    def init(self, n_nodes: int, seed: Any = None, stream: Any = 0) -> RouterState:
        """A fresh episode's state; the PRNG key is `fold_in(key(seed), stream)` (`seed` defaults
        to the router's), so each episode (stream) draws its own numbers. `seed` and `stream` may
        be traced integers (vmapped over clusters)."""
        seed = self.seed if seed is None else seed
        key = jax.random.key(jnp.asarray(seed, jnp.uint32))
        key = jax.random.fold_in(key, jnp.asarray(stream, jnp.uint32))
        return RouterState(jnp.int32(0), jax.random.key_data(key), jnp.zeros(n_nodes, jnp.int32))

    def act(self, state: RouterState, view: RouterView, mask: jax.Array) -> tuple[jax.Array, RouterState]:
        """The node for the arriving request ([] int32) and the next state (counter + 1)."""
        action, state = self.decide(state, view, jnp.asarray(mask, bool))
        return action.astype(jnp.int32), state._replace(counter=state.counter + 1)

    def decide(self, state: RouterState, view: RouterView, mask: jax.Array) -> tuple[jax.Array, RouterState]:
        raise NotImplementedError

    @staticmethod
    def draw(state: RouterState) -> tuple[jax.Array, RouterState]:
        """A fresh subkey, and the state holding the advanced key."""
        key, sub = jax.random.split(jax.random.wrap_key_data(state.key))
        return sub, state._replace(key=jax.random.key_data(key))


# ----------------------------------------------------------------------------------- heuristics


@dataclass(frozen=True)
class RoundRobin(JaxRouter):
    numpy_class: ClassVar = heuristics.RoundRobin

    def decide(self, state, view, mask):
        return state.counter % mask.shape[0], state


@dataclass(frozen=True)
class Random(JaxRouter):
    numpy_class: ClassVar = heuristics.Random
    exact: ClassVar[bool] = False

    def decide(self, state, view, mask):
        sub, state = self.draw(state)
        return jax.random.randint(sub, (), 0, mask.shape[0]), state


@dataclass(frozen=True)
class LeastRequests(JaxRouter):
    numpy_class: ClassVar = heuristics.LeastRequests

    def decide(self, state, view, mask):
        return argmin(_outstanding(view), mask, state.counter), state


@dataclass(frozen=True)
class LeastTokens(JaxRouter):
    numpy_class: ClassVar = heuristics.LeastTokens

    def decide(self, state, view, mask):
        return argmin(view.prefill_tokens, mask, state.counter, _outstanding(view)), state


@dataclass(frozen=True)
class PowerOfTwo(JaxRouter):
    """Two distinct nodes uniformly at random (the first uniform, the second uniform among the
    others), the one with fewer requests; both full: any allowed node (as the NumPy router)."""

    numpy_class: ClassVar = heuristics.PowerOfTwo
    exact: ClassVar[bool] = False

    def decide(self, state, view, mask):
        n = mask.shape[0]
        sub, state = self.draw(state)
        k1, k2 = jax.random.split(sub)
        first = jax.random.randint(k1, (), 0, n)
        second = (first + jax.random.randint(k2, (), 1, n)) % n if n > 1 else first
        nodes = jnp.arange(n)
        pair = (nodes == first) | (nodes == second)
        allowed = pair & mask
        allowed = jnp.where(allowed.any(), allowed, mask)
        return argmin(_outstanding(view), allowed, state.counter), state


@dataclass(frozen=True)
class LeastKV(JaxRouter):
    numpy_class: ClassVar = heuristics.LeastKV

    def decide(self, state, view, mask):
        return argmin(view.kv_util, mask, state.counter, _outstanding(view)), state


@dataclass(frozen=True)
class WeightedSkew(JaxRouter):
    """Smooth weighted round-robin with weights 11 : 10 : ... : 10 (integer credit, as exact as the
    NumPy router's float64 credit, which only ever holds integers)."""

    numpy_class: ClassVar = heuristics.WeightedSkew

    def decide(self, state, view, mask):
        n = mask.shape[0]
        weights = jnp.full(n, 10, jnp.int32).at[0].set(11)
        current = state.current + weights
        pick = jnp.argmax(current)
        current = current.at[pick].add(-weights.sum())
        return pick, state._replace(current=current)


@dataclass(frozen=True)
class PackLoad(JaxRouter):
    numpy_class: ClassVar = heuristics.PackLoad
    params: ClassVar = ("kv_cap", "max_waiting")
    kv_cap: float = heuristics.PackLoad.kv_cap
    max_waiting: int = heuristics.PackLoad.max_waiting

    def decide(self, state, view, mask):
        load = _outstanding(view)
        under = (view.kv_util < self.kv_cap) & (view.waiting <= self.max_waiting) & mask
        pack = argmin(-load, under, state.counter)
        spread = argmin(load, mask, state.counter)
        return jnp.where(under.any(), pack, spread), state


@dataclass(frozen=True)
class SoonestBatch(JaxRouter):
    numpy_class: ClassVar = heuristics.SoonestBatch

    def decide(self, state, view, mask):
        forming = (view.phase == IDLE) & (view.waiting > 0) & mask
        join = argmin(-view.window_age, forming, state.counter, -view.waiting)
        spread = argmin(_outstanding(view), mask, state.counter)
        return jnp.where(forming.any(), join, spread), state


# ------------------------------------------------------------------------------------ production


@dataclass(frozen=True)
class SGLangCacheAware(JaxRouter):
    numpy_class: ClassVar = production.SGLangCacheAware
    params: ClassVar = ("cache_threshold", "balance_abs", "balance_rel")
    cache_threshold: float = production.SGLangCacheAware.cache_threshold
    balance_abs: float = production.SGLangCacheAware.balance_abs
    balance_rel: float = production.SGLangCacheAware.balance_rel

    def decide(self, state, view, mask):
        c = state.counter
        load = _outstanding(view)
        lo, hi = load.min(), load.max()  # over every worker, healthy or not
        imbalanced = (hi - lo > self.balance_abs) & (hi > self.balance_rel * lo)
        rate = _match_rate(view)
        best = argmin(-rate, mask, c)
        hit = rate[best] > self.cache_threshold
        smallest = argmin(view.cached_tokens, mask, c)
        least = argmin(load, mask, c)
        return jnp.where(imbalanced, least, jnp.where(hit, best, smallest)), state


@dataclass(frozen=True)
class DynamoKV(JaxRouter):
    """cost = w x (prefill tokens + uncached prompt) / block + kv_used + ceil(prompt / block),
    held as an exact float32 pair (see the module's note on exactness)."""

    numpy_class: ClassVar = production.DynamoKV
    params: ClassVar = ("overlap_weight",)
    overlap_weight: float = production.DynamoKV.overlap_weight

    def decide(self, state, view, mask):
        dtype = view.prefill_tokens.dtype
        block = jnp.maximum(view.block_size, 1).astype(dtype)
        uncached = jnp.maximum(view.prompt - view.hit_tokens, 0.0)
        prefill = (view.prefill_tokens + uncached) / block
        new_blocks = jnp.ceil(view.prompt / block)
        hi, lo = two_sum(view.kv_used.astype(dtype), self.overlap_weight * prefill + new_blocks)
        return argmin(hi, mask, state.counter, lo, view.cached_tokens), state


@dataclass(frozen=True)
class LLMD(JaxRouter):
    """score = 3 x prefix + 2 x (1 - KV usage) + 2 x queue (float32), the highest wins, ties to
    a uniform random key from JAX's PRNG (NumPy's generator in the NumPy router)."""

    numpy_class: ClassVar = production.LLMD
    exact: ClassVar[bool] = False
    params: ClassVar = ("weights",)
    weights: tuple[float, float, float] = production.LLMD.weights

    def decide(self, state, view, mask):
        dtype = view.hit_tokens.dtype
        block = jnp.maximum(view.block_size, 1).astype(dtype)
        total = jnp.maximum(jnp.ceil(view.prompt / block), 1.0)
        prefix = jnp.floor(view.hit_tokens / block) / total
        kv = 1.0 - view.kv_util
        q = jnp.where(mask, view.waiting, jnp.nan)
        qmax, qmin = jnp.nanmax(q), jnp.nanmin(q)
        spread = qmax - qmin
        queue = jnp.where(spread > 0, (qmax - view.waiting) / jnp.where(spread > 0, spread, 1.0), 1.0)
        wp, wk, wq = self.weights
        score = wp * prefix + wk * kv + wq * queue
        sub, state = self.draw(state)
        tie = jax.random.uniform(sub, score.shape, dtype)
        return argmin(-score, mask, state.counter, tie), state


def _calm_exact(running: jax.Array, mask: jax.Array, std_factor: float) -> tuple[jax.Array, jax.Array]:
    """(running <= mean + std over the masked nodes, exactly; whether the exact test applies).

    For integer counts r with n masked, d = n r - S: r <= mean + sample std iff d <= 0 or
    d^2 (n - 1) <= n sum_{i<j} (r_i - r_j)^2 (std_factor 1); int32 after shifting by the minimum,
    so it applies while (N - 1)^3 x range^2 stays below 2^31 (AIBrix only uses it when the range
    is at most its imbalance threshold)."""
    n_nodes = running.shape[0]
    integral = jnp.all(jnp.where(mask, (running == jnp.floor(running)) & (jnp.abs(running) < 2**24), True))
    lo = jnp.min(jnp.where(mask, running, jnp.inf))
    span = jnp.max(jnp.where(mask, running, -jnp.inf)) - lo
    bound = math.isqrt(2**31 // max((n_nodes - 1) ** 3 * n_nodes, 1)) - 1
    applies = integral & (span <= bound) & (std_factor == 1.0)
    x = jnp.where(mask & applies, running - jnp.where(applies, lo, 0.0), 0.0).astype(jnp.int32)
    m = mask.astype(jnp.int32)
    n = m.sum()
    s = (x * m).sum()
    pairs = (m[:, None] * m[None, :] * (x[:, None] - x[None, :]) ** 2).sum() // 2
    d = n * x - s
    calm = (d <= 0) | (d * d * jnp.maximum(n - 1, 0) <= n * pairs)
    return calm, applies


@dataclass(frozen=True)
class AIBrixPrefix(JaxRouter):
    numpy_class: ClassVar = production.AIBrixPrefix
    params: ClassVar = ("imbalance", "std_factor")
    imbalance: float = production.AIBrixPrefix.imbalance
    std_factor: float = production.AIBrixPrefix.std_factor

    def decide(self, state, view, mask):
        c = state.counter
        running = view.running
        r = jnp.where(mask, running, jnp.nan)
        imbalanced = jnp.nanmax(r) - jnp.nanmin(r) > self.imbalance
        least_running = argmin(running, mask, c)
        n = jnp.maximum(mask.sum(), 1).astype(running.dtype)
        mean = jnp.where(mask, running, 0.0).sum() / n
        var = jnp.where(mask, (running - mean) ** 2, 0.0).sum() / jnp.maximum(n - 1, 1)
        approx = running <= mean + self.std_factor * jnp.sqrt(var)
        exact, applies = _calm_exact(running, mask, self.std_factor)
        calm = mask & jnp.where(applies, exact, approx)  # sample std, as AIBrix
        calm = jnp.where(calm.any(), calm, mask)
        rate = jnp.where(calm, _match_rate(view), -1.0)
        best = argmin(-rate, calm, c)
        matched = rate.max() > 0
        least_requests = argmin(_outstanding(view), mask, c)
        return jnp.where(imbalanced, least_running, jnp.where(matched, best, least_requests)), state


# MD5 (RFC 1321) of one 64-byte block, on uint32 words, for the consistent-hash ring of prefix-hash.
_MD5_SHIFT = (7, 12, 17, 22) * 4 + (5, 9, 14, 20) * 4 + (4, 11, 16, 23) * 4 + (6, 10, 15, 21) * 4
_MD5_K = tuple(int(abs(math.sin(i + 1)) * 2**32) & 0xFFFFFFFF for i in range(64))
_MD5_INIT = (0x67452301, 0xEFCDAB89, 0x98BADCFE, 0x10325476)
_POW10 = tuple(10**k for k in range(10))


def _rotl(x: jax.Array, s: int) -> jax.Array:
    return (x << s) | (x >> (32 - s))


def _bswap(x: jax.Array) -> jax.Array:
    m = jnp.uint32(0xFF)
    return ((x & m) << 24) | (((x >> 8) & m) << 16) | (((x >> 16) & m) << 8) | (x >> 24)


def md5_prefix64(key: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The first 8 bytes of MD5(str(key)) as a big-endian 64-bit integer, as (high, low) uint32
    words, for an int32 `key` >= 0 (`int.from_bytes(hashlib.md5(str(key).encode()).digest()[:8],
    "big")`)."""
    key = jnp.maximum(jnp.asarray(key, jnp.int32), 0)
    length = 1 + sum((key >= p).astype(jnp.int32) for p in _POW10[1:])  # decimal digits
    pos = jnp.arange(64, dtype=jnp.int32)
    exponent = jnp.clip(length - 1 - pos, 0, 9)
    digit = (key // jnp.asarray(_POW10, jnp.int32)[exponent]) % 10
    byte = jnp.where(pos < length, 48 + digit, 0)
    byte = jnp.where(pos == length, 0x80, byte)
    byte = jnp.where(pos == 56, 8 * length, byte).astype(jnp.uint32)  # message bits (< 256)
    b = byte.reshape(16, 4)
    words = b[:, 0] | (b[:, 1] << 8) | (b[:, 2] << 16) | (b[:, 3] << 24)
    a, bb, c, d = (jnp.uint32(v) for v in _MD5_INIT)
    for i in range(64):
        if i < 16:
            f, g = (bb & c) | (~bb & d), i
        elif i < 32:
            f, g = (d & bb) | (~d & c), (5 * i + 1) % 16
        elif i < 48:
            f, g = bb ^ c ^ d, (3 * i + 5) % 16
        else:
            f, g = c ^ (bb | ~d), (7 * i) % 16
        f = f + a + jnp.uint32(_MD5_K[i]) + words[g]
        a, d, c = d, c, bb
        bb = bb + _rotl(f, _MD5_SHIFT[i])
    return _bswap(a + jnp.uint32(_MD5_INIT[0])), _bswap(bb + jnp.uint32(_MD5_INIT[1]))


@functools.lru_cache(maxsize=64)
def _ring(n_nodes: int, replicas: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The NumPy router's ring: (key high words, key low words, node) sorted by key."""
    points = sorted(
        (int.from_bytes(hashlib.md5(f"node-{n}-{r}".encode()).digest()[:8], "big"), n)
        for n in range(n_nodes)
        for r in range(replicas)
    )
    keys = np.array([p for p, _ in points], dtype=np.uint64)
    hi = (keys >> np.uint64(32)).astype(np.uint32)
    lo = (keys & np.uint64(0xFFFFFFFF)).astype(np.uint32)
    return hi, lo, np.array([n for _, n in points], dtype=np.int32)


@dataclass(frozen=True)
class PrefixHash(JaxRouter):
    """Consistent hashing of the first prefix chunk id on the MD5 ring (MD5 computed in JAX)."""

    numpy_class: ClassVar = production.PrefixHash
    params: ClassVar = ("replicas",)
    replicas: int = production.PrefixHash.replicas

    def decide(self, state, view, mask):
        n = mask.shape[0]
        ring_hi, ring_lo, ring_nodes = (jnp.asarray(x) for x in _ring(n, self.replicas))
        size = ring_nodes.shape[0]
        key = jnp.asarray(view.prefix_key, jnp.int32)
        h_hi, h_lo = md5_prefix64(key)
        start = ((ring_hi < h_hi) | ((ring_hi == h_hi) & (ring_lo <= h_lo))).sum()  # bisect_right
        order = ring_nodes[(start + jnp.arange(size)) % size]
        ok = mask[order]
        walked = jnp.where(ok.any(), order[jnp.argmax(ok)], ring_nodes[start % size])
        least = argmin(_outstanding(view), mask, state.counter)
        return jnp.where(key >= 0, walked, least), state


JAX_ROUTERS: dict[str, type[JaxRouter]] = {
    r.numpy_class.name: r
    for r in (
        RoundRobin,
        Random,
        LeastRequests,
        LeastTokens,
        PowerOfTwo,
        LeastKV,
        WeightedSkew,
        PackLoad,
        SoonestBatch,
        SGLangCacheAware,
        DynamoKV,
        LLMD,
        AIBrixPrefix,
        PrefixHash,
    )
}
_BY_CLASS: dict[type, type[JaxRouter]] = {r.numpy_class: r for r in JAX_ROUTERS.values()}


def make_jax_router(name: str, seed: int = 0, **params: Any) -> JaxRouter:
    """The JAX twin of the router called `name` (`agents.routers.ROUTERS`), with `params` overrides."""
    if name not in JAX_ROUTERS:
        raise ValueError(f"no JAX router {name!r}; JAX routers: {', '.join(JAX_ROUTERS)}")
    return JAX_ROUTERS[name](seed=seed, **params)


def twin(router: Any) -> JaxRouter | None:
    """The JAX twin of a NumPy router instance (its name, seed and parameters), or None when its
    class has none (a subclass that may change the rule, a custom router). A router with a
    `jax_router()` method (the learned policies, `agents.jax_ppo.JaxPolicyRouter`) gives its own,
    or None when it cannot be converted."""
    if callable(getattr(router, "jax_router", None)):
        return router.jax_router()
    cls = _BY_CLASS.get(type(router))
    if cls is None:
        return None
    fields = {f.name for f in dataclasses.fields(cls)}
    params = {p: _hashable(getattr(router, p)) for p in cls.params if p in fields}
    return cls(name=router.name, seed=int(getattr(router, "seed", 0)), **params)


def _hashable(x: Any) -> Any:
    if isinstance(x, (list, tuple, np.ndarray)):
        return tuple(float(v) for v in np.asarray(x).ravel())
    if isinstance(x, (np.floating, np.integer)):
        return x.item()
    return x
