"""The inference-sim (BLIS) training runs: real vLLM runs on H100 replayed request by request.

Data: a checkout of github.com/inference-sim/training at commit ab8e76b (``git clone`` it, then
``git checkout ab8e76b``): ``replay_data/<run>.json`` (the requests and the server's settings),
``replay_data/<run>_ground_truth.json`` (measured TTFT and E2E per request) and
``default_args/<run>/profile.yaml`` (inference-perf's client settings). 16 runs of vLLM v0.15.1 on
H100: Llama-2-7B TP1, CodeLlama-34B TP2, Llama-2-70B TP4 and Mixtral-8x7B TP2, each with four
workloads (codegen, roleplay, general, reasoning); Poisson arrivals in one or two stages of fixed
rate. Nothing of it is copied into the project: `burstgym.latency.validate` and
``scripts/fit_serving_engine.py`` read it from where it lies.

What the replay takes from a run beyond its replay file (docs/latency.md, "Validation on real vLLM
runs"):

- output tokens: the clients sent ``ignore_eos`` with ``max_tokens`` = the profile's ``output_len``,
  so every request generated that many tokens; the replay file's ``output_tokens`` is the client's
  re-tokenised count of the streamed text and is short for many requests (0 to 30 tokens for 25-35%
  of the Llama-2-7B requests) whose decode time equals the full-length ones';
- shared prefixes: each prompt begins with one of ``num_unique_system_prompts`` system prompts of
  ``system_prompt_len`` tokens, which vLLM's prefix cache serves after first use; the replay file
  leaves ``prefix_group`` empty, so requests are assigned to the groups in turn (after the first
  request of each, every request finds its system prompt cached, whichever group it is in).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from burstgym.latency.fitlogs import MIN_WINDOW_REQUESTS, LogCase
from burstgym.latency.profiles import Profile, load_profile
from burstgym.latency.replay import replay_settings
from burstgym.latency.requestlog import ServingLog, read_inference_sim

COMMIT = "ab8e76b"
# Hugging Face model ids of the runs -> burstgym model names (burstgym/models/).
MODELS = {
    "meta-llama/Llama-2-7b-hf": "llama-2-7b",
    "meta-llama/Llama-2-70b-hf": "llama-2-70b",
    "codellama/CodeLlama-34b-Instruct-hf": "codellama-34b",
    "mistralai/Mixtral-8x7B-v0.1": "mixtral-8x7b",
}
FIT_MODELS = ("llama-2-7b", "codellama-34b")  # the runs the shipped engine is fitted on; others held out
GPU = "h100"
SATURATED_TTFT_S = 1.0  # a run whose mean TTFT passes this (or with failed requests) is saturated


@dataclass(frozen=True)
class BlisRun:
    """One run: its replay log (output tokens and prefix groups as the client sent them)."""

    name: str
    model: str  # burstgym model name
    tp: int
    log: ServingLog
    output_len: int
    stages: tuple[tuple[float, float], ...]  # (rate req/s, seconds) of each load stage

    @property
    def profile_name(self) -> str:
        return f"{GPU}-{self.model}-tp{self.tp}"

    @property
    def workload(self) -> str:
        return self.name.rsplit("-", 1)[-1]

    @property
    def fitted(self) -> bool:
        """The run's model is one the shipped engine is fitted on."""
        return self.model in FIT_MODELS

    @property
    def saturated(self) -> bool:
        """Requests timed out, or the queue grew through the run (mean TTFT over a second)."""
        return bool((~self.log.ok).any()) or float(np.nanmean(self.log.ttft_s)) > SATURATED_TTFT_S

    def stage(self) -> np.ndarray:
        """The load stage of each request."""
        ends = np.cumsum([d for _, d in self.stages])
        return np.minimum(np.searchsorted(ends, self.log.arrival_s, side="right"), len(self.stages) - 1)

    def case(self, profile: Profile | None = None, seconds_per_stage: float | None = None) -> LogCase:
        """The run as a fit/replay case: scored in two windows per stage (halves of the stage, or of
        its first ``seconds_per_stage`` seconds, the rest of the stage left out of the log)."""
        profile = profile or load_profile(self.profile_name)
        log = self.log
        stage = self.stage()
        starts = np.concatenate([[0.0], np.cumsum([d for _, d in self.stages])[:-1]])
        into = log.arrival_s - starts[stage]
        span = np.array([d for _, d in self.stages])[stage]
        if seconds_per_stage is not None:
            span = np.minimum(span, seconds_per_stage)
            keep = into < span
            log, stage, into, span = log.subset(keep), stage[keep], into[keep], span[keep]
        window = 2 * stage + (into >= span / 2)
        window = np.where(log.ok & (log.output_tokens > 1), window, -1)
        for k in np.unique(window[window >= 0]):
            if (window == k).sum() < MIN_WINDOW_REQUESTS:
                window = np.where(window == k, -1, window)
        return LogCase(log, profile, replay_settings(log, profile), window)


