"""Loaders for public LLM-serving traces: arrival times and (prompt, output) token counts.

Formats (see docs/workloads.md):
- ``azure``: Azure LLM inference trace 2023 (Splitwise, ISCA'24), CSV with TIMESTAMP,
  ContextTokens, GeneratedTokens; timestamps like ``2023-11-16 18:15:46.6805900``.
- ``burstgpt``: BurstGPT CSV with Timestamp (seconds), Model, Request tokens, Response tokens,
  Total tokens, Log Type. Rows with 0 response tokens are failed requests and are dropped.
- ``mooncake``: Mooncake (FAST'25) JSON lines with timestamp (ms), input_length, output_length,
  hash_ids.

Every loader returns a `Trace` sorted by arrival time (stable, so file order breaks ties) with
times in seconds from the first request. Token counts must be whole numbers; a prompt must be
>= 1 token. An output of 0 tokens is clamped to 1 in the Azure and Mooncake formats (the request
still ran its prefill, which yields the first token), and dropped in BurstGPT (failed requests).
Anything malformed raises a ValueError naming the file, the line and the column or field.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Literal, NamedTuple

import numpy as np
import pandas as pd

Format = Literal["azure", "burstgpt", "mooncake"]

AZURE_COLUMNS = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")
BURSTGPT_COLUMNS = ("Timestamp", "Request tokens", "Response tokens")
MOONCAKE_FIELDS = ("timestamp", "input_length", "output_length")


class Trace(NamedTuple):
    """A request trace in arrival order."""

    arrival: np.ndarray  # [N] float64 seconds from the first request (arrival[0] == 0), non-decreasing
    prompt: np.ndarray  # [N] int32 >= 1, prompt tokens
    output: np.ndarray  # [N] int32 >= 1, output tokens


def load_trace(path: str | Path, fmt: Format | None = None) -> Trace:
    """Load a trace, telling its format from the extension and header unless `fmt` is given."""
    path = Path(path)
    fmt = fmt or detect_format(path)
    loaders = {"azure": load_azure, "burstgpt": load_burstgpt, "mooncake": load_mooncake}
    if fmt not in loaders:
        raise ValueError(f"unknown trace format {fmt!r}; expected one of {sorted(loaders)}")
    return loaders[fmt](path)


def detect_format(path: str | Path) -> Format:
    """``mooncake`` for .jsonl/.json files, else ``azure`` or ``burstgpt`` from the CSV header."""
    path = Path(path)
    if path.suffix.lower() in (".jsonl", ".json"):
        return "mooncake"
    with path.open(encoding="utf-8") as f:
        header = {name.strip() for name in f.readline().split(",")}
    if header >= set(AZURE_COLUMNS):
        return "azure"
    if header >= set(BURSTGPT_COLUMNS):
        return "burstgpt"
    raise ValueError(
        f"{path}: line 1: cannot tell the trace format from the header {sorted(header)}; pass fmt="
    )


def load_azure(path: str | Path) -> Trace:
    """Azure LLM inference trace 2023 (code or conv service)."""
    path = Path(path)
    table = _read_csv(path, AZURE_COLUMNS)
    seconds = pd.to_datetime(table["TIMESTAMP"], format="ISO8601", errors="coerce")
    _fail_where(path, table, seconds.isna(), "TIMESTAMP", "not a timestamp")
    seconds = (seconds - seconds.min()).dt.total_seconds().to_numpy()
    prompt = _tokens(path, table, "ContextTokens", min_tokens=1)
    output = _tokens(path, table, "GeneratedTokens", min_tokens=0)
    return _trace(seconds, prompt, np.maximum(output, 1))


def load_burstgpt(path: str | Path) -> Trace:
    """BurstGPT trace; failed requests (0 response tokens) are dropped."""
    path = Path(path)
    table = _read_csv(path, BURSTGPT_COLUMNS)
    seconds = _numbers(path, table, "Timestamp")
    prompt = _tokens(path, table, "Request tokens", min_tokens=1)
    output = _tokens(path, table, "Response tokens", min_tokens=0)
    ok = output > 0
    if not ok.any():
        raise ValueError(f"{path}: no successful request (every row has 0 response tokens)")
    return _trace(seconds[ok], prompt[ok], output[ok])


def load_mooncake(path: str | Path) -> Trace:
    """Mooncake JSON-lines trace (timestamps in milliseconds)."""
    path = Path(path)
    rows: list[tuple[float, int, int]] = []
    with path.open(encoding="utf-8") as f:
        for line_no, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}: line {line_no}: not valid JSON ({e.msg})") from None
            if not isinstance(record, dict):
                raise ValueError(f"{path}: line {line_no}: expected a JSON object")
            rows.append(
                (
                    _json_number(path, line_no, record, "timestamp", whole=False, low=None),
                    int(_json_number(path, line_no, record, "input_length", whole=True, low=1)),
                    int(_json_number(path, line_no, record, "output_length", whole=True, low=0)),
                )
            )
    if not rows:
        raise ValueError(f"{path}: empty file (no requests)")
    ms, prompt, output = (np.array(column) for column in zip(*rows, strict=True))
    return _trace(ms / 1000.0, prompt, np.maximum(output, 1))


def summary(trace: Trace) -> dict[str, float]:
    """Headline statistics: requests, duration, mean rate, inter-arrival cv, length medians/means."""
    gaps = np.diff(trace.arrival)
    return {
        "requests": float(trace.arrival.size),
        "duration_s": float(trace.arrival[-1]),
        "mean_rate": float(gaps.size / trace.arrival[-1]),
        "interarrival_cv": float(gaps.std() / gaps.mean()),
        "prompt_median": float(np.median(trace.prompt)),
        "prompt_mean": float(trace.prompt.mean()),
        "output_median": float(np.median(trace.output)),
        "output_mean": float(trace.output.mean()),
    }


def _read_csv(path: Path, columns: tuple[str, ...]) -> pd.DataFrame:
    """The CSV as strings, blank lines dropped, with each row's file line number in `_line`."""
    try:
        table = pd.read_csv(path, dtype=str, keep_default_na=False, skip_blank_lines=False)
    except pd.errors.EmptyDataError:
        raise ValueError(f"{path}: empty file (no header)") from None
    except pd.errors.ParserError as e:
        raise ValueError(f"{path}: {e}") from None
    if not isinstance(table.index, pd.RangeIndex):  # pandas reads extra leading fields as an index
        raise ValueError(f"{path}: line 2: more fields than the header's {len(table.columns)}")
    table.columns = [str(c).strip() for c in table.columns]
    missing = [c for c in columns if c not in table.columns]
    if missing:
        raise ValueError(f"{path}: line 1: missing column(s) {missing}; found {list(table.columns)}")
    table["_line"] = np.arange(len(table)) + 2  # line 1 is the header
    table = table[(table[list(columns)] != "").any(axis=1)]  # blank lines
    if table.empty:
        raise ValueError(f"{path}: empty file (a header but no requests)")
    return table


