"""The report of an evaluation: the markdown table, and the results folder it is written into.

`ResultsFolder` is checked before any work (a `--out` that cannot be written, that is a file, or
that holds files `evaluate.py` did not write is refused at once, not after the evaluation). The
results are written into a staging folder beside it and renamed into place only when complete,
replacing a previous evaluation's folder as a whole (no stale file of an earlier run stays
beside new ones); `results.json` says which run wrote them (`run`: id, start and end, command).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import uuid
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

RECORD = "results.json"  # written last; its "run" block marks the folder as evaluate.py's


def markdown(df: pd.DataFrame, lines: list[str], run: dict[str, Any] | None = None) -> str:
    """The results table of every scenario (mean ± 95% CI, paired change against round-robin)
    and the summary lines."""

    def fmt(m: float, h: float, digits: int = 3) -> str:
        return f"{m:.{digits}f} ± {h:.{digits}f}" if np.isfinite(h) else f"{m:.{digits}f}"

    out = ["# Router evaluation", ""]
    if run is not None:
        out += [f"Run `{run['id']}`, {run['started']} to {run['finished']}: `{' '.join(run['command'])}`", ""]
    out += [
        "Mean ± 95% CI over seeds (common random numbers across routers). "
        "Objective: total latency + drop penalty + energy term (s), lower is better; "
        "Δ vs RR: paired difference against round-robin over the same seeds (objective; TTFT mean). "
        "Percentiles (p50, p99) pool the served requests of all seeds; their CIs are bootstrap CIs "
        'resampling seeds. "unresolved": the paired CI stayed wider than --ci-width after --max-seeds seeds.',
        "",
    ]
    for scenario, sub in df.groupby("scenario", sort=False):
        out += [
            f"## {scenario}",
            "",
            "| router | objective | Δ vs RR (paired) | TTFT mean (s) | Δ TTFT vs RR (s) | TTFT p99 (s) "
            "| e2e p50 (s) | e2e p99 (s) | SLO att. | drop rate | cache hit | J/request | skew |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for _, r in sub.iterrows():
            cells = [
                r["router"],
                fmt(r["objective"], r["objective_ci"], 1),
                f"{r['vs_rr_pct']:+.2f}% ({fmt(r['vs_rr'], r['vs_rr_ci'], 1)})"
                + ("" if r.get("resolved", True) else " unresolved"),
                fmt(r["ttft_mean"], r["ttft_mean_ci"]),
                fmt(r["ttft_mean_vs_rr"], r["ttft_mean_vs_rr_ci"]),
                *(
                    fmt(r[m], r[f"{m}_ci"])
                    for m in (
                        "ttft_p99",
                        "e2e_p50",
                        "e2e_p99",
                        "slo_attainment",
                        "drop_rate",
                        "cache_hit_rate",
                    )
                ),
                fmt(r["energy_per_request_j"], r["energy_per_request_j_ci"], 1),
                fmt(r["skew_index"], r["skew_index_ci"]),
            ]
            out.append("| " + " | ".join(cells) + " |")
        out.append("")
    out += ["## Summary", ""] + [f"- {line}" for line in lines] + [""]
    return "\n".join(out)


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def _commit() -> str | None:
    """The git commit of the working tree evaluate.py runs from, if it is a git checkout."""
    try:
        root = Path(__file__).resolve().parents[1]
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, timeout=10
        )
        return out.stdout.strip() or None if out.returncode == 0 else None
    except (OSError, subprocess.SubprocessError):
        return None


class ResultsFolder:
    """The folder `out` an evaluation writes, checked when made (before any work) and written whole.

    :param out: the results folder (`--out`).
    :param command: the command line to record (default: this process's).
    """

    def __init__(self, out: str | Path, command: list[str] | None = None):
        self.out = Path(out)
        if self.out.exists() and not self.out.is_dir():
            raise ValueError(f"--out {self.out}: exists and is not a folder")
        if self.out.is_dir() and any(self.out.iterdir()) and written_by(self.out) is None:
            raise ValueError(
                f"--out {self.out}: holds files evaluate.py did not write (no {RECORD} with a run "
                "record); give a new or empty folder"
            )
        parent = self.out.parent
        try:
            parent.mkdir(parents=True, exist_ok=True)
            self.staging = Path(tempfile.mkdtemp(prefix=f".{self.out.name}.partial-", dir=parent))
        except OSError as e:
            raise ValueError(f"--out {self.out}: cannot write into {parent}: {e.strerror or e}") from e
        self.run = {
            "id": uuid.uuid4().hex,
            "started": _now(),
            "finished": None,
            "command": list(sys.argv if command is None else command),
            "commit": _commit(),
        }

    def path(self, name: str) -> Path:
        """Where to write the file `name` (in the staging folder until `publish`)."""
        return self.staging / name

    def finish(self) -> dict[str, Any]:
        """The run record, its end time set now (for the files written before `publish`)."""
        self.run["finished"] = _now()
        return self.run

    def publish(self, record: dict[str, Any]) -> dict[str, Any]:
        """Write `record` (with the run) as results.json, then put the staging folder in place of
        `out`, replacing a previous evaluation's folder as a whole. Returns the run record."""
        if self.run["finished"] is None:
            self.finish()
        record = {"run": self.run, **record}
        self.path(RECORD).write_text(json.dumps(record, indent=2, default=float))
        old = None
        if self.out.exists():
            old = self.out.with_name(f".{self.out.name}.old-{self.run['id']}")
            os.rename(self.out, old)
        os.rename(self.staging, self.out)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
        return self.run

    def discard(self) -> None:
        """Remove the staging folder (the evaluation failed or was interrupted)."""
        shutil.rmtree(self.staging, ignore_errors=True)


def written_by(folder: Path) -> dict[str, Any] | None:
    """The run record of a folder evaluate.py wrote ({} for one written before runs were
    recorded: its results.json says "complete"), or None for any other folder."""
    try:
        record = json.loads((folder / RECORD).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(record, dict):
        return None
    run = record.get("run")
    if isinstance(run, dict) and "id" in run:
        return run
    return {} if record.get("complete") is True else None
