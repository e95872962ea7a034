"""Fit a serving engine to request logs: ``python -m burstgym.calibrate fit-logs``.

Users have request logs, not kernel timings. Each log is replayed through the simulator
(`burstgym.latency.replay`) on its base profile (the GPU's kernel fit and the model's architecture);
the engine terms (`burstgym.latency.engines.EngineTerms`) that the kernels do not give -- the
per-iteration overhead, the per-request front-end latency, how the engine's kernels run against the
profiled ones -- are chosen so that predicted mean TTFT and mean ITL match the measured ones in
every time window of every log (least squares on the log of the ratio, Levenberg-Marquardt with a
finite-difference Jacobian; each evaluation replays every log, in parallel processes). Terms a set of
logs cannot determine are left out: all-reduce terms without a log above TP1.

Cross-validation, reported by the tool: with two or more logs each is left out in turn, the terms
refitted on the others and the left-out log predicted; with one log the terms are fitted on the first
half of its windows and the second half predicted. The result is an engine calibration (a JSON that
`load_engine` and ``load_profile(..., engine=path)`` read) and the base profile composed with it (a
JSON that ``gym.make(..., profile=path)`` takes).
"""

from __future__ import annotations

import datetime as dt
import math
import multiprocessing
import os
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any

import numpy as np

from burstgym.latency.engines import Engine, EngineTerms
from burstgym.latency.profiles import Profile, with_engine
from burstgym.latency.replay import ReplaySettings, itl, replay
from burstgym.latency.requestlog import ServingLog

# Terms fit-logs may fit, with the interval each is searched in (all positive: fitted in log space).
BOUNDS: dict[str, tuple[float, float]] = {
    "overhead_s": (1e-6, 0.05),
    "overhead_seq_s": (1e-8, 1e-3),
    "frontend_s": (1e-5, 0.2),
    "layer_factor": (0.01, 3.0),
    "elementwise_factor": (0.01, 3.0),
    "compute_factor": (0.3, 3.0),
    "weights_factor": (0.3, 3.0),
    "allreduce_step_s": (1e-8, 1e-4),
    "allreduce_bw_factor": (0.01, 10.0),
}
# Terms that move latencies without changing the schedule: their Jacobian needs no replay.
SHIFTS = ("frontend_s",)
# Starting values of terms the base engine leaves at zero (log space cannot start at zero).
START = {"overhead_s": 1e-3, "overhead_seq_s": 1e-5, "frontend_s": 5e-3, "allreduce_step_s": 2e-6}
TP_TERMS = ("allreduce_step_s", "allreduce_bw_factor")
DEFAULT_WINDOWS = 4
MIN_WINDOW_REQUESTS = 20


@dataclass(frozen=True)
class LogCase:
    """One log to replay on one base profile, with the time window each request is scored in."""

    log: ServingLog
    profile: Profile
    settings: ReplaySettings
    window: np.ndarray  # [E] int, the window of each request (-1: not scored)

    @property
    def name(self) -> str:
        return self.log.source.split(" + ")[0]


def log_case(log: ServingLog, profile: Profile, settings: ReplaySettings, windows: int) -> LogCase:
    """A case whose successful requests are scored in ``windows`` windows of equal duration (a
    window with fewer than `MIN_WINDOW_REQUESTS` successful requests is not scored)."""
    if isinstance(windows, bool) or not isinstance(windows, int) or windows < 1:
        raise ValueError(f"windows must be a positive integer, got {windows!r}")
    span = float(log.arrival_s[-1]) or 1.0
    w = np.minimum((log.arrival_s / span * windows).astype(np.int64), windows - 1)
    w = np.where(log.ok & (log.output_tokens > 1), w, -1)
    for k in range(windows):
        if (w == k).sum() < MIN_WINDOW_REQUESTS:
            w = np.where(w == k, -1, w)
    if (w < 0).all():
        raise ValueError(
            f"{log.source}: fewer than {MIN_WINDOW_REQUESTS} successful requests with two or more tokens"
        )
    return LogCase(log, profile, settings, w)


def _gpu_key(profile: Profile) -> str:
    return profile.gpu.name.split("-")[0].lower()


def engine_of(terms: EngineTerms, gpu_key: str, name: str = "fitted") -> Engine:
    """An engine with ``terms`` for GPU family ``gpu_key``."""
    return Engine(name=name, description="fitted to request logs", gpus={gpu_key: terms}, default_gpu=gpu_key)


def _replay_job(job: tuple[LogCase, EngineTerms]) -> tuple[np.ndarray, np.ndarray]:
    case, terms = job
    profile = with_engine(case.profile, engine_of(terms, _gpu_key(case.profile)))
    result = replay(case.log, profile, case.settings)
    return result.ttft_s, result.e2e_s


