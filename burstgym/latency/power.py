"""Power that depends on the work: an energy roofline per GPU, composed per node.

Choi, Bedard, Fowler and Vuduc ("A roofline model of energy", IPDPS 2013) write the energy of a
kernel as a constant power over its duration plus a cost per FLOP and per byte moved:
``E = pi0 * T + eps_flop * W + eps_mem * Q``. At the two roofs that is a power above ``pi0`` of
``eps_mem x bandwidth`` while streaming and ``eps_flop x FLOP/s`` while computing. An LLM
iteration streams every weight once, moves each token's activations, reads the decoding
sequences' KV cache, does 2 x parameters FLOPs per token and the attention work of each (query,
key) pair, so its energy is affine in the quantities the simulator already tracks:

    energy = static_w * duration + iteration_j * iterations + token_j * tokens
             + kv_token_j * kv_tokens + pair_j * prefill_pairs,     capped at tdp_w * duration

(the board's power limit caps the average power). Because it is affine, a run of identical decode
iterations sums in closed form. Busy power, energy / duration, lies between ``static_w`` (at least
``idle_w``) and ``tdp_w``; memory-bound decode draws little more than the static power plus the
memory roof's share, compute-bound prefill approaches the cap. docs/latency.md gives the fit.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

import jax.numpy as jnp
from jax.typing import ArrayLike

from burstgym.latency.model import LatencyModel


class PowerModel(NamedTuple):
    """Per-node coefficients of `energy_j` (scalars, or [N] arrays stacked by the core)."""

    idle_w: ArrayLike  # awake, model loaded, no iteration running (all TP GPUs)
    tdp_w: ArrayLike  # board power limit of all TP GPUs: caps the average power of an iteration
    static_w: ArrayLike  # drawn while an iteration runs, before work-proportional energy (>= idle_w)
    iteration_j: ArrayLike  # per iteration: streaming every weight once from HBM
    token_j: ArrayLike  # per token in the pass: 2 x parameters FLOPs and its activation traffic
    kv_token_j: ArrayLike  # per KV entry read by decode attention
    pair_j: ArrayLike  # per prefill attention (query, key) pair


def energy_j(
    power: PowerModel,
    duration_s: ArrayLike,
    tokens: ArrayLike,
    kv_tokens: ArrayLike,
    prefill_pairs: ArrayLike,
    iterations: ArrayLike,
) -> jnp.ndarray:
    """Joules of `iterations` iterations that together take duration_s and process `tokens` tokens
    (prefill + decode), read kv_tokens KV entries and prefill_pairs attention pairs.

    Affine in every argument, then capped at ``tdp_w * duration_s``; JAX-traceable, broadcasts.
    """
    duration_s = jnp.asarray(duration_s, dtype=jnp.result_type(float))
    affine = (
        power.static_w * duration_s
        + power.iteration_j * jnp.asarray(iterations, dtype=duration_s.dtype)
        + power.token_j * jnp.asarray(tokens, dtype=duration_s.dtype)
        + power.kv_token_j * jnp.asarray(kv_tokens, dtype=duration_s.dtype)
        + power.pair_j * jnp.asarray(prefill_pairs, dtype=duration_s.dtype)
    )
    return jnp.minimum(power.tdp_w * duration_s, affine)


def busy_power_w(
    power: PowerModel,
    duration_s: ArrayLike,
    tokens: ArrayLike,
    kv_tokens: ArrayLike,
    prefill_pairs: ArrayLike,
    iterations: ArrayLike = 1,
) -> jnp.ndarray:
    """Average watts of the iterations (``energy_j / duration_s``); ``static_w`` for zero duration."""
    duration_s = jnp.asarray(duration_s, dtype=jnp.result_type(float))
    safe = jnp.where(duration_s > 0, duration_s, 1.0)
    watts = energy_j(power, safe, tokens, kv_tokens, prefill_pairs, iterations) / safe
    return jnp.where(duration_s > 0, watts, jnp.minimum(power.static_w, power.tdp_w))


def check_power_model(power: PowerModel, where: str) -> None:
    """Refuse coefficients that break the bounds: 0 <= idle <= static <= tdp, energies >= 0."""
    values = {k: float(v) for k, v in power._asdict().items()}
    for key, value in values.items():
        if not math.isfinite(value) or value < 0:
            raise ValueError(f"{where}: power.{key} must be a finite number >= 0, got {value!r}")
    if not values["idle_w"] <= values["static_w"] <= values["tdp_w"]:
        raise ValueError(
            f"{where}: power needs idle_w <= static_w <= tdp_w, got {values['idle_w']}, "
            f"{values['static_w']}, {values['tdp_w']}"
        )


@dataclass(frozen=True)
class GPUEnergy:
    """Energy-roofline constants of one GPU (per GPU, not per node)."""

    name: str
    idle_w: float  # awake with a model loaded, no kernels running
    tdp_w: float  # board power limit
    static_w: float  # while an iteration runs: clocks up and leakage, before any work
    joule_per_byte: float  # HBM traffic at the memory roof, J/B
    joule_per_flop: float  # tensor-core arithmetic at the compute roof, J/FLOP
    source: str = ""  # how the constants were obtained (fitted, derived, assumed)

    def roof_powers(self, rates: tuple[float, float]) -> tuple[float, float]:
        """Watts above static at the memory roof and at the compute roof, for effective rates
        ``rates`` = (bytes/s, FLOP/s) of the kernel fit."""
        return self.joule_per_byte * rates[0], self.joule_per_flop * rates[1]


def compose_power_model(
    energy: GPUEnergy, kernels: LatencyModel, tp: int, rates: tuple[float, float]
) -> PowerModel:
    """Per-node coefficients for a node whose kernel-only step time is ``kernels`` (TP ``tp``).

    Each rank draws ``static_w`` for the whole iteration, plus the memory-roof power while it
    streams (weights, KV cache, element-wise and all-reduce traffic) and the compute-roof power
    while it computes (GEMMs, attention pairs), for as long as the kernel model says each takes:
    energy per unit of work = roof power x the kernel model's seconds per unit. For weights and
    GEMMs this is exactly ``joule_per_byte x bytes`` and ``joule_per_flop x FLOPs``; attention
    kernels, which run below both roofs, are charged for their time. ``rates`` = (bytes/s, FLOP/s)
    the kernel fit runs at.
    """
    p_mem, p_comp = energy.roof_powers(rates)
    return PowerModel(
        idle_w=tp * energy.idle_w,
        tdp_w=tp * energy.tdp_w,
        static_w=tp * energy.static_w,
        iteration_j=tp * p_mem * float(kernels.weights_s),
        token_j=tp
        * (
            p_comp * float(kernels.token_s)
            + p_mem * (float(kernels.elementwise_token_s) + float(kernels.allreduce_token_s))
        ),
        kv_token_j=tp * p_mem * float(kernels.kv_token_s),
        pair_j=tp * p_comp * float(kernels.prefill_pair_s),
    )


def flat_power_model(idle_w: float, busy_w: float) -> PowerModel:
    """A node that draws ``busy_w`` whenever an iteration runs, whatever its work (no energy fit)."""
    busy_w = max(busy_w, idle_w)
    return PowerModel(idle_w, busy_w, busy_w, 0.0, 0.0, 0.0, 0.0)


def derive_energy(
    reference: GPUEnergy,
    reference_rates: tuple[float, float],
    name: str,
    tdp_w: float,
    idle_w: float,
    rates: tuple[float, float],
    source: str,
) -> GPUEnergy:
    """Carry a fitted energy roofline to another GPU by holding each roof's share of the TDP.

    The reference draws ``static_w`` while an iteration runs, plus `GPUEnergy.roof_powers` at its
    effective rates (``reference_rates``). The target keeps those three shares of its own TDP at its
    own effective rates (``rates``). An assumption, not a measurement: see docs/latency.md.
    """
    ref_mem, ref_comp = reference.roof_powers(reference_rates)
    scale = tdp_w / reference.tdp_w
    return GPUEnergy(
        name=name,
        idle_w=idle_w,
        tdp_w=tdp_w,
        static_w=max(reference.static_w * scale, idle_w),
        joule_per_byte=ref_mem * scale / rates[0],
        joule_per_flop=ref_comp * scale / rates[1],
        source=source,
    )
