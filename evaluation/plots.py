"""Figures of an evaluation: latency CDFs, load shares per node, and the regime map. A regime-map
cell whose paired 95% CI includes zero is drawn hatched grey and gets no colour, so that it
cannot be read as a result."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402

from agents.rollout import Episodes  # noqa: E402


def plot_cdf(path: Path, scenario: str, results: dict[str, Episodes]) -> None:
    """End-to-end latency CDF of each router (served requests of all seeds), log x."""
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, ep in results.items():
        x = np.sort(ep.e2e[np.isfinite(ep.e2e)])
        ax.plot(x, np.arange(1, x.size + 1) / max(x.size, 1), label=name, lw=1.4)
    ax.set_xscale("log")
    ax.set_xlabel("end-to-end latency (s), served requests of all seeds")
    ax.set_ylabel("fraction of requests")
    ax.set_title(f"Latency CDF per router: {scenario}")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_share(path: Path, scenario: str, results: dict[str, Episodes]) -> None:
    """Share of the routed requests each node received, per router (dashed: an even split)."""
    names = list(results)
    share = np.array([np.mean(results[n].metrics["load_share"], axis=0) for n in names])
    fig, ax = plt.subplots(figsize=(max(7, len(names) * 0.9), 4.5))
    width = 0.8 / share.shape[1]
    for node in range(share.shape[1]):
        ax.bar(np.arange(len(names)) + node * width, share[:, node], width, label=f"node {node}")
    ax.axhline(1 / share.shape[1], color="k", lw=0.8, ls="--")
    ax.set_xticks(np.arange(len(names)) + 0.4 - width / 2, names, rotation=30, ha="right")
    ax.set_ylabel("share of routed requests")
    ax.set_title(f"Load share per node: {scenario}")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def regime_matrix(sub: pd.DataFrame) -> tuple[list[str], list[float], np.ndarray]:
    """Rows (burstiness / prefix sharing), columns (loads) and colour values of one batching regime's
    cells: the best skew-taking router's % change against the best balancing one, NaN (no colour)
    where the paired 95% CI includes zero, so that no such cell can be read as a result."""
    labels = list(
        dict.fromkeys(f"{a} / prefix {p}" for a, p in zip(sub["arrivals"], sub["prefix"], strict=True))
    )
    loads = sorted(set(sub["load"]))
    z = np.full((len(labels), len(loads)), np.nan)
    for _, r in sub.iterrows():
        if r["significant"]:
            z[labels.index(f"{r['arrivals']} / prefix {r['prefix']}"), loads.index(r["load"])] = r[
                "skew_vs_balancing_pct"
            ]
    return labels, loads, z


def plot_regime(path: Path, df: pd.DataFrame) -> None:
    """One panel per batching regime (`regime_matrix`); cells whose CI includes zero are hatched grey."""
    schedulers = list(dict.fromkeys(df["scheduler"]))
    panels = {s: regime_matrix(df[df["scheduler"] == s]) for s in schedulers}
    height = max(3.8, 0.6 * max(len(p[0]) for p in panels.values()) + 1.5)
    fig, axes = plt.subplots(1, len(schedulers), figsize=(5.8 * len(schedulers), height), squeeze=False)
    values = np.concatenate([p[2].ravel() for p in panels.values()])
    lim = max(1.0, float(np.nanmax(np.abs(values)))) if np.isfinite(values).any() else 1.0
    im = None
    for ax, sched in zip(axes[0], schedulers, strict=True):
        labels, loads, z = panels[sched]
        for _, r in df[df["scheduler"] == sched].iterrows():
            i, j = labels.index(f"{r['arrivals']} / prefix {r['prefix']}"), loads.index(r["load"])
            pct, ci = r["skew_vs_balancing_pct"], r["ci_pct"]
            if not r["significant"]:
                hatch = plt.Rectangle((j - 0.5, i - 0.5), 1, 1, facecolor="0.85", hatch="//", edgecolor="0.6")
                ax.add_patch(hatch)
            text = f"{r['best_skew']}\n{pct:+.1f}% ±{ci:.1f}" + ("" if r["significant"] else "\nn.s.")
            dark = r["significant"] and abs(pct) > lim / 2
            ax.text(j, i, text, ha="center", va="center", fontsize=6.5, color="w" if dark else "k")
        im = ax.imshow(z, cmap="RdBu_r", vmin=-lim, vmax=lim, aspect="auto")
        ax.set_xlim(-0.5, len(loads) - 0.5)
        ax.set_ylim(len(labels) - 0.5, -0.5)
        ax.set_xticks(range(len(loads)), [f"{v:g}" for v in loads])
        ax.set_yticks(range(len(labels)), labels, fontsize=8)
        ax.set_xlabel("load (fraction of capacity)")
        ax.set_title(f"{sched} batching")
    fig.colorbar(
        im, ax=axes[0].tolist(), label="best skew-taking vs best balancing router: objective change (%)"
    )
    fig.suptitle(
        "Blue: skew pays; red: skew hurts; hatched grey: paired 95% CI includes 0 (no result)", fontsize=9
    )
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)
