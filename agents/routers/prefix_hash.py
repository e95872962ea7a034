"""The vLLM production stack's session affinity (`--routing-logic session`).

Restated from vllm-project/production-stack `src/vllm_router/routers/routing_logic.py`
`SessionRouter` (commit a6c01db0, 2026-08-05; chart vllm-stack-0.1.12): the session id is hashed
onto a consistent-hash ring of the endpoints (uhashring: MD5, ketama points); requests without a
session go to the endpoint of lowest QPS (fewest requests here).
"""

from __future__ import annotations

import functools
import hashlib
import math
from dataclasses import dataclass
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from agents.routers.base import Affinity, argmin, outstanding, rotation

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
    """The ring of `n_nodes` nodes with `replicas` points each, the point of replica r of node n at
    the first 8 bytes of MD5("node-n-r"): (key high words, key low words, node) sorted by key."""
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
class PrefixHash(Affinity):
    """The request's first prefix chunk id is the session key, hashed (MD5, in JAX) onto a
    consistent-hash ring with `replicas` points per node; a node marked full is skipped by walking
    the ring. Requests without a prefix go to the node with fewest requests. Pure affinity: the
    rule never looks at load."""

    name: ClassVar[str] = "prefix-hash"
    replicas: int = 64

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
        least = argmin(outstanding(view), mask, order=rotation(state.counter, n))
        return jnp.where(key >= 0, walked, least), state