def _fail_where(path: Path, table: pd.DataFrame, bad: pd.Series, column: str, why: str) -> None:
    """Raise for the first row flagged `bad`, naming its line, column and value."""
    bad = np.asarray(bad)
    if bad.any():
        row = table.iloc[int(np.argmax(bad))]
        raise ValueError(f"{path}: line {row['_line']}: column {column!r}: {why}: {row[column]!r}")


def _numbers(path: Path, table: pd.DataFrame, column: str) -> np.ndarray:
    values = pd.to_numeric(table[column].str.strip(), errors="coerce")
    _fail_where(path, table, ~np.isfinite(values.to_numpy(dtype=float)), column, "not a number")
    return values.to_numpy(dtype=float)


def _tokens(path: Path, table: pd.DataFrame, column: str, min_tokens: int) -> np.ndarray:
    values = _numbers(path, table, column)
    _fail_where(path, table, values != np.floor(values), column, "not a whole number of tokens")
    _fail_where(path, table, values < min_tokens, column, f"token count below {min_tokens}")
    return values.astype(np.int64)


def _json_number(path: Path, line_no: int, record: dict, name: str, whole: bool, low: int | None) -> float:
    where = f"{path}: line {line_no}: field {name!r}"
    if name not in record:
        raise ValueError(f"{where}: missing")
    value = record[name]
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not np.isfinite(value):
        raise ValueError(f"{where}: not a number: {value!r}")
    if whole and value != int(value):
        raise ValueError(f"{where}: not a whole number of tokens: {value!r}")
    if low is not None and value < low:
        raise ValueError(f"{where}: token count below {low}: {value!r}")
    return float(value)


def _trace(seconds: np.ndarray, prompt: np.ndarray, output: np.ndarray) -> Trace:
    """Sort by time (stably), start the clock at the first request, fix dtypes."""
    order = np.argsort(seconds, kind="stable")
    seconds = seconds[order]
    return Trace(
        (seconds - seconds[0]).astype(np.float64),
        prompt[order].astype(np.int32),
        output[order].astype(np.int32),
    )
