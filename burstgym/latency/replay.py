"""Replay a request log through the simulator and compare predicted with measured latencies.

``python -m burstgym.calibrate replay LOG --profile NAME`` reads a log (`burstgym.latency.requestlog`),
sends its requests at their recorded times to one simulated node of the profile with the run's
settings (KV blocks, ``max_num_seqs``, ``max_num_batched_tokens``, block size, prefix caching), and
reports TTFT, ITL and E2E, measured and predicted: mean, p50, p90, p99 over the requests that
succeeded. ITL is per request ``(E2E - TTFT) / (output tokens - 1)`` (vLLM's TPOT; requests with one
output token have none). The simulator is the plain-Python reference (`burstgym.reference`), which
runs every iteration on its own, so a replay is exact to the model and needs no compilation.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from burstgym.latency.profiles import Profile
from burstgym.latency.requestlog import ServingLog

METRICS = ("ttft", "itl", "e2e")
STATISTICS = ("mean", "p50", "p90", "p99")
# vLLM's defaults for its OpenAI server (v0.11.0, burstgym.scenarios.vllm_batch_defaults) apply when a
# log states no setting; this is vLLM's KV block size.
DEFAULT_BLOCK_SIZE = 16


@dataclass(frozen=True)
class ReplaySettings:
    """The serving settings of the simulated node."""

    max_num_seqs: int
    max_num_batched_tokens: int
    block_size: int
    kv_blocks: int
    prefix_caching: bool = True
    prefix_tokens: int = 0  # tokens of a prompt prefix shared within a log's prefix group (0: none)

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "block_size", "kv_blocks"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value < 2**31:
                raise ValueError(f"{name} must be an integer in [1, 2^31), got {value!r}")
        if isinstance(self.prefix_tokens, bool) or not isinstance(self.prefix_tokens, int):
            raise ValueError(f"prefix_tokens must be an integer >= 0, got {self.prefix_tokens!r}")
        if self.prefix_tokens < 0:
            raise ValueError(f"prefix_tokens must be an integer >= 0, got {self.prefix_tokens!r}")


def replay_settings(
    log: ServingLog,
    profile: Profile,
    max_num_seqs: int | None = None,
    max_num_batched_tokens: int | None = None,
    block_size: int | None = None,
    kv_blocks: int | None = None,
    prefix_caching: bool = True,
    prefix_tokens: int | None = None,
) -> ReplaySettings:
    """Settings for replaying ``log``: each one given here, else the log's, else vLLM's default for
    the profile's GPU (KV blocks: the profile's KV capacity)."""
    from burstgym.scenarios import vllm_batch_defaults

    seqs, budget = vllm_batch_defaults(profile)
    s = log.server
    bs = block_size or s.block_size or DEFAULT_BLOCK_SIZE
    return ReplaySettings(
        max_num_seqs=max_num_seqs or s.max_num_seqs or seqs,
        max_num_batched_tokens=max_num_batched_tokens or s.max_num_batched_tokens or budget,
        block_size=bs,
        kv_blocks=kv_blocks or s.kv_blocks or profile.kv_capacity_tokens // bs,
        prefix_caching=prefix_caching,
        prefix_tokens=prefix_tokens if prefix_tokens is not None else (s.system_prompt_tokens or 0),
    )


def _stats(x: np.ndarray) -> dict[str, float]:
    x = x[np.isfinite(x)]
    if x.size == 0:
        return {k: math.nan for k in STATISTICS}
    p50, p90, p99 = np.percentile(x, [50, 90, 99])
    return {"mean": float(x.mean()), "p50": float(p50), "p90": float(p90), "p99": float(p99)}


def itl(ttft: np.ndarray, e2e: np.ndarray, output: np.ndarray) -> np.ndarray:
    """Per request (E2E - TTFT) / (output - 1); NaN where a request has fewer than two tokens."""
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(output > 1, (e2e - ttft) / np.maximum(output - 1, 1), np.nan)


@dataclass(frozen=True)
class ReplayResult:
    """Measured and predicted latencies of a replayed log, per request and summarised."""

    log: ServingLog
    settings: ReplaySettings
    profile: str
    engine: str
    ttft_s: np.ndarray  # [E] predicted (NaN for requests that failed in the log)
    e2e_s: np.ndarray  # [E] predicted

    def per_request(self) -> dict[str, dict[str, np.ndarray]]:
        """``{"measured"|"predicted": {"ttft"|"itl"|"e2e": [E]}}`` over the requests that succeeded."""
        ok = self.log.ok
        out = self.log.output_tokens[ok]
        sides = {
            "measured": (self.log.ttft_s[ok], self.log.e2e_s[ok]),
            "predicted": (self.ttft_s[ok], self.e2e_s[ok]),
        }
        return {side: {"ttft": t, "itl": itl(t, e, out), "e2e": e} for side, (t, e) in sides.items()}

    def summary(self) -> dict[str, dict[str, dict[str, float]]]:
        """``{"measured": {"ttft": {"mean": s, "p50": s, "p90": s, "p99": s}, "itl": ..., "e2e": ...},
        "predicted": {...}}`` in seconds."""
        return {side: {m: _stats(v[m]) for m in METRICS} for side, v in self.per_request().items()}

    def to_json(self) -> dict[str, Any]:
        """The summary with what was replayed and how."""
        return {
            **self.summary(),
            "log": {
                "source": self.log.source,
                "format": self.log.format,
                "requests": len(self.log),
                "succeeded": int(self.log.ok.sum()),
            },
            "profile": self.profile,
            "engine": self.engine,
            "settings": asdict(self.settings),
        }

    def table(self) -> str:
        """A text table of measured against predicted, milliseconds, with the relative error."""
        s = self.summary()
        lines = [f"{'metric':<6} {'stat':<5} {'measured ms':>12} {'predicted ms':>13} {'error':>8}"]
        for m in METRICS:
            for k in STATISTICS:
                meas, pred = s["measured"][m][k], s["predicted"][m][k]
                err = f"{100 * (pred / meas - 1):+7.1f}%" if meas > 0 else "       "
                lines.append(f"{m:<6} {k:<5} {1e3 * meas:>12.2f} {1e3 * pred:>13.2f} {err}")
        return "\n".join(lines)

    def plot(self, path: str | Path) -> None:
        """A PNG of the measured and predicted CDFs of TTFT, ITL and E2E."""
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        data = self.per_request()
        fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
        for ax, m in zip(axes, METRICS, strict=True):
            for side, style in (("measured", "-"), ("predicted", "--")):
                x = np.sort(1e3 * data[side][m][np.isfinite(data[side][m])])
                if x.size:
                    ax.plot(x, np.arange(1, x.size + 1) / x.size, style, label=side)
            ax.set_xlabel(f"{m.upper()} (ms)")
            ax.set_ylim(0, 1)
            ax.grid(alpha=0.3)
        axes[0].set_ylabel("fraction of requests")
        axes[0].legend(loc="lower right")
        fig.suptitle(f"{Path(self.log.source.split(' + ')[0]).name}: {self.profile}, engine {self.engine}")
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)


def _prefix_chunks(log: ServingLog, settings: ReplaySettings) -> dict[str, Any]:
    """Chunk ids for the reference simulator: the shared prefix of each request's group, in whole
    KV blocks (vLLM's prefix cache matches whole blocks), as one chunk named by the group."""
    grain = settings.prefix_tokens // settings.block_size * settings.block_size
    grouped = log.prefix_group >= 0
    if not settings.prefix_caching or grain == 0 or not grouped.any():
        return {}
    n_groups = int(log.prefix_group.max()) + 1
    ids = np.where(grouped & (log.prompt_tokens > grain), log.prefix_group, -1).reshape(-1, 1)
    return {
        "chunk_ids": ids,
        "id_tokens": log.prompt_tokens,
        "chunk_tokens": np.full(n_groups, grain),
        "grain": grain,
    }


def replay(log: ServingLog, profile: Profile, settings: ReplaySettings) -> ReplayResult:
    """Send every request of ``log`` at its recorded time to one simulated node of ``profile``.

    Requests that failed in the log are sent too (they loaded the server) with the output tokens
    the log counted (at least one), and left out of the statistics; a failed request whose prompt the
    log does not count is not sent.
    """
    from burstgym.reference import RefNode, simulate

    node = RefNode(
        "continuous",
        profile.latency,
        profile.power,
        max_num_seqs=settings.max_num_seqs,
        max_num_batched_tokens=settings.max_num_batched_tokens,
        block_size=settings.block_size,
        kv_blocks=settings.kv_blocks,
        queue_capacity=2**31 - 1,
        prefix_caching=settings.prefix_caching,
    )
    sent = log.prompt_tokens >= 1
    part = log.subset(sent)
    result = simulate(
        [node],
        part.arrival_s,
        part.prompt_tokens,
        np.maximum(part.output_tokens, 1),
        np.zeros(len(part), dtype=np.int64),
        **_prefix_chunks(part, settings),
    )
    ttft = np.full(len(log), np.nan)
    e2e = np.full(len(log), np.nan)
    ttft[sent] = np.where(part.ok, result.ttft, np.nan)
    e2e[sent] = np.where(part.ok, result.e2e_latency, np.nan)
    return ReplayResult(log, settings, profile.name, profile.engine, ttft, e2e)


def write_json(result: ReplayResult, path: str | Path) -> None:
    """Write `ReplayResult.to_json` to ``path``."""
    Path(path).write_text(json.dumps(result.to_json(), indent=2) + "\n")