def run_names(root: str | Path) -> list[str]:
    """The runs of a checkout: every ``replay_data/<run>.json`` with its ground truth beside it."""
    folder = Path(root) / "replay_data"
    if not folder.is_dir():
        raise ValueError(f"{root}: no replay_data/ folder (a checkout of inference-sim/training at {COMMIT})")
    return sorted(p.stem for p in folder.glob("*.json") if (folder / f"{p.stem}_ground_truth.json").exists())


def load_run(root: str | Path, name: str) -> BlisRun:
    """Read run ``name`` of the checkout at ``root``."""
    root = Path(root)
    replay_file = root / "replay_data" / f"{name}.json"
    data = json.loads(replay_file.read_text())
    model_id = data.get("model_id")
    if model_id not in MODELS:
        raise ValueError(f"{replay_file}: field 'model_id': {model_id!r} is not one of {', '.join(MODELS)}")
    profile_file = root / "default_args" / name / "profile.yaml"
    if not profile_file.exists():
        raise ValueError(f"{profile_file}: no such file (the run's inference-perf profile)")
    client: dict[str, Any] = yaml.safe_load(profile_file.read_text())
    shared = client["data"]["shared_prefix"]
    if not client.get("server", {}).get("ignore_eos"):
        raise ValueError(f"{profile_file}: the run did not use ignore_eos; its output lengths are unknown")
    log = read_inference_sim(replay_file, root / "replay_data" / f"{name}_ground_truth.json")
    groups = int(shared["num_unique_system_prompts"])
    log = replace(
        log.with_output_tokens(int(shared["output_len"])),
        prefix_group=np.arange(len(log)) % groups,
        server=replace(log.server, system_prompt_tokens=int(shared["system_prompt_len"])),
    )
    stages = tuple((float(s["rate"]), float(s["duration"])) for s in client["load"]["stages"])
    return BlisRun(
        name=name,
        model=MODELS[model_id],
        tp=int(data["config"]["tensor_parallelism"]),
        log=log,
        output_len=int(shared["output_len"]),
        stages=stages,
    )


def load_runs(root: str | Path) -> list[BlisRun]:
    """Every run of the checkout at ``root``."""
    return [load_run(root, name) for name in run_names(root)]


# BLIS's own predictions of these runs' means, where published: the golden values of its
# trained-physics latency model (iteration 29) in inference-sim/inference-sim at f90a1e3,
# testdata/trained_physics_iter29.json ("ttft_mean_ms", "e2e_mean_ms", "itl_mean_ms"; BLIS generates
# the run's workload from its inference-perf profile, seed 42). Its ITL is measured against the
# client's own token counts (the replay files' ``output_tokens``), so it is compared with that.
BLIS_TRAINED_PHYSICS = {
    "20260217-155451-llama-2-7b-tp1-codegen": {"ttft": 32.09e-3, "itl": 10.097e-3, "e2e": 2.5167},
    "20260217-162547-llama-2-7b-tp1-roleplay": {"ttft": 32.04e-3, "itl": 9.594e-3, "e2e": 2.4313},
    "20260217-231439-llama-2-7b-tp1-general": {"ttft": 37.23e-3, "itl": 12.407e-3, "e2e": 3.1025},
}
BLIS_SOURCE = "inference-sim/inference-sim@f90a1e3 testdata/trained_physics_iter29.json"