class Replayer:
    """Replays cases under many sets of terms, in ``jobs`` worker processes (1: in this one)."""

    def __init__(self, jobs: int):
        self.jobs = max(1, int(jobs))
        self._pool = None
        if self.jobs > 1:
            self._pool = multiprocessing.get_context("spawn").Pool(self.jobs)

    def __call__(self, work: list[tuple[LogCase, EngineTerms]]) -> list[tuple[np.ndarray, np.ndarray]]:
        if self._pool is None:
            return [_replay_job(w) for w in work]
        return self._pool.map(_replay_job, work, chunksize=1)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.close()
            self._pool.join()
            self._pool = None


def window_means(case: LogCase, ttft: np.ndarray, e2e: np.ndarray) -> dict[str, np.ndarray]:
    """Per scored window: measured and predicted mean TTFT and mean ITL (seconds)."""
    out = case.log.output_tokens
    windows = sorted(set(case.window[case.window >= 0].tolist()))
    meas_itl = itl(case.log.ttft_s, case.log.e2e_s, out)
    pred_itl = itl(ttft, e2e, out)
    rows = {k: [] for k in ("meas_ttft", "pred_ttft", "meas_itl", "pred_itl")}
    for k in windows:
        m = case.window == k
        rows["meas_ttft"].append(np.mean(case.log.ttft_s[m]))
        rows["pred_ttft"].append(np.mean(ttft[m]))
        rows["meas_itl"].append(np.mean(meas_itl[m]))
        rows["pred_itl"].append(np.mean(pred_itl[m]))
    return {k: np.asarray(v) for k, v in rows.items()}


def _residuals(means: dict[str, np.ndarray], shift: float, use: np.ndarray) -> np.ndarray:
    """log(predicted / measured) of mean TTFT (with ``shift`` more front end) and mean ITL."""
    r_ttft = np.log((means["pred_ttft"] + shift) / means["meas_ttft"])
    r_itl = np.log(means["pred_itl"] / means["meas_itl"])
    return np.concatenate([r_ttft[use], r_itl[use]])


@dataclass
class _Problem:
    cases: list[LogCase]
    base: list[EngineTerms]  # per case: its starting terms (the base engine's, for its GPU)
    free: list[str]
    use: list[np.ndarray]  # per case: which windows enter the fit
    replayer: Replayer

    def terms(self, case: int, x: np.ndarray) -> EngineTerms:
        return replace(self.base[case], **{k: float(math.exp(v)) for k, v in zip(self.free, x, strict=True)})

    def evaluate(self, xs: list[np.ndarray]) -> list[list[dict[str, np.ndarray]]]:
        """Window means of every case under every parameter vector in ``xs``."""
        work = [(c, self.terms(i, x)) for x in xs for i, c in enumerate(self.cases)]
        out = self.replayer(work)
        n = len(self.cases)
        return [[window_means(self.cases[i], *out[j * n + i]) for i in range(n)] for j in range(len(xs))]

    def residuals(self, means: list[dict[str, np.ndarray]]) -> np.ndarray:
        return np.concatenate([_residuals(m, 0.0, u) for m, u in zip(means, self.use, strict=True)])


def _levenberg_marquardt(
    p: _Problem, x0: np.ndarray, lo: np.ndarray, hi: np.ndarray, iterations: int, log: Callable[[str], None]
) -> tuple[np.ndarray, list[dict[str, np.ndarray]]]:
    """Minimise the sum of squared residuals over ``x`` (log terms) within [lo, hi]."""
    x = np.clip(x0, lo, hi)
    means = p.evaluate([x])[0]
    r = p.residuals(means)
    lam = 1e-2
    shift_cols = [j for j, k in enumerate(p.free) if k in SHIFTS]
    for it in range(iterations):
        step = 0.05
        probes, cols = [], []
        for j in range(len(x)):
            if j in shift_cols:
                continue
            xp = x.copy()
            xp[j] = x[j] + step if x[j] + step <= hi[j] else x[j] - step
            probes.append(xp)
            cols.append(j)
        jac = np.zeros((len(r), len(x)))
        for j, m in zip(cols, p.evaluate(probes) if probes else [], strict=True):
            jac[:, j] = (p.residuals(m) - r) / (probes[cols.index(j)][j] - x[j])
        for j in shift_cols:
            # d/dlog(f) of log(pred_ttft + f' / meas): f' = f exp(dx) -> f / (pred_ttft)
            f = math.exp(x[j])
            jac[:, j] = np.concatenate(
                [
                    np.concatenate([f / m["pred_ttft"][u], np.zeros(u.sum())])
                    for m, u in zip(means, p.use, strict=True)
                ]
            )
        cost = float(r @ r)
        improved = False
        while lam < 1e4:
            a = jac.T @ jac
            dx = -np.linalg.solve(a + lam * np.diag(np.diag(a) + 1e-12), jac.T @ r)
            xn = np.clip(x + dx, lo, hi)
            mn = p.evaluate([xn])[0]
            rn = p.residuals(mn)
            if float(rn @ rn) < cost:
                x, r, means, lam, improved = xn, rn, mn, max(lam / 3, 1e-5), True
                break
            lam *= 4
        log(
            f"  iteration {it + 1}: rms log error {math.sqrt(float(r @ r) / len(r)):.4f}; "
            + ", ".join(f"{k}={math.exp(v):.4g}" for k, v in zip(p.free, x, strict=True))
        )
        if not improved or float(np.abs(dx).max()) < 1e-3:
            break
    return x, means


