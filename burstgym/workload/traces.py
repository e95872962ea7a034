"""Loaders for public LLM-serving traces: arrival times and (prompt, output) token counts.

Formats (see docs/workloads.md):
- ``azure``: Azure LLM inference trace 2023 (Splitwise, ISCA'24), CSV with TIMESTAMP,
  ContextTokens, GeneratedTokens; timestamps like ``2023-11-16 18:15:46.6805900``.
- ``burstgpt``: BurstGPT CSV with Timestamp (seconds), Model, Request tokens, Response tokens,
  Total tokens, Log Type. Rows with 0 response tokens are failed requests and are dropped.
- ``mooncake``: Mooncake (FAST'25) JSON lines with timestamp (ms), input_length, output_length,
  hash_ids (ids of the prompt's 512-token blocks: equal leading ids mean a shared prefix).

Every loader returns a `Trace` sorted by arrival time (stable, so file order breaks ties) with
times in seconds from the first request. Token counts must be whole numbers that the simulator's
int32 holds; a prompt must be >= 1 token. An output of 0 tokens is clamped to 1 in the Azure and
Mooncake formats (the request still ran its prefill, which yields the first token), and dropped
in BurstGPT (failed requests). Block ids must be integers in [0, 2**63). Anything malformed
raises a ValueError naming the file, the line and the column or field; a path that is not a
readable text file (a directory, a gzip archive, binary data) is refused naming the file.

The CSV formats are read with pandas (installed with `pip install "burstgym[traces]"`, or with
`[train]`), imported when a CSV trace is loaded.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Literal, NamedTuple, TextIO

import numpy as np

from burstgym.workload.base import INT32_MAX

if TYPE_CHECKING:
    import pandas as pd

Format = Literal["azure", "burstgpt", "mooncake"]

AZURE_COLUMNS = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")
BURSTGPT_COLUMNS = ("Timestamp", "Request tokens", "Response tokens")
MOONCAKE_FIELDS = ("timestamp", "input_length", "output_length")


MOONCAKE_BLOCK_TOKENS = 512  # tokens per hash_ids block in the Mooncake traces
MAX_PREFIX_BLOCKS = 512  # default bound on hash_ids per request (a longer list is refused)
MAX_HASH_ID = 2**63 - 1  # block ids are read as int64 before they are renumbered
GZIP_MAGIC = b"\x1f\x8b"


class Trace(NamedTuple):
    """A request trace in arrival order, with the prompts' prefix-block ids when the format has them."""

    arrival: np.ndarray  # [N] float64 seconds from the first request (arrival[0] == 0), non-decreasing
    prompt: np.ndarray  # [N] int32 >= 1, prompt tokens
    output: np.ndarray  # [N] int32 >= 1, output tokens
    hash_ids: np.ndarray | None = None  # [N, B] int32 block ids, dense from 0, -1 past a prompt's blocks
    block_tokens: int = 0  # tokens per block of `hash_ids` (the last block of a prompt may be shorter)


def load_trace(path: str | Path, fmt: Format | None = None, max_blocks: int = MAX_PREFIX_BLOCKS) -> Trace:
    """Load a trace, telling its format from the extension and header unless `fmt` is given.

    `max_blocks` bounds the prefix-block ids of one request (Mooncake): a request with more is
    refused with its file, line and the bound, never cut.
    """
    path = Path(path)
    check_text_file(path)
    fmt = fmt or detect_format(path)
    if fmt == "mooncake":
        return load_mooncake(path, max_blocks)
    loaders = {"azure": load_azure, "burstgpt": load_burstgpt}
    if fmt not in loaders:
        raise ValueError(f"unknown trace format {fmt!r}; expected one of azure, burstgpt, mooncake")
    return loaders[fmt](path)


def detect_format(path: str | Path) -> Format:
    """``mooncake`` for .jsonl/.json files, else ``azure`` or ``burstgpt`` from the CSV header."""
    path = Path(path)
    if path.suffix.lower() in (".jsonl", ".json"):
        return "mooncake"
    with _text(path) as f:
        header = {name.strip() for name in f.readline().split(",")}
    if header >= set(AZURE_COLUMNS):
        return "azure"
    if header >= set(BURSTGPT_COLUMNS):
        return "burstgpt"
    raise ValueError(
        f"{path}: line 1: cannot tell the trace format from the header {sorted(header)}; pass fmt="
    )