def blis_errors(root: str | Path, run: BlisRun) -> dict[str, float] | None:
    """BLIS's published error on ``run`` (None where it published no prediction of it)."""
    pred = BLIS_TRAINED_PHYSICS.get(run.name)
    if pred is None:
        return None
    raw = read_inference_sim(
        Path(root) / "replay_data" / f"{run.name}.json",
        Path(root) / "replay_data" / f"{run.name}_ground_truth.json",
    )
    ok = raw.ok & (raw.output_tokens > 1)
    measured = {
        "ttft": float(np.mean(raw.ttft_s[raw.ok])),
        "e2e": float(np.mean(raw.e2e_s[raw.ok])),
        # BLIS's ITL: the gaps between the tokens the client counted, over all of them
        "itl": float(np.sum(raw.e2e_s[ok] - raw.ttft_s[ok]) / np.sum(raw.output_tokens[ok] - 1)),
    }
    return {k: pred[k] / measured[k] - 1 for k in measured}


def validate_runs(
    root: str | Path, engine: str, jobs: int | None = None, runs: list[BlisRun] | None = None
) -> list[dict[str, Any]]:
    """Replay every run (whole, every request) with its H100 profile composed with ``engine``:
    measured and predicted mean TTFT, ITL and E2E over the requests that succeeded."""
    import os

    from burstgym.latency.fitlogs import Replayer, summary_errors
    from burstgym.latency.profiles import with_engine

    runs = runs if runs is not None else load_runs(root)
    cases = [r.case(with_engine(load_profile(r.profile_name), engine)) for r in runs]
    for i, c in enumerate(cases):  # score every successful request, not the windows of a fit
        cases[i] = replace(c, window=np.where(c.log.ok & (c.log.output_tokens > 1), 0, -1))
    replayer = Replayer(jobs if jobs is not None else min(os.cpu_count() or 1, len(cases)))
    try:
        out = replayer([(c, c.profile.engine_terms) for c in cases])
    finally:
        replayer.close()
    return [
        {
            "run": r.name,
            "profile": c.profile.name,
            "fitted": r.fitted and not r.saturated,
            "saturated": r.saturated,
            **summary_errors(c, ttft, e2e),
            "blis": blis_errors(root, r),
        }
        for r, c, (ttft, e2e) in zip(runs, cases, out, strict=True)
    ]


def table(rows: list[dict[str, Any]]) -> str:
    """The validation table (markdown): per run, measured -> predicted mean TTFT / ITL / E2E with the
    error, BLIS's published errors where they exist, and the medians of the held-out unsaturated runs."""
    lines = [
        "| run | role | TTFT ms | ITL ms | E2E ms | BLIS TTFT / ITL / E2E |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        role = "saturated" if r["saturated"] else ("fitted" if r["fitted"] else "held out")
        cells = [
            f"{1e3 * r['measured'][m]:.1f} -> {1e3 * r['predicted'][m]:.1f} ({100 * r['error'][m]:+.1f}%)"
            for m in ("ttft", "itl", "e2e")
        ]
        blis = r["blis"]
        blis_cell = (
            " / ".join(f"{100 * blis[m]:+.1f}%" for m in ("ttft", "itl", "e2e")) if blis else "not published"
        )
        lines.append(f"| {r['run'][16:]} | {role} | " + " | ".join(cells) + f" | {blis_cell} |")
    for role, pick in (
        ("held out, unsaturated", lambda r: not r["fitted"] and not r["saturated"]),
        ("fitted", lambda r: r["fitted"]),
    ):
        chosen = [r for r in rows if pick(r)]
        if chosen:
            med = {m: float(np.median([abs(r["error"][m]) for r in chosen])) for m in ("ttft", "itl", "e2e")}
            worst = {m: float(np.max([abs(r["error"][m]) for r in chosen])) for m in ("ttft", "itl", "e2e")}
            lines.append(
                f"| median / worst, {role} ({len(chosen)} runs) | | "
                + " | ".join(f"{100 * med[m]:.1f}% / {100 * worst[m]:.1f}%" for m in ("ttft", "itl", "e2e"))
                + " | |"
            )
    return "\n".join(lines)