def _log_mape(means: dict[str, np.ndarray], use: np.ndarray) -> dict[str, float]:
    """Mean absolute relative error of the window means (TTFT, ITL) over ``use``."""
    return {
        k: float(np.mean(np.abs(means[f"pred_{k}"][use] / means[f"meas_{k}"][use] - 1)))
        if use.any()
        else math.nan
        for k in ("ttft", "itl")
    }


def summary_errors(case: LogCase, ttft: np.ndarray, e2e: np.ndarray) -> dict[str, Any]:
    """Measured and predicted mean TTFT, ITL and E2E over the scored requests, and their errors."""
    m = case.window >= 0
    out = case.log.output_tokens[m]
    meas = {
        "ttft": float(np.mean(case.log.ttft_s[m])),
        "itl": float(np.nanmean(itl(case.log.ttft_s[m], case.log.e2e_s[m], out))),
        "e2e": float(np.mean(case.log.e2e_s[m])),
    }
    pred = {
        "ttft": float(np.mean(ttft[m])),
        "itl": float(np.nanmean(itl(ttft[m], e2e[m], out))),
        "e2e": float(np.mean(e2e[m])),
    }
    return {"measured": meas, "predicted": pred, "error": {k: pred[k] / meas[k] - 1 for k in meas}}


def fit_terms(
    cases: Sequence[LogCase],
    free: Sequence[str],
    replayer: Replayer,
    use: Sequence[np.ndarray] | None = None,
    iterations: int = 12,
    log: Callable[[str], None] = print,
    start: dict[str, float] | None = None,
) -> tuple[list[EngineTerms], list[dict[str, np.ndarray]]]:
    """Fit the ``free`` terms shared by ``cases`` (each case keeps its own base terms otherwise).

    :param use: per case, a bool per scored window: which windows enter the fit (default: all).
    :param start: starting values of some free terms (default: the base engine's, else `START`).
    :returns: the fitted terms per case and the window means under them.
    """
    unknown = [k for k in free if k not in BOUNDS]
    if unknown:
        raise ValueError(f"cannot fit engine term {unknown[0]!r}; fittable: {', '.join(BOUNDS)}")
    base = []
    for c in cases:
        terms = c.profile.engine_terms or EngineTerms()
        if terms.allreduce_step_s is None:
            terms = replace(terms, allreduce_step_s=START["allreduce_step_s"])
        base.append(terms)
    x0 = []
    for k in free:
        value = (start or {}).get(k, getattr(base[0], k))
        x0.append(math.log(value if value and value > 0 else START[k]))
    n_windows = [len(set(c.window[c.window >= 0].tolist())) for c in cases]
    use_l = [np.ones(n, bool) for n in n_windows] if use is None else [np.asarray(u, bool) for u in use]
    problem = _Problem(list(cases), base, list(free), use_l, replayer)
    lo = np.log([BOUNDS[k][0] for k in free])
    hi = np.log([BOUNDS[k][1] for k in free])
    x, means = _levenberg_marquardt(problem, np.asarray(x0), lo, hi, iterations, log)
    return [problem.terms(i, x) for i in range(len(cases))], means


def default_free(cases: Sequence[LogCase], requested: Sequence[str] | None) -> list[str]:
    """The terms to fit: ``requested``, else every term of `DEFAULT_TERMS` the logs determine."""
    if requested is not None:
        return list(requested)
    multi_tp = any(c.profile.tp > 1 for c in cases)
    return [k for k in DEFAULT_TERMS if multi_tp or k not in TP_TERMS]


# The terms fitted by default (chosen by cross-validation on the inference-sim runs, docs/latency.md).
DEFAULT_TERMS = ("overhead_s", "frontend_s", "layer_factor", "compute_factor", "allreduce_bw_factor")