def check_text_file(path: Path) -> None:
    """Refuse, naming the file, a path that is missing, a directory, gzip-compressed or binary
    (a NUL byte in its first 64 KiB); text that is not UTF-8 is refused where it is read."""
    if not path.exists():
        raise FileNotFoundError(f"trace file {str(path)!r} does not exist")
    if path.is_dir():
        raise ValueError(f"{path}: a directory, not a trace file")
    with path.open("rb") as f:
        head = f.read(65536)
    if head.startswith(GZIP_MAGIC):
        raise ValueError(f"{path}: gzip-compressed; decompress it first")
    nul = head.find(b"\0")
    if nul >= 0:
        raise ValueError(f"{path}: binary data (byte {nul} is NUL), not a text trace")


@contextmanager
def _text(path: Path) -> Iterator[TextIO]:
    """The file opened as UTF-8 text; a byte that is not UTF-8 is refused naming the file."""
    try:
        with path.open(encoding="utf-8") as f:
            yield f
    except UnicodeDecodeError as e:
        raise ValueError(f"{path}: not UTF-8 text ({e.reason}: {e.object[e.start : e.end]!r})") from None


def _pandas():
    try:
        import pandas as pd
    except ImportError:
        raise ImportError(
            'reading CSV traces needs pandas: pip install "burstgym[traces]" (or pandas)'
        ) from None
    return pd


def load_azure(path: str | Path) -> Trace:
    """Azure LLM inference trace 2023 (code or conv service)."""
    path = Path(path)
    table = _read_csv(path, AZURE_COLUMNS)
    pd = _pandas()
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


def load_mooncake(path: str | Path, max_blocks: int = MAX_PREFIX_BLOCKS) -> Trace:
    """Mooncake JSON-lines trace (timestamps in milliseconds) with its prompts' block ids.

    `hash_ids` must be a list of integers, one per 512-token block of the prompt
    (``len == ceil(input_length / 512)``), at most `max_blocks` of them. Ids are renumbered densely
    in order of first appearance. Equal ids must name blocks of equal length (a block's id names
    its content), which is checked.
    """
    path = Path(path)
    rows: list[tuple[float, int, int]] = []
    blocks: list[list[int]] = []
    lines: list[int] = []
    with _text(path) as f:
        for line_no, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}: line {line_no}: not valid JSON ({e.msg})") from None
            if not isinstance(record, dict):
                raise ValueError(f"{path}: line {line_no}: expected a JSON object")
            prompt = int(_json_number(path, line_no, record, "input_length", whole=True, low=1))
            rows.append(
                (
                    _json_number(path, line_no, record, "timestamp", whole=False, low=None),
                    prompt,
                    int(_json_number(path, line_no, record, "output_length", whole=True, low=0)),
                )
            )
            blocks.append(_hash_ids(path, line_no, record, prompt, max_blocks))
            lines.append(line_no)
    if not rows:
        raise ValueError(f"{path}: empty file (no requests)")
    ms, prompt, output = (np.array(column) for column in zip(*rows, strict=True))
    ids = _dense_ids(path, blocks, prompt, lines)
    return _trace(ms / 1000.0, prompt, np.maximum(output, 1), ids, MOONCAKE_BLOCK_TOKENS)