def fit_logs(
    cases: Sequence[LogCase],
    free: Sequence[str] | None = None,
    jobs: int | None = None,
    cross_validate: bool = True,
    iterations: int = 12,
    name: str = "fitted",
    log: Callable[[str], None] = print,
    groups: Sequence[str] | None = None,
    start: dict[str, float] | None = None,
) -> tuple[Engine, dict[str, Any]]:
    """Fit an engine to ``cases`` (all on one GPU family) and cross-validate it.

    :param groups: per case, the fold it is held out with (default: each log on its own), e.g. the
        model, so that the held-out error is that of a model never fitted.
    :returns: the engine and a report: fitted terms, in-sample and held-out errors per log.
    """
    if not cases:
        raise ValueError("no logs to fit")
    keys = {_gpu_key(c.profile) for c in cases}
    if len(keys) > 1:
        raise ValueError(
            f"the logs' profiles are on different GPUs ({', '.join(sorted(keys))}); fit one GPU at a time"
        )
    free = default_free(cases, free)
    replayer = Replayer(jobs if jobs is not None else min(os.cpu_count() or 1, len(cases) * (len(free) + 1)))
    try:
        log(f"fitting {', '.join(free)} to {len(cases)} log(s)")
        terms, means = fit_terms(cases, free, replayer, iterations=iterations, log=log, start=start)
        final = replayer([(c, terms[i]) for i, c in enumerate(cases)])
        report: dict[str, Any] = {
            "fitted_terms": list(free),
            "terms": {k: getattr(terms[0], k) for k in free},
            "logs": [
                {"log": c.name, "profile": c.profile.name, **summary_errors(c, *final[i])}
                for i, c in enumerate(cases)
            ],
            "windows_in_sample": [
                {"log": c.name, **_log_mape(means[i], np.ones(len(means[i]["meas_ttft"]), bool))}
                for i, c in enumerate(cases)
            ],
        }
        if cross_validate:
            report["cross_validation"] = _cross_validate(
                cases, free, replayer, iterations, log, groups, start
            )
    finally:
        replayer.close()
    key = keys.pop()
    engine = Engine(
        name=name,
        description=f"fitted to {len(cases)} request log(s) by python -m burstgym.calibrate fit-logs",
        gpus={key: terms[0]},
        default_gpu=key,
        applies=f"terms fitted on {key.upper()} logs; terms not fitted are the base engine's "
        f"({cases[0].profile.engine})",
        provenance={
            "source_files": [c.log.source for c in cases],
            "profiles": [c.profile.name for c in cases],
            "settings": [asdict(c.settings) for c in cases],
            "fit_date": dt.date.today().isoformat(),
            "generated_by": "python -m burstgym.calibrate fit-logs",
            "report": report,
        },
    )
    return engine, report


def _cross_validate(
    cases: Sequence[LogCase],
    free: Sequence[str],
    replayer: Replayer,
    iterations: int,
    log: Callable[[str], None],
    groups: Sequence[str] | None = None,
    start: dict[str, float] | None = None,
) -> dict[str, Any]:
    """Leave one group of logs out (two or more logs; a group per log by default), or fit the first
    half of one log's windows and predict the second half; the held-out mean TTFT, ITL and E2E errors."""
    folds = []
    labels = list(groups) if groups is not None else [c.name for c in cases]
    if len(cases) >= 2 and len(set(labels)) >= 2:
        for label in dict.fromkeys(labels):
            held = [c for c, g in zip(cases, labels, strict=True) if g == label]
            rest = [c for c, g in zip(cases, labels, strict=True) if g != label]
            log(f"cross-validation: fit without {label}")
            multi_tp = any(c.profile.tp > 1 for c in rest)
            sub = [k for k in free if multi_tp or k not in TP_TERMS]
            terms, _ = fit_terms(rest, sub, replayer, iterations=iterations, log=log, start=start)
            fitted = {k: getattr(terms[0], k) for k in sub}
            work = [(c, replace(c.profile.engine_terms or EngineTerms(), **fitted)) for c in held]
            for c, (ttft, e2e) in zip(held, replayer(work), strict=True):
                folds.append(
                    {"held_out": c.name, "fold": label, "fitted": sub, **summary_errors(c, ttft, e2e)}
                )
        method = "leave one log out" if groups is None else "leave one group out"
        return {"method": method, "folds": folds}
    case = cases[0]
    windows = sorted(set(case.window[case.window >= 0].tolist()))
    half = len(windows) // 2
    if half == 0:
        return {"method": "none (one window)", "folds": []}
    use = np.arange(len(windows)) < half
    log(f"cross-validation: fit the first {half} of {len(windows)} windows of {case.name}")
    terms, _ = fit_terms([case], free, replayer, use=[use], iterations=iterations, log=log, start=start)
    ttft, e2e = replayer([(case, terms[0])])[0]
    held = replace(case, window=np.where(np.isin(case.window, windows[half:]), case.window, -1))
    folds.append(
        {"held_out": f"{case.name} (second half)", "fitted": list(free), **summary_errors(held, ttft, e2e)}
    )
    return {"method": "first half of the windows fitted, second half predicted", "folds": folds}