def _hash_ids(path: Path, line_no: int, record: dict, prompt: int, max_blocks: int) -> list[int]:
    where = f"{path}: line {line_no}: field 'hash_ids'"
    if "hash_ids" not in record:
        raise ValueError(f"{where}: missing (the prompt's block ids are needed for prefix caching)")
    ids = record["hash_ids"]
    if not isinstance(ids, list) or any(isinstance(i, bool) or not isinstance(i, int) for i in ids):
        raise ValueError(f"{where}: expected a list of integers, got {str(ids)[:60]!r}")
    bad = next((i for i in ids if not 0 <= i <= MAX_HASH_ID), None)
    if bad is not None:
        raise ValueError(f"{where}: block id {bad} is outside [0, 2**63 - 1]")
    expected = -(-prompt // MOONCAKE_BLOCK_TOKENS)
    if len(ids) != expected:
        raise ValueError(
            f"{where}: {len(ids)} ids for input_length {prompt}, expected ceil({prompt} / "
            f"{MOONCAKE_BLOCK_TOKENS}) = {expected}"
        )
    if len(ids) > max_blocks:
        raise ValueError(
            f"{where}: {len(ids)} blocks exceed the bound of {max_blocks} blocks per request "
            "(raise max_prefix_blocks to replay it)"
        )
    return ids


def _dense_ids(path: Path, blocks: list[list[int]], prompt: np.ndarray, lines: list[int]) -> np.ndarray:
    """[N, B] dense block ids (-1 padded), checking that an id always names a block of one length."""
    width = max(len(b) for b in blocks)
    raw = np.full((len(blocks), width), -1, dtype=np.int64)
    for i, b in enumerate(blocks):
        raw[i, : len(b)] = b
    valid = raw >= 0
    j = np.arange(width)[None, :]
    length = np.clip(prompt[:, None] - j * MOONCAKE_BLOCK_TOKENS, 0, MOONCAKE_BLOCK_TOKENS)
    uniq, first, dense = np.unique(raw[valid], return_index=True, return_inverse=True)
    order = np.argsort(first, kind="stable")  # number ids in order of first appearance
    rank = np.empty_like(order)
    rank[order] = np.arange(order.size)
    lengths = length[valid]
    ref = lengths[first]
    bad = np.flatnonzero(lengths != ref[dense])
    if bad.size:
        row = int(np.nonzero(valid)[0][bad[0]])
        raise ValueError(
            f"{path}: line {lines[row]}: field 'hash_ids': block id {uniq[dense[bad[0]]]} names blocks of "
            f"{ref[dense[bad[0]]]} and {lengths[bad[0]]} tokens (an id must name one block content)"
        )
    out = np.full(raw.shape, -1, dtype=np.int32)
    out[valid] = rank[dense]
    return out


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
    pd = _pandas()
    try:
        with _text(path) as f:
            table = pd.read_csv(f, dtype=str, keep_default_na=False, skip_blank_lines=False)
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
    values = _pandas().to_numeric(table[column].str.strip(), errors="coerce")
    _fail_where(path, table, ~np.isfinite(values.to_numpy(dtype=float)), column, "not a number")
    return values.to_numpy(dtype=float)


def _tokens(path: Path, table: pd.DataFrame, column: str, min_tokens: int) -> np.ndarray:
    values = _numbers(path, table, column)
    _fail_where(path, table, values != np.floor(values), column, "not a whole number of tokens")
    _fail_where(path, table, values < min_tokens, column, f"token count below {min_tokens}")
    _fail_where(path, table, values > INT32_MAX, column, f"token count above {INT32_MAX:,} (int32)")
    return values.astype(np.int64)


def _json_number(path: Path, line_no: int, record: dict, name: str, whole: bool, low: int | None) -> float:
    where = f"{path}: line {line_no}: field {name!r}"
    if name not in record:
        raise ValueError(f"{where}: missing")
    value = record[name]
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{where}: not a number: {value!r}")
    try:
        finite = math.isfinite(float(value))
    except OverflowError:  # an integer beyond any float
        finite = False
    if not finite:
        raise ValueError(f"{where}: not a finite number: {str(value)[:40]}")
    if whole and value != int(value):
        raise ValueError(f"{where}: not a whole number of tokens: {value!r}")
    if low is not None and value < low:
        raise ValueError(f"{where}: token count below {low}: {value!r}")
    if whole and value > INT32_MAX:
        raise ValueError(f"{where}: token count above {INT32_MAX:,} (int32): {value!r}")
    return float(value)


def _trace(
    seconds: np.ndarray,
    prompt: np.ndarray,
    output: np.ndarray,
    hash_ids: np.ndarray | None = None,
    block_tokens: int = 0,
) -> Trace:
    """Sort by time (stably), start the clock at the first request, fix dtypes."""
    order = np.argsort(seconds, kind="stable")
    seconds = seconds[order]
    return Trace(
        (seconds - seconds[0]).astype(np.float64),
        prompt[order].astype(np.int32),
        output[order].astype(np.int32),
        None if hash_ids is None else hash_ids[order],
        block_tokens,
    )
